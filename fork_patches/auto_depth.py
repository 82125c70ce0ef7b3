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
position, so rounds at depth d are the position d-1 count less the position d count; the
``served_depth`` gate reads it (scripts/launcher/boot_gates.py).
``qpn:spec_decode_rounds_per_depth`` and ``qpn:spec_decode_accepted_tokens_per_depth`` (label
``depth``) give the rounds and accepted tokens at each depth: tokens per round per depth.

Settings (set by the launcher from ``K=auto``, ``DEPTH_LADDER``, ``DEPTH_CONSTANTS``,
``DEPTH_PRIOR_ROUNDS``; docs/serving.md): ``QPN_DEPTH_LADDER`` (absent: fixed depth, the hooks
do nothing), ``QPN_DEPTH_CONSTANTS`` (JSON cost overrides), ``QPN_DEPTH_PRIOR_ROUNDS``.
"""
from __future__ import annotations

import functools
import logging
import os
import threading

from qpn.fork_patches import depth_policy

logger = logging.getLogger(__name__)

ENV_LADDER = "QPN_DEPTH_LADDER"
ENV_CONSTANTS = "QPN_DEPTH_CONSTANTS"
ENV_PRIOR_ROUNDS = "QPN_DEPTH_PRIOR_ROUNDS"
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
        float(rounds) if rounds else depth_policy.DEFAULT_PRIOR_ROUNDS)


class DepthState:
    """One scheduler's policy, its per-position counters and the depths it chose."""

    def __init__(self, policy: depth_policy.DepthPolicy) -> None:
        self.policy = policy
        n = policy.max_depth
        self.drafted = [0] * n
        self.accepted = [0] * n
        self.chosen: dict[int, int] = {}  # depth -> scheduling steps that drafted it
        self.last: depth_policy.DepthDecision | None = None

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


def wrap_make_spec_decoding_stats(original):
    """``Scheduler.make_spec_decoding_stats(...)``: every request's verdict also feeds the
    per-position counters the policy learns acceptance from."""

    @functools.wraps(original)
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        state = _state(self)
        if state is not None and num_draft_tokens:
            drafted = num_draft_tokens - (num_invalid_spec_tokens or {}).get(request_id, 0)
            state.observe(drafted, num_accepted_tokens)
        return original(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                        num_invalid_spec_tokens, request_id)

    return make_spec_decoding_stats


# ---- /metrics: rounds that drafted each position, rounds and tokens per depth (frontend) -------
_COUNTERS: dict[str, object] = {}
_COUNTER_LOCK = threading.Lock()
_DOCS = {DRAFT_PER_POS_METRIC: ("position", "Rounds that drafted each position (volta-qpn)."),
         ROUNDS_PER_DEPTH_METRIC: ("depth", "Speculation rounds per drafted depth (volta-qpn)."),
         ACCEPTED_PER_DEPTH_METRIC: ("depth", "Accepted draft tokens per drafted depth (volta-qpn).")}


def _counter(counter_cls, name: str, labelnames: list[str]):
    """One counter of each name per process: prometheus_client refuses a second registration."""
    with _COUNTER_LOCK:
        if name not in _COUNTERS:
            label, doc = _DOCS[name]
            _COUNTERS[name] = counter_cls(name=name, documentation=doc,
                                          labelnames=labelnames + [label])
        return _COUNTERS[name]


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
