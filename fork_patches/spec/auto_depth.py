"""``K=auto`` inside the engine: each scheduling step drafts the depth ``depth_policy`` picks for
the live context, and the draft positions each round reached are exported on ``/metrics``.

How it rides on vLLM. vLLM 0.32 already drafts a per-step depth: when the speculative config
holds ``num_speculative_tokens_per_batch_size``, the scheduler sets
``SchedulerOutput.num_spec_tokens_to_schedule`` from a batch-size table and the model runner's
proposer drafts that many tokens (``gpu_model_runner.propose_draft_token_ids``). The launcher
passes a one-row table (every batch size drafts the ladder's deepest depth), which turns that
path on with the engine's own validation; the hook ``auto-depth-per-step`` then replaces the
table's answer, step by step, with the policy's decision, before the scheduler books the step
(``_update_after_schedule``, where the asynchronous scheduler reads it for its placeholders).

Acceptance comes from the scheduler's own per-request verdicts (``make_spec_decoding_stats``:
drafted and accepted tokens of each request each step), counted per draft position, because
vLLM's drafts counter cannot tell a depth-3 round from a depth-7 one.

Observed from outside: ``qpn:spec_decode_num_draft_tokens_per_pos`` (one ``position`` label per
draft slot, like vLLM's accepted-per-position counter) counts how many rounds drafted each
position, so rounds at depth d are the position d-1 count less the position d count (cpu
engine). ``qpn:spec_decode_rounds_per_depth`` and ``qpn:spec_decode_accepted_tokens_per_depth``
(label ``depth``) give the rounds and accepted tokens at each depth: tokens per round per depth.
On both engines each rank's census counts the scheduling steps its drafter drafted at each depth
(``draft_depth_steps``, hook ``auto-depth-draft-depth``); the ``served_depth`` gate reads that,
else the per-position counter (scripts/launcher/boot_gates.py).

On 1Cat-vLLM (1.2.2 and 1.3.0) there is no per-step depth path: the scheduler schedules
``len(request.spec_token_ids)`` draft tokens, which the async scheduler sets to
``num_speculative_tokens`` placeholders every step (v1/core/sched/async_scheduler.py), the model
runner indexes the previous step's drafts as rows of ``num_spec_tokens`` columns
(gpu_model_runner.py ``_prepare_input_ids``: ``start = prev_index * self.num_spec_tokens``), and
full CUDA graphs exist only for uniform batches of ``1 + num_speculative_tokens`` tokens a request
(v1/cudagraph_dispatcher.py ``uniform_decode_query_len``). What does vary is the drafter's own
loop: ``SpecDecodeBaseProposer.propose`` runs ``num_speculative_tokens - 1`` sequential drafter
steps (v1/spec_decode/llm_base_proposer.py), each of which reads the whole KV cache; that is the
cost that grows with the live context. So on 1Cat the policy's depth d shortens only that loop:

- ``auto-depth-per-step`` (``Scheduler._update_after_schedule``) decides d for the step and
  attaches it to the SchedulerOutput (``qpn_draft_depth``; a plain dataclass the executor
  pickles to every rank, so all tensor-parallel ranks draft the same depth), with the depth each
  scheduled request's verified drafts were drafted at (``qpn_verify_depths``);
- ``auto-depth-draft-depth`` (``GPUModelRunner.propose_draft_token_ids``) hands d to the drafter
  for that call and counts the step in the census (``draft_depth_steps``);
- ``auto-depth-drafter-loop`` (``SpecDecodeBaseProposer.propose``) runs the engine's propose with
  ``num_speculative_tokens = d`` (d - 1 loop steps; d = 1 takes the engine's own one-token exit)
  and returns d drafted columns, then fills columns d..K-1 with the last drafted token so the
  tensor keeps the K columns every consumer indexes. The verify batch therefore stays
  N x (K + 1) wide: the same shapes, full CUDA graphs and attention routes as a fixed-K server;
  the filler tokens are verified like any draft (greedy verification is exact whatever the
  draft; with drafts sampled greedily, no draft probabilities, the rejection sampler's output
  distribution is the target's for any deterministic proposal), and one accepted by chance is a
  free token. The policy prices this (``DepthPolicy.fixed_verify``: K verify rows every round);
- ``auto-depth-verify-depth`` (``Scheduler.update_from_output``) lets the acceptance hook count
  only the d positions really drafted (the engine's stats say K).

Settings (set by the launcher from ``K=auto``, ``DEPTH_LADDER``, ``DEPTH_CONSTANTS``,
``DEPTH_PRIOR_ROUNDS``; docs/serving.md): ``QPN_DEPTH_LADDER`` (absent: fixed depth, the hooks
do nothing), ``QPN_DEPTH_CONSTANTS`` (JSON cost overrides), ``QPN_DEPTH_PRIOR_ROUNDS``,
``QPN_DEPTH_VERIFY`` (``deepest`` on 1Cat: the verify width stays the deepest depth's).
"""
from __future__ import annotations

import functools
import logging
import os
import threading

from qpn.fork_patches.spec import depth_policy

logger = logging.getLogger(__name__)

ENV_LADDER = "QPN_DEPTH_LADDER"
ENV_CONSTANTS = "QPN_DEPTH_CONSTANTS"
ENV_PRIOR_ROUNDS = "QPN_DEPTH_PRIOR_ROUNDS"
ENV_VERIFY = "QPN_DEPTH_VERIFY"
VERIFY_DEEPEST = "deepest"  # 1Cat: drafts the chosen depth, verifies the deepest depth's width
# Attributes we add to the engine's objects (1Cat): on the SchedulerOutput, the depth the step
# drafts and {request: depth its verified drafts were drafted at}; on the drafter, the depth of
# its next propose call and the depth its last one drafted.
DRAFT_DEPTH_ATTR = "qpn_draft_depth"
VERIFY_DEPTHS_ATTR = "qpn_verify_depths"
PROPOSER_DEPTH_ATTR = "_qpn_next_draft_depth"
PROPOSER_DRAFTED_ATTR = "_qpn_drafted_depth"
# Scheduling steps between prunings of the per-request depth map (finished requests dropped).
_PRUNE_EVERY = 256
DRAFT_PER_POS_METRIC = "qpn:spec_decode_num_draft_tokens_per_pos"
# Per drafted depth d (a step drafts one depth for all its requests; a request trimmed by its
# grammar or its length counts at the depth it reached): rounds, and tokens they accepted, so
# tokens per round at depth d = 1 + accepted / rounds.
ROUNDS_PER_DEPTH_METRIC = "qpn:spec_decode_rounds_per_depth"
ACCEPTED_PER_DEPTH_METRIC = "qpn:spec_decode_accepted_tokens_per_depth"


def policy_from_env(environ=None) -> depth_policy.DepthPolicy | None:
    """The policy the launcher asked for; None when the server runs a fixed depth."""
    environ = os.environ if environ is None else environ
    ladder = environ.get(ENV_LADDER)
    if not ladder:
        return None
    rounds = environ.get(ENV_PRIOR_ROUNDS)
    return depth_policy.policy_from_settings(
        ladder, environ.get(ENV_CONSTANTS) or None,
        float(rounds) if rounds else depth_policy.DEFAULT_PRIOR_ROUNDS,
        fixed_verify=environ.get(ENV_VERIFY, "").strip().lower() == VERIFY_DEEPEST)


class DepthState:
    """One scheduler's policy, its per-position counters and the depths it chose."""

    def __init__(self, policy: depth_policy.DepthPolicy) -> None:
        self.policy = policy
        n = policy.max_depth
        self.drafted = [0] * n
        self.accepted = [0] * n
        self.chosen: dict[int, int] = {}  # depth -> scheduling steps that drafted it
        self.last: depth_policy.DepthDecision | None = None
        # 1Cat: the depth each request's latest drafts were drafted at, and during
        # update_from_output the {request: depth} of the drafts that step verified.
        self.last_depth: dict[str, int] = {}
        self.verifying: dict[str, int] | None = None
        self._steps = 0

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, len(self.drafted))):
            self.drafted[i] += 1
        for i in range(min(accepted, drafted, len(self.accepted))):
            self.accepted[i] += 1

    def counters(self) -> depth_policy.AcceptanceCounters:
        return depth_policy.AcceptanceCounters(drafted=tuple(self.drafted),
                                               accepted=tuple(self.accepted))

    def decide(self, contexts: list[int]) -> int:
        decision = self.policy.decide(contexts, self.counters())
        if self.last is None or decision.k != self.last.k:
            logger.info("volta-qpn: K=auto %s", decision.log_line())
        self.last = decision
        self.chosen[decision.k] = self.chosen.get(decision.k, 0) + 1
        return decision.k


def _state(scheduler) -> DepthState | None:
    state = getattr(scheduler, "_qpn_depth", False)
    if state is False:
        policy = policy_from_env()
        state = DepthState(policy) if policy is not None else None
        if state is not None and policy.max_depth != getattr(scheduler, "num_spec_tokens", None):
            raise ValueError(f"K=auto: the ladder's deepest depth {policy.max_depth} is not the "
                             f"engine's num_speculative_tokens {scheduler.num_spec_tokens}; start "
                             "the server through scripts/serve-qwen38-native.sh, which sets both")
        scheduler._qpn_depth = state
    return state


def wrap_update_after_schedule(original):
    """``Scheduler._update_after_schedule(scheduler_output)``: first the policy's depth for the
    longest live context among the scheduled requests, then the engine's bookkeeping."""

    @functools.wraps(original)
    def _update_after_schedule(self, scheduler_output):
        state = _state(self)
        if (state is not None and getattr(self, "dynamic_sd_lookup", None) is not None
                and scheduler_output.num_scheduled_tokens):
            contexts = [self.requests[r].num_tokens for r in scheduler_output.num_scheduled_tokens
                        if r in self.requests]
            if contexts:
                scheduler_output.num_spec_tokens_to_schedule = state.decide(contexts)
        return original(self, scheduler_output)

    return _update_after_schedule


def wrap_update_after_schedule_fixed_verify(original):
    """1Cat ``Scheduler._update_after_schedule(scheduler_output)``: the policy's depth for the
    longest live context among the scheduled requests, attached to the step's SchedulerOutput
    for the workers' drafter (``qpn_draft_depth``), with the depth each scheduled request's
    drafts under verification were drafted at (``qpn_verify_depths``); then the engine's
    bookkeeping, unchanged (the async subclass still books K placeholders)."""

    @functools.wraps(original)
    def _update_after_schedule(self, scheduler_output):
        state = _state(self)
        if state is not None and scheduler_output.num_scheduled_tokens:
            scheduled = [r for r in scheduler_output.num_scheduled_tokens if r in self.requests]
            if scheduled:
                depth = state.decide([self.requests[r].num_tokens for r in scheduled])
                deepest = state.policy.max_depth
                setattr(scheduler_output, VERIFY_DEPTHS_ATTR,
                        {r: state.last_depth.get(r, deepest) for r in scheduled})
                setattr(scheduler_output, DRAFT_DEPTH_ATTR, depth)
                for r in scheduled:
                    state.last_depth[r] = depth
                state._steps += 1
                if state._steps % _PRUNE_EVERY == 0:
                    state.last_depth = {r: d for r, d in state.last_depth.items()
                                        if r in self.requests}
        return original(self, scheduler_output)

    return _update_after_schedule


def wrap_update_from_output(original):
    """1Cat ``Scheduler.update_from_output(scheduler_output, model_runner_output)``: while the
    engine books the step, the acceptance hook knows the depth each verified draft row was
    really drafted at (the engine counts K)."""

    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        state = _state(self)
        if state is None:
            return original(self, scheduler_output, model_runner_output)
        state.verifying = getattr(scheduler_output, VERIFY_DEPTHS_ATTR, None)
        try:
            return original(self, scheduler_output, model_runner_output)
        finally:
            state.verifying = None

    return update_from_output


def _worker_depth(scheduler_output) -> int | None:
    """The depth this step drafts, as the worker sees it: 1Cat's attached decision, else vLLM
    0.32's ``num_spec_tokens_to_schedule`` (which auto-depth-per-step set); None at fixed K."""
    if not os.environ.get(ENV_LADDER):
        return None
    depth = getattr(scheduler_output, DRAFT_DEPTH_ATTR, None)
    if depth is None:
        depth = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
    return depth if isinstance(depth, int) and not isinstance(depth, bool) else None


def wrap_propose_draft_token_ids(original):
    """``GPUModelRunner.propose_draft_token_ids``: under K=auto, give the drafter this step's
    depth (1Cat; vLLM 0.32 passes it itself) and count the step, at the depth really drafted,
    in this rank's census (``draft_depth_steps``)."""

    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        depth = _worker_depth(scheduler_output)
        drafter = getattr(self, "drafter", None)
        if depth is not None and drafter is not None:
            setattr(drafter, PROPOSER_DEPTH_ATTR, depth)
            setattr(drafter, PROPOSER_DRAFTED_ATTR, None)
        try:
            drafts = original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                              hidden_states, sample_hidden_states, aux_hidden_states,
                              spec_decode_metadata, common_attn_metadata, slot_mappings)
        finally:
            if depth is not None and drafter is not None:
                setattr(drafter, PROPOSER_DEPTH_ATTR, None)
        if depth is not None:
            drafted = getattr(drafter, PROPOSER_DRAFTED_ATTR, None) if drafter is not None else None
            from qpn.fork_patches.route_census.census import CENSUS

            CENSUS.count_draft_depth(drafted if drafted is not None else depth)
        return drafts

    return propose_draft_token_ids


def pad_draft_columns(drafts, width: int):
    """``drafts`` (one row per request, d columns) widened to ``width`` columns with each row's
    last drafted token: every consumer of 1Cat's draft tensor indexes rows of K columns."""
    if isinstance(drafts, list):
        return [list(row) + [row[-1]] * (width - len(row)) if row else list(row) for row in drafts]
    import torch

    missing = width - drafts.shape[1]
    if missing <= 0:
        return drafts
    return torch.cat([drafts, drafts[:, -1:].expand(drafts.shape[0], missing)], dim=1).contiguous()


def _can_shorten(proposer) -> str | None:
    """Why the drafter loop must run its full depth this call (None: it may be shortened)."""
    if getattr(proposer, "parallel_drafting", False):
        return "parallel drafting drafts every position in one pass"
    if getattr(proposer, "_enable_probabilistic_draft_probs", False):
        # Draft probabilities are kept per drafted position and aligned with the K verified
        # ones (gpu_model_runner.get_aligned_draft_probs): a filler column has none.
        return "probabilistic drafting keeps draft probabilities for every position"
    return None


_LOGGED_FULL: set[str] = set()


def wrap_proposer_propose(original):
    """1Cat ``SpecDecodeBaseProposer.propose``: draft only the depth this step asked for (its loop
    reads ``self.num_speculative_tokens`` when it runs), then widen the result to K columns."""

    @functools.wraps(original)
    def propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        args = (target_token_ids, target_positions, target_hidden_states, next_token_ids,
                token_indices_to_sample, common_attn_metadata, sampling_metadata)
        kwargs = dict(mm_embed_inputs=mm_embed_inputs,
                      num_rejected_tokens_gpu=num_rejected_tokens_gpu, slot_mappings=slot_mappings)
        full = self.num_speculative_tokens
        depth = getattr(self, PROPOSER_DEPTH_ATTR, None)
        reason = None if depth is None or not 1 <= depth < full else _can_shorten(self)
        if depth is None or not 1 <= depth < full or reason is not None:
            if reason is not None and reason not in _LOGGED_FULL:
                _LOGGED_FULL.add(reason)
                logger.warning("volta-qpn: K=auto drafts the full depth %d: %s", full, reason)
            drafts = original(self, *args, **kwargs)
            setattr(self, PROPOSER_DRAFTED_ATTR, full)
            return drafts
        self.num_speculative_tokens = depth
        try:
            drafts = original(self, *args, **kwargs)
        finally:
            self.num_speculative_tokens = full
        setattr(self, PROPOSER_DRAFTED_ATTR, depth)
        return pad_draft_columns(drafts, full)

    return propose


def wrap_make_spec_decoding_stats(original):
    """``Scheduler.make_spec_decoding_stats(...)``: every request's verdict also feeds the
    per-position counters the policy learns acceptance from."""

    @functools.wraps(original)
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        state = _state(self)
        if state is not None and num_draft_tokens:
            drafted = num_draft_tokens - (num_invalid_spec_tokens or {}).get(request_id, 0)
            if state.verifying:  # 1Cat: K rows verified, only the first d were drafted
                drafted = min(drafted, state.verifying.get(request_id, drafted))
            state.observe(drafted, num_accepted_tokens)
        return original(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                        num_invalid_spec_tokens, request_id)

    return make_spec_decoding_stats


# ---- /metrics: rounds that drafted each position, rounds and tokens per depth (frontend) -------
COUNTERS: dict[str, object] = {}
_COUNTER_LOCK = threading.Lock()
_DOCS = {DRAFT_PER_POS_METRIC: ("position", "Rounds that drafted each position (volta-qpn)."),
         ROUNDS_PER_DEPTH_METRIC: ("depth", "Speculation rounds per drafted depth (volta-qpn)."),
         ACCEPTED_PER_DEPTH_METRIC: ("depth", "Accepted draft tokens per drafted depth (volta-qpn).")}


def _counter(counter_cls, name: str, labelnames: list[str]):
    """One counter of each name per process: prometheus_client refuses a second registration."""
    with _COUNTER_LOCK:
        if name not in COUNTERS:
            label, doc = _DOCS[name]
            COUNTERS[name] = counter_cls(name=name, documentation=doc,
                                          labelnames=labelnames + [label])
        return COUNTERS[name]


def wrap_spec_prom_init(original):
    """``SpecDecodingProm.__init__``: beside vLLM's accepted-per-position counter, one per
    position for the rounds that drafted it, with the same labels."""

    @functools.wraps(original)
    def __init__(self, speculative_config, labelnames, per_engine_labelvalues, *args, **kwargs):
        original(self, speculative_config, labelnames, per_engine_labelvalues, *args, **kwargs)
        self._qpn_drafted_per_pos, self._qpn_per_depth = {}, {}
        if not getattr(self, "spec_decoding_enabled", False) or getattr(self, "is_diffusion", False):
            return
        k = speculative_config.num_speculative_tokens
        labels = list(labelnames)
        drafted = _counter(self._counter_cls, DRAFT_PER_POS_METRIC, labels)
        rounds = _counter(self._counter_cls, ROUNDS_PER_DEPTH_METRIC, labels)
        accepted = _counter(self._counter_cls, ACCEPTED_PER_DEPTH_METRIC, labels)
        for idx, lv in per_engine_labelvalues.items():
            self._qpn_drafted_per_pos[idx] = [drafted.labels(*lv, str(pos)) for pos in range(k)]
            self._qpn_per_depth[idx] = {d: (rounds.labels(*lv, str(d)), accepted.labels(*lv, str(d)))
                                        for d in range(1, k + 1)}

    return __init__


def wrap_spec_prom_observe(original):
    @functools.wraps(original)
    def observe(self, spec_decoding_stats, engine_idx: int = 0):
        original(self, spec_decoding_stats, engine_idx)
        per_pos = getattr(spec_decoding_stats, "num_draft_tokens_per_pos", None) or []
        for counter, n in zip(getattr(self, "_qpn_drafted_per_pos", {}).get(engine_idx, []), per_pos):
            counter.inc(n)
        depth = sum(1 for n in per_pos if n)  # positions this step drafted
        slot = getattr(self, "_qpn_per_depth", {}).get(engine_idx, {}).get(depth)
        if slot is not None and spec_decoding_stats.num_drafts:
            slot[0].inc(spec_decoding_stats.num_drafts)
            slot[1].inc(spec_decoding_stats.num_accepted_tokens)

    return observe
