"""K=auto (issue 28 items 1-2): the launcher's settings and refusals, the engine hooks over a
scheduler stand-in, the drafted-per-position counter and the served_depth gate under auto (fast);
then a real cpu-engine server whose depth follows the context, with greedy output identical to
the same requests without speculation (engine). The policy's own decision table is
tests/test_depth_policy.py."""
from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from qpn.fork_patches.spec import auto_depth, depth_policy
from qpn.scripts.launcher import boot_gates
from qpn.scripts.launcher.capture_ladder import CaptureSpecError, derive_capture_sizes, resolve_capture
from qpn.scripts.launcher.engine_profiles import CPU, SM70
from qpn.scripts.launcher.serve_preflight import Refusal

# A live-context threshold the tiny model crosses in a test: k=7 below it, k=3 above, under the
# default prior (acceptance never learned: the random-weight model accepts next to nothing).
TEST_CONSTANTS = {"b_ms_per_token": 0.02}
TEST_LADDER = (3, 7)
PRIOR_ONLY = 1e12


def _test_policy() -> depth_policy.DepthPolicy:
    return depth_policy.policy_from_settings(TEST_LADDER, TEST_CONSTANTS, PRIOR_ONLY)


def _threshold() -> int:
    p = _test_policy()
    return depth_policy.crossover_context(3, 7, p.acceptance(), costs=p.costs)


# ---- the launcher's side (fast) -------------------------------------------------------------

@pytest.mark.fast
def test_auto_settings_parse_and_refuse_naming_the_setting():
    from qpn.scripts.launcher.serve import auto_depth_policy

    assert auto_depth_policy({"K": "7"}) is None
    default = auto_depth_policy({"K": "auto"})
    assert default.ladder == depth_policy.DEFAULT_LADDER and default.max_depth == 15
    mine = auto_depth_policy({"K": "AUTO", "DEPTH_LADDER": "7,3", "DEPTH_PRIOR_ROUNDS": "8",
                              "DEPTH_CONSTANTS": json.dumps(TEST_CONSTANTS)})
    assert mine.ladder == (3, 7) and mine.prior_rounds == 8 and mine.costs.b_ms_per_token == 0.02
    for env, needle in [({"K": "auto", "DEPTH_LADDER": "3,16"}, "16"),
                        ({"K": "auto", "DEPTH_LADDER": "3,3"}, "3"),
                        ({"K": "auto", "DEPTH_CONSTANTS": '{"c_ms": -1}'}, "c_ms"),
                        ({"K": "auto", "DEPTH_CONSTANTS": '{"nope": 1}'}, "nope"),
                        ({"K": "auto", "DEPTH_PRIOR_ROUNDS": "0"}, "prior_rounds"),
                        ({"K": "7", "DEPTH_LADDER": "3,7"}, "DEPTH_LADDER"),
                        ({"DEPTH_CONSTANTS": "{}"}, "DEPTH_CONSTANTS")]:
        with pytest.raises(Refusal, match=needle):
            auto_depth_policy(env)


@pytest.mark.fast
def test_both_engines_serve_auto_each_the_way_its_engine_can():
    from qpn.scripts.launcher.serve import auto_depth_for_engine, auto_depth_policy

    assert CPU.no_per_step_depth is None and SM70.no_per_step_depth is None
    # vLLM 0.32 schedules the depth; 1Cat only shortens its drafter loop (verify width stays K)
    assert CPU.per_step_depth == "schedule" and SM70.per_step_depth == "draft"
    default = auto_depth_policy({"K": "auto"})
    assert auto_depth_for_engine(default, CPU, {"K": "auto"}) is default
    assert not default.fixed_verify and default.verify_depth is None
    sm = auto_depth_for_engine(default, SM70, {"K": "auto"})
    assert sm.ladder == SM70.auto_ladder == (1, 3, 7) and sm.fixed_verify and sm.verify_depth == 7
    env = {"K": "auto", "DEPTH_LADDER": "3,15"}
    assert auto_depth_for_engine(auto_depth_policy(env), SM70, env).ladder == (3, 15)
    env = {"K": "auto", "DEPTH_LADDER": "0,3,7"}
    assert auto_depth_for_engine(auto_depth_policy(env), CPU, env).ladder == (0, 3, 7)
    with pytest.raises(Refusal, match="sm70 engine.*holds 0"):
        auto_depth_for_engine(auto_depth_policy(env), SM70, env)


@pytest.mark.fast
def test_the_capture_ladder_covers_the_widths_each_engine_verifies():
    from qpn.scripts.launcher.serve import auto_depth_for_engine, verified_depths

    policy = _test_policy()
    assert verified_depths(policy, CPU) == (3, 7) and verified_depths(None, CPU) is None
    sm = auto_depth_for_engine(policy, SM70, {"DEPTH_LADDER": "3,7"})
    assert verified_depths(sm, SM70) is None  # 1Cat verifies N*(7+1) every round
    ladder = resolve_capture(None, 4, 7, True, 4, ladder=verified_depths(sm, SM70))
    assert ladder == resolve_capture(None, 4, 7, True, 4)  # a fixed K=7 server's, engine rule included
    assert all(size % 8 == 0 for size in ladder)


@pytest.mark.fast
def test_a_fixed_verify_width_is_priced_by_the_policy():
    costs = depth_policy.DEFAULT_COSTS
    ctx = 65_536
    drafter = costs.drafter_step_ms(ctx)
    assert costs.round_ms(3, ctx, 7) == pytest.approx(
        costs.fixed_round_ms(ctx) + 3 * drafter + 7 * costs.c_ms)
    assert costs.round_ms(3, ctx, 7) - costs.round_ms(3, ctx) == pytest.approx(4 * costs.c_ms)
    assert costs.round_ms(3, ctx, 15) - costs.round_ms(3, ctx, 7) == pytest.approx(
        8 * costs.c_ms + costs.wide_verify_ms)  # 16 verify rows leave the 8-row tile
    with pytest.raises(ValueError, match="below the drafted depth"):
        costs.round_ms(7, ctx, 3)
    fixed = depth_policy.DepthPolicy(ladder=(1, 3, 7), fixed_verify=True)
    decision = fixed.decide([ctx])
    assert decision.score(3).round_ms == pytest.approx(costs.round_ms(3, ctx, 7))
    assert decision.score(7).round_ms == pytest.approx(costs.round_ms(7, ctx))
    with pytest.raises(ValueError, match="holds 0"):
        depth_policy.DepthPolicy(ladder=(0, 3, 7), fixed_verify=True)
    # docs/serving.md: before anything is learned, 1Cat's default ladder drafts 7 up to ~166K
    sm70 = depth_policy.DepthPolicy(ladder=SM70.auto_ladder, fixed_verify=True)
    assert sm70.decide([165_000]).k == 7 and sm70.decide([167_000]).k == 3


@pytest.mark.fast
def test_the_capture_ladder_covers_every_depth_of_the_ladder():
    both = resolve_capture(None, 4, 7, ladder=(3, 7))
    assert set(derive_capture_sizes(4, 3)) | set(derive_capture_sizes(4, 7)) == set(both)
    assert {4, 8, 12, 16, 24, 32} <= set(both)
    with pytest.raises(CaptureSpecError, match="K=auto"):
        resolve_capture("8,16", 4, 7, ladder=(3, 7))
    assert resolve_capture("none", 4, 7, ladder=(3, 7)) is None


@pytest.mark.fast
def test_auto_turns_on_the_engines_per_step_path_and_hands_the_policy_over():
    from qpn.scripts.launcher.serve import server_command, server_env
    from tests.test_launcher_units import _flag, _launch

    policy = _test_policy()
    launch = _launch(CPU, k=policy.max_depth, mns=4, depth=policy)
    spec = json.loads(_flag(server_command(launch), "--speculative-config"))
    assert spec["num_speculative_tokens"] == 7
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 7]]
    env = server_env(launch)
    assert env[auto_depth.ENV_LADDER] == "3,7"
    again = auto_depth.policy_from_env(env)
    assert again == policy  # ladder, constants and prior weight survive the trip
    fixed = _launch(CPU)
    assert "num_speculative_tokens_per_batch_size" not in _flag(server_command(fixed),
                                                                "--speculative-config")
    assert auto_depth.ENV_LADDER not in server_env(fixed)
    assert auto_depth.ENV_VERIFY not in env


@pytest.mark.fast
def test_auto_on_1cat_passes_no_per_step_table_and_says_the_verify_width_is_fixed():
    from qpn.scripts.launcher.serve import auto_depth_for_engine, server_command, server_env
    from tests.test_launcher_units import _flag, _launch

    policy = auto_depth_for_engine(_test_policy(), SM70, {"DEPTH_LADDER": "3,7"})
    launch = _launch(SM70, k=policy.max_depth, mns=4, depth=policy)
    spec = json.loads(_flag(server_command(launch), "--speculative-config"))
    assert spec["num_speculative_tokens"] == 7
    assert "num_speculative_tokens_per_batch_size" not in spec  # not a 1Cat field
    env = server_env(launch)
    assert env[auto_depth.ENV_LADDER] == "3,7" and env[auto_depth.ENV_VERIFY] == "deepest"
    again = auto_depth.policy_from_env(env)
    assert again == policy and again.fixed_verify


# ---- the engine hooks over a scheduler stand-in (fast) ---------------------------------------

class _Scheduler:
    num_spec_tokens = 7
    dynamic_sd_lookup = [7] * 5

    def __init__(self, contexts):
        self.requests = {f"r{i}": SimpleNamespace(num_tokens=n) for i, n in enumerate(contexts)}
        self.booked = []

    def _update_after_schedule(self, out):
        self.booked.append(out.num_spec_tokens_to_schedule)

    def make_spec_decoding_stats(self, stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        return stats


def _hooked(monkeypatch, env):
    for name in (auto_depth.ENV_LADDER, auto_depth.ENV_CONSTANTS, auto_depth.ENV_PRIOR_ROUNDS,
                 auto_depth.ENV_VERIFY):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    update = auto_depth.wrap_update_after_schedule(_Scheduler._update_after_schedule)
    stats = auto_depth.wrap_make_spec_decoding_stats(_Scheduler.make_spec_decoding_stats)
    return update, stats


_AUTO_ENV = {auto_depth.ENV_LADDER: "3,7", auto_depth.ENV_CONSTANTS: json.dumps(TEST_CONSTANTS),
             auto_depth.ENV_PRIOR_ROUNDS: repr(PRIOR_ONLY)}


@pytest.mark.fast
def test_each_step_drafts_the_depth_of_its_longest_live_context(monkeypatch):
    update, _ = _hooked(monkeypatch, _AUTO_ENV)
    t = _threshold()
    for contexts, want in [([t - 1], 7), ([t], 3), ([5, t + 40], 3), ([5, t - 1], 7)]:
        sched = _Scheduler(contexts)
        out = SimpleNamespace(num_scheduled_tokens={r: 1 for r in sched.requests},
                              num_spec_tokens_to_schedule=7)
        update(sched, out)
        assert sched.booked == [want] and out.num_spec_tokens_to_schedule == want, (contexts, t)
    assert sched._qpn_depth.chosen == {7: 1}


@pytest.mark.fast
def test_without_auto_or_without_the_engines_per_step_path_nothing_changes(monkeypatch):
    update, _ = _hooked(monkeypatch, {})
    sched = _Scheduler([10_000])
    out = SimpleNamespace(num_scheduled_tokens={"r0": 1}, num_spec_tokens_to_schedule=7)
    update(sched, out)
    assert sched.booked == [7]
    update, _ = _hooked(monkeypatch, _AUTO_ENV)
    sched = _Scheduler([10_000])
    sched.dynamic_sd_lookup = None  # the speculative config carried no per-step table
    update(sched, out)
    assert sched.booked == [7]


@pytest.mark.fast
def test_a_ladder_deeper_or_shallower_than_the_engine_is_an_error(monkeypatch):
    update, _ = _hooked(monkeypatch, {**_AUTO_ENV, auto_depth.ENV_LADDER: "3,15"})
    sched = _Scheduler([10])
    with pytest.raises(ValueError, match="deepest depth 15.*num_speculative_tokens 7"):
        update(sched, SimpleNamespace(num_scheduled_tokens={"r0": 1}, num_spec_tokens_to_schedule=7))


@pytest.mark.fast
def test_verdicts_are_counted_per_draft_position_and_learned(monkeypatch):
    update, stats = _hooked(monkeypatch, {**_AUTO_ENV, auto_depth.ENV_PRIOR_ROUNDS: "1"})
    sched = _Scheduler([10])
    for drafted, accepted, invalid in [(7, 7, 0), (7, 2, 0), (3, 3, 0), (7, 0, 4), (0, 0, 0)]:
        stats(sched, None, drafted, accepted, {"r0": invalid} if invalid else None, "r0")
    state = sched._qpn_depth
    assert state.drafted == [4, 4, 4, 2, 2, 2, 2]  # 7 + 7 + 3 + (7 less 4 invalid); 0 drafts not a round
    assert state.accepted == [3, 3, 2, 1, 1, 1, 1]
    # nothing accepted past position 0 for many rounds: the learned estimate leaves depth 7
    for _ in range(200):
        stats(sched, None, 7, 0, None, "r0")
    out = SimpleNamespace(num_scheduled_tokens={"r0": 1}, num_spec_tokens_to_schedule=7)
    update(sched, out)
    assert out.num_spec_tokens_to_schedule == 3


# ---- the 1Cat hooks over stand-ins shaped like 1Cat's objects (fast) ----------------------
# The same hooks run on the real 1Cat classes in tests/test_auto_depth_1cat.py.

class _OneCatScheduler:
    """1Cat's Scheduler as the hooks see it: num_spec_tokens, requests, no per-step table."""
    num_spec_tokens = 7

    def __init__(self, contexts):
        self.requests = {f"r{i}": SimpleNamespace(num_tokens=n) for i, n in enumerate(contexts)}
        self.booked, self.verdicts = [], []

    def _update_after_schedule(self, out):
        self.booked.append(getattr(out, auto_depth.DRAFT_DEPTH_ATTR, None))

    def update_from_output(self, out, model_runner_output):
        for req_id, (drafted, accepted) in model_runner_output.items():
            self.make_spec_decoding_stats(None, num_draft_tokens=drafted,
                                          num_accepted_tokens=accepted,
                                          num_invalid_spec_tokens=None, request_id=req_id)

    def make_spec_decoding_stats(self, stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        self.verdicts.append((request_id, num_draft_tokens, num_accepted_tokens))
        return stats


def _hooked_1cat(monkeypatch):
    _hooked(monkeypatch, {**_AUTO_ENV, auto_depth.ENV_VERIFY: "deepest"})
    cls = type("HookedScheduler", (_OneCatScheduler,), {})
    cls._update_after_schedule = auto_depth.wrap_update_after_schedule_fixed_verify(
        _OneCatScheduler._update_after_schedule)
    cls.update_from_output = auto_depth.wrap_update_from_output(_OneCatScheduler.update_from_output)
    cls.make_spec_decoding_stats = auto_depth.wrap_make_spec_decoding_stats(
        _OneCatScheduler.make_spec_decoding_stats)
    return cls


@pytest.mark.fast
def test_1cat_steps_carry_the_depth_and_a_request_crossing_the_threshold_changes_it(monkeypatch):
    cls = _hooked_1cat(monkeypatch)
    t = threshold_fixed_verify()
    sched = cls([t - 3])
    seen = []
    for step in range(6):  # the request grows by one token a step across the threshold
        sched.requests["r0"].num_tokens = t - 3 + step
        out = SimpleNamespace(num_scheduled_tokens={"r0": 1})
        sched._update_after_schedule(out)
        seen.append((getattr(out, auto_depth.DRAFT_DEPTH_ATTR),
                     getattr(out, auto_depth.VERIFY_DEPTHS_ATTR)["r0"]))
    assert [d for d, _ in seen] == [7, 7, 7, 3, 3, 3], (t, seen)
    # each step verifies what the step before it drafted (the first: the engine's own depth)
    assert [v for _, v in seen] == [7, 7, 7, 7, 3, 3]
    assert sched.booked == [7, 7, 7, 3, 3, 3]  # decided before the engine books the step
    assert sched._qpn_depth.chosen == {7: 3, 3: 3}
    # several requests: the longest live context decides for all
    sched = cls([5, t + 10])
    out = SimpleNamespace(num_scheduled_tokens={"r0": 1, "r1": 1})
    sched._update_after_schedule(out)
    assert getattr(out, auto_depth.DRAFT_DEPTH_ATTR) == 3


def threshold_fixed_verify() -> int:
    p = replace(_test_policy(), fixed_verify=True)
    lo, hi = 0, 1 << 22  # first context where 3 beats 7 with 7 verify rows every round
    assert p.decide([lo]).k == 7 and p.decide([hi]).k == 3
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if p.decide([mid]).k == 7 else (lo, mid)
    return hi


@pytest.mark.fast
def test_1cat_acceptance_counts_only_the_positions_really_drafted(monkeypatch):
    cls = _hooked_1cat(monkeypatch)
    sched = cls([10, 10])
    # the engine verifies 7 rows a request; r0's were drafted at depth 3, r1's at 7
    out = SimpleNamespace(num_scheduled_tokens={"r0": 8, "r1": 8})
    setattr(out, auto_depth.VERIFY_DEPTHS_ATTR, {"r0": 3, "r1": 7})
    sched.update_from_output(out, {"r0": (7, 5), "r1": (7, 2)})  # r0: 2 filler tokens by luck
    state = sched._qpn_depth
    assert state.drafted == [2, 2, 2, 1, 1, 1, 1]
    assert state.accepted == [2, 2, 1, 0, 0, 0, 0]  # r0 counted at 3 of 3, r1 at 2 of 7
    assert sched.verdicts == [("r0", 7, 5), ("r1", 7, 2)]  # the engine's own stats unchanged
    assert state.verifying is None  # only during the engine's call


class _Proposer:
    """1Cat's SpecDecodeBaseProposer.propose as far as the depth goes: one first pass, then
    ``num_speculative_tokens - 1`` loop steps, each a drafter forward, read when the call runs
    (llm_base_proposer.py); the d = 1 case returns through its one-token exit."""

    def __init__(self, k=7, probabilistic=False):
        self.num_speculative_tokens = k
        self.parallel_drafting = False
        self._enable_probabilistic_draft_probs = probabilistic
        self.forwards: list[int] = []

    def propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        import torch

        n = next_token_ids.shape[0]
        self.forwards.append(0)
        cols = [torch.arange(n) + 100]
        if self.num_speculative_tokens == 1:
            return cols[0].view(-1, self.num_speculative_tokens)
        for token_index in range(self.num_speculative_tokens - 1):
            self.forwards.append(token_index + 1)
            cols.append(torch.arange(n) + 100 * (token_index + 2))
        return torch.stack(cols, dim=1)


def _propose(proposer, hooked, depth):
    import torch

    setattr(proposer, auto_depth.PROPOSER_DEPTH_ATTR, depth)
    proposer.forwards = []
    return hooked(proposer, None, None, None, torch.zeros(3, dtype=torch.long), None, None, None)


@pytest.mark.fast
def test_1cat_drafter_loop_drafts_the_steps_depth_and_keeps_k_columns():
    hooked = auto_depth.wrap_proposer_propose(_Proposer.propose)
    proposer = _Proposer(k=7)
    for depth in (7, 3, 1, 3, 7, None):  # the depth changes from step to step
        drafts = _propose(proposer, hooked, depth)
        d = depth or 7
        assert proposer.forwards == list(range(d)), depth  # positions >= d never drafted
        assert tuple(drafts.shape) == (3, 7)  # the runner indexes K columns
        assert drafts[:, :d].tolist() == [[100 * (j + 1) + i for j in range(d)] for i in range(3)]
        assert (drafts[:, d:] == drafts[:, d - 1:d]).all()  # filler: the last drafted token
        assert proposer.num_speculative_tokens == 7  # restored
        assert getattr(proposer, auto_depth.PROPOSER_DRAFTED_ATTR) == d
    # probabilistic drafting keeps per-position draft probabilities: the full depth is drafted
    proposer = _Proposer(k=7, probabilistic=True)
    assert _propose(proposer, hooked, 3).shape[1] == 7 and proposer.forwards == list(range(7))
    assert getattr(proposer, auto_depth.PROPOSER_DRAFTED_ATTR) == 7

    class Failing(_Proposer):
        def propose(self, *args, **kwargs):
            raise RuntimeError("drafter failed")

    failing = Failing(k=7)
    with pytest.raises(RuntimeError, match="drafter failed"):
        _propose(failing, auto_depth.wrap_proposer_propose(Failing.propose), 3)
    assert failing.num_speculative_tokens == 7  # restored on an error too


@pytest.mark.fast
def test_draft_columns_pad_lists_and_tensors():
    import torch

    assert auto_depth.pad_draft_columns([[5, 6], [], [7]], 4) == [[5, 6, 6, 6], [], [7, 7, 7, 7]]
    t = torch.tensor([[1, 2], [3, 4]])
    assert auto_depth.pad_draft_columns(t, 2) is t
    assert auto_depth.pad_draft_columns(t, 3).tolist() == [[1, 2, 2], [3, 4, 4]]


class _Runner:
    def __init__(self, drafter):
        self.drafter = drafter
        self.seen = []

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        depth = getattr(self.drafter, auto_depth.PROPOSER_DEPTH_ATTR, None)
        self.seen.append(depth)
        setattr(self.drafter, auto_depth.PROPOSER_DRAFTED_ATTR, depth)
        return "drafts"


@pytest.mark.fast
def test_the_runner_hands_the_depth_over_and_the_census_counts_steps_per_depth(monkeypatch):
    from qpn.fork_patches.route_census import census

    fresh = census.Census()
    monkeypatch.setattr(census, "CENSUS", fresh)
    monkeypatch.setattr(fresh, "_mark_dirty", lambda: None)  # no flusher thread in a unit test
    hooked = auto_depth.wrap_propose_draft_token_ids(_Runner.propose_draft_token_ids)
    runner = _Runner(SimpleNamespace())
    _hooked(monkeypatch, _AUTO_ENV)
    for depth in (7, 3, 3, 1):  # 1Cat: the attached decision
        out = SimpleNamespace(**{auto_depth.DRAFT_DEPTH_ATTR: depth})
        assert hooked(runner, out, *[None] * 8) == "drafts"
        assert getattr(runner.drafter, auto_depth.PROPOSER_DEPTH_ATTR) is None  # this call only
    out = SimpleNamespace(num_spec_tokens_to_schedule=7)  # vLLM 0.32: its own field
    hooked(runner, out, *[None] * 8)
    assert runner.seen == [7, 3, 3, 1, 7]
    assert fresh.draft_depth_steps == {"7": 2, "3": 2, "1": 1}
    assert fresh.snapshot()["draft_depth_steps"] == {"1": 1, "3": 2, "7": 2}
    # a fixed depth: nothing handed over, nothing counted
    _hooked(monkeypatch, {})
    hooked(runner, SimpleNamespace(**{auto_depth.DRAFT_DEPTH_ATTR: 3}), *[None] * 8)
    assert runner.seen[-1] is None and fresh.draft_depth_steps == {"7": 2, "3": 2, "1": 1}


class _Counter:
    def __init__(self, name, documentation, labelnames):
        self.name, self.labelnames, self.children = name, labelnames, {}

    def labels(self, *values):
        return self.children.setdefault(values, SimpleNamespace(value=0, inc=None))


class _Value:
    def __init__(self):
        self.value = 0

    def inc(self, n):
        self.value += n


class _Counter:
    def __init__(self, name, documentation, labelnames):
        self.name, self.labelnames, self.children = name, labelnames, {}

    def labels(self, *values):
        return self.children.setdefault(values, _Value())


@pytest.mark.fast
def test_the_speculation_counters_per_position_and_per_depth(monkeypatch):
    monkeypatch.setattr(auto_depth, "COUNTERS", {})

    class Prom:
        _counter_cls = _Counter

        def __init__(self, speculative_config, labelnames, per_engine_labelvalues, is_diffusion=False):
            self.spec_decoding_enabled, self.is_diffusion = True, is_diffusion

        def observe(self, stats, engine_idx=0):
            pass

    init = auto_depth.wrap_spec_prom_init(Prom.__init__)
    observe = auto_depth.wrap_spec_prom_observe(Prom.observe)
    prom = Prom.__new__(Prom)
    init(prom, SimpleNamespace(num_speculative_tokens=4), ["model_name", "engine"], {0: ["m", "0"]})
    # a step of three requests at depth 2, then one request at depth 4 that accepted 3
    observe(prom, SimpleNamespace(num_draft_tokens_per_pos=[3, 3, 0, 0], num_drafts=3,
                                  num_accepted_tokens=2), 0)
    observe(prom, SimpleNamespace(num_draft_tokens_per_pos=[1, 1, 1, 1], num_drafts=1,
                                  num_accepted_tokens=3), 0)
    counters = auto_depth.COUNTERS
    drafted = counters[auto_depth.DRAFT_PER_POS_METRIC]
    assert drafted.labelnames == ["model_name", "engine", "position"]
    assert {k[-1]: v.value for k, v in drafted.children.items()} == {"0": 4, "1": 4, "2": 1, "3": 1}
    rounds = {k[-1]: v.value for k, v in counters[auto_depth.ROUNDS_PER_DEPTH_METRIC].children.items()}
    accepted = {k[-1]: v.value for k, v in counters[auto_depth.ACCEPTED_PER_DEPTH_METRIC].children.items()}
    assert rounds == {"1": 0, "2": 3, "3": 0, "4": 1} and accepted == {"1": 0, "2": 2, "3": 0, "4": 3}


# ---- the served_depth gate under auto (fast) -------------------------------------------------

def _metrics(k: int, drafted_per_pos: list[int] | None) -> str:
    lines = [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} 0.0'
             for i in range(k)]
    lines += ["vllm:spec_decode_num_drafts_total 4.0", "vllm:spec_decode_num_draft_tokens_total 20.0"]
    for pos, n in enumerate(drafted_per_pos or []):
        lines.append(f'{auto_depth.DRAFT_PER_POS_METRIC}_total{{engine="0",position="{pos}"}} {n}.0')
    return "\n".join(lines) + "\n"


@pytest.mark.fast
def test_rounds_per_depth_from_the_drafted_per_position_counter():
    # 2 rounds at 7, 3 rounds at 3, 1 at 1: position p counts the rounds deeper than p
    text = _metrics(7, [6, 5, 5, 2, 2, 2, 2])
    assert boot_gates.rounds_per_depth(text) == {1: 1, 3: 3, 7: 2}
    assert boot_gates.rounds_per_depth(_metrics(7, None)) == {}


@pytest.mark.fast
def test_the_gate_under_auto_fails_when_the_depth_never_changes():
    change = boot_gates.AutoDepth((3, 7), short=(30, 7), long=(400, 3))
    assert not boot_gates.gate_depth(7, _metrics(7, [5, 5, 5, 2, 2, 2, 2]), change).failed
    same = boot_gates.gate_depth(7, _metrics(7, [5, 5, 5, 5, 5, 5, 5]), change)
    assert same.failed and "never changed" in same.observed and "7: 5" in same.observed
    missing = boot_gates.gate_depth(7, _metrics(7, None), change)
    assert missing.failed and "draft-per-position-metric" in missing.observed
    # where the policy keeps one depth for both warm requests, one depth is the right answer
    steady = boot_gates.AutoDepth(depth_policy.DEFAULT_LADDER, short=(30, 7), long=(2000, 7))
    assert not boot_gates.gate_depth(15, _metrics(15, [5] * 7 + [0] * 8), steady).failed
    assert boot_gates.gate_depth(7, _metrics(15, [5] * 7 + [0] * 8), steady).failed  # positions


@pytest.mark.fast
def test_the_gate_under_auto_reads_the_census_steps_per_drafted_depth():
    change = boot_gates.AutoDepth((3, 7), short=(30, 7), long=(400, 3))
    # 1Cat exports no per-position drafts: the census's steps per drafted depth decide
    both = {"draft_depth_steps": {"7": 4, "3": 9}}
    ok = boot_gates.gate_depth(7, _metrics(7, None), change, both)
    assert not ok.failed and "steps per drafted depth (census) 3: 9, 7: 4" in ok.observed
    one = boot_gates.gate_depth(7, _metrics(7, None), change, {"draft_depth_steps": {"7": 13}})
    assert one.failed and "never changed" in one.observed
    stray = boot_gates.gate_depth(7, _metrics(7, None), change,
                                  {"draft_depth_steps": {"7": 4, "3": 2, "5": 1}})
    assert stray.failed and "[5] outside the ladder" in stray.observed
    # the census wins over the counter where both are there; without it the counter decides
    assert boot_gates.gate_depth(7, _metrics(7, [5, 5, 5, 5, 5, 5, 5]), change, both).failed is False
    assert boot_gates.gate_depth(7, _metrics(7, [5, 5, 5, 2, 2, 2, 2]), change, {}).failed is False
    assert boot_gates.census_depth_steps(None) == {}


# ---- K=auto's long warm request, sized to the served max_model_len (issue 40 item 3) ---------

class _ChatLimits:
    """A stand-in for vLLM's chat endpoint as far as its length check goes: /v1/models reports
    max_model_len, a chat whose prompt (the checkpoint's template, rendered, then encoded) plus
    max_tokens exceeds it is refused with HTTP 400 and vLLM's words."""

    def __init__(self, ckpt: str, mml: int):
        from transformers import AutoTokenizer

        self.tok, self.mml, self.prompts = AutoTokenizer.from_pretrained(ckpt), mml, []

    def tokens(self, messages) -> int:
        chat = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=False)
        return len(self.tok(chat, add_special_tokens=False, verbose=False)["input_ids"])

    def serve(self):
        import http.server
        import threading

        limits = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, status, body):
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):  # noqa: N802
                self._send(200, {"data": [{"id": "tiny", "max_model_len": limits.mml}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n, m = limits.tokens(body["messages"]), body["max_tokens"]
                limits.prompts.append(n)
                if n + m > limits.mml:
                    return self._send(400, {"error": {"message": (
                        f"This model's maximum context length is {limits.mml} tokens. However, you "
                        f"requested {n + m} tokens ({n} in the messages, {m} in the completion).")}})
                self._send(200, {"choices": [{"message": {"content": "ready " * m}}],
                                 "usage": {"prompt_tokens": n, "completion_tokens": m}})

            def log_message(self, *args):
                pass

        httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    """The tiny test checkpoint's tokenizer and chat template (the files make_checkpoint writes)."""
    from qpn.scripts.checkpoints import tiny_hybrid, tiny_tokenizer

    out = tmp_path_factory.mktemp("tok")
    spec = tiny_hybrid.TinyHybridSpec()
    tiny_tokenizer.write_tokenizer(out, spec.vocab_size, spec.max_position_embeddings)
    return str(out)


def _warm_against(ckpt: str, mml: int, **env):
    from qpn.scripts.launcher import serve

    limits = _ChatLimits(ckpt, mml)
    httpd = limits.serve()
    try:
        launch = SimpleNamespace(root_url=f"http://127.0.0.1:{httpd.server_port}", api_key=None,
                                 environ=env, ckpt=ckpt, mml=mml, k=7, depth=_test_policy())
        short = serve.warm_request(launch, "tiny")
        assert short["ok"], short
        long, auto = serve.auto_depth_warm(launch, "tiny", short)
        return limits, short, long, auto
    finally:
        httpd.shutdown()


def _gate(short: dict, long: dict):
    from qpn.scripts.launcher import serve

    return boot_gates.gate_warm(serve.with_long_warm(short, long))


@pytest.mark.fast
def test_the_long_warm_request_fits_the_served_max_model_len(tiny_tokenizer_dir):
    from qpn.scripts.launcher.serve import long_warm_prompt

    # the cpu engine's default MML: the default 1500 words are longer than that on this tokenizer
    limits, short, long, auto = _warm_against(tiny_tokenizer_dir, 4096)
    asked = limits.tokens([{"role": "user", "content": long_warm_prompt(1500)}])
    assert asked + 8 > 4096, asked
    assert long["ok"], long  # before issue 40: HTTP 400, maximum context length is 4096
    from qpn.scripts.launcher.serve import LONG_WARM_SLACK, WARM_MAX_TOKENS

    sent = long["prompt_tokens"]
    budget = 4096 - WARM_MAX_TOKENS - LONG_WARM_SLACK
    assert budget - 40 < sent <= budget, sent  # as long as fits, to within a word or two
    words = int(re.search(r"cut to (\d+) of the 1500 words asked", long["note"]).group(1))
    assert limits.tokens([{"role": "user", "content": long_warm_prompt(words)}]) == sent
    assert limits.tokens([{"role": "user", "content": long_warm_prompt(words + 1)}]) > budget
    # the gate line says so, and the policy decides for both contexts (k=7 short, k=3 long)
    gate = _gate(short, long)
    assert not gate.failed and f"({sent} prompt tokens)" in gate.observed, gate.observed
    assert "max_model_len 4096 holds no more" in gate.observed, gate.observed
    assert auto.short[1] == 7 and auto.long == (sent + WARM_MAX_TOKENS, 3), auto


@pytest.mark.fast
def test_the_long_warm_request_as_asked_where_it_fits_and_none_where_nothing_longer_fits(
        tiny_tokenizer_dir):
    from qpn.scripts.launcher.serve import long_warm_prompt

    limits, _, long, auto = _warm_against(tiny_tokenizer_dir, 32768)
    assert long["ok"] and long["note"] == (f"K=auto long warm request: 1500 words "
                                           f"({long['prompt_tokens']} prompt tokens)"), long
    assert long["prompt_tokens"] == limits.tokens([{"role": "user",
                                                    "content": long_warm_prompt(1500)}])
    _, _, long, _ = _warm_against(tiny_tokenizer_dir, 32768, DEPTH_WARM_WORDS="400")
    assert long["note"].startswith("K=auto long warm request: 400 words"), long
    # a max_model_len that holds the short warm request but nothing longer: no long request
    short_tokens = limits.tokens([{"role": "user", "content": "Say ready."}])
    limits, short, long, auto = _warm_against(tiny_tokenizer_dir, short_tokens + 30)
    assert limits.prompts == [short_tokens], limits.prompts  # the short request only
    assert not auto.expects_change and auto.long == auto.short, auto
    gate = _gate(short, long)
    assert not gate.failed and "long warm request not sent" in gate.observed, gate.observed
    assert "too short for a long-context decision" in gate.observed, gate.observed


@pytest.mark.fast
def test_without_a_tokenizer_the_long_warm_request_is_bounded_by_its_bytes(tiny_tokenizer_dir,
                                                                           monkeypatch):
    from qpn.scripts.launcher import serve

    monkeypatch.setattr(serve, "chat_token_counter", lambda ckpt: (None, "no transformers"),
                        raising=False)
    _, short, long, _ = _warm_against(tiny_tokenizer_dir, 4096)
    assert long["ok"] and "cut to" in long["note"] and "one token per byte" in long["note"], long
    assert long["prompt_tokens"] > short["prompt_tokens"] + 100, long


# ---- a real server on the cpu engine (engine) ------------------------------------------------

def _prompt(words: int) -> str:
    from qpn.scripts.launcher.serve import long_warm_prompt

    return long_warm_prompt(words)


@pytest.fixture(scope="module")
def servers(mixed_checkpoint, tmp_path_factory):
    """The launcher's K=auto server (its gates must pass) and a raw K=0 server, both greedy. The
    auto server runs at the cpu engine's default MML (4096) with the default long warm request
    (no DEPTH_WARM_WORDS): the launcher must size that request to fit (issue 40 item 3)."""
    from qpn.scripts.launcher.launched import LaunchedServer
    from tests.test_launcher_server import _env

    tmp = tmp_path_factory.mktemp("auto")
    env = _env(str(tmp), K="auto", DEPTH_LADDER="3,7", DEPTH_PRIOR_ROUNDS=repr(PRIOR_ONLY),
               DEPTH_CONSTANTS=json.dumps(TEST_CONSTANTS), RUN_DIR=str(tmp / "run"),
               TOOL_PARSER="hermes")
    env.pop("DEPTH_WARM_WORDS", None)
    auto = LaunchedServer(str(mixed_checkpoint), env=env)
    off = LaunchedServer(str(mixed_checkpoint), env={**_env(str(tmp / "off"), K="0",
                                                            RUN_DIR=str(tmp / "off-run"),
                                                            TOOL_PARSER="hermes")})
    auto.start()
    try:
        off.start()
        yield auto, off
    finally:
        off.stop()
        auto.stop()


def _post(server, path, body):
    import urllib.request

    root = server.url.removesuffix("/v1")  # the READY line's url ends in /v1
    req = urllib.request.Request(root + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _drafted(server) -> list[float]:
    import urllib.request

    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    per = {}
    for line in text.splitlines():
        if line.startswith(auto_depth.DRAFT_PER_POS_METRIC + "_total{"):
            pos = int(line.split('position="')[1].split('"')[0])
            per[pos] = per.get(pos, 0.0) + float(line.rsplit(" ", 1)[1])
    return [per.get(p, 0.0) for p in range(7)]


def _complete(server, prompt: str, max_tokens: int) -> dict:
    return _post(server, "/v1/completions", {"model": server.model, "prompt": prompt,
                                             "max_tokens": max_tokens, "temperature": 0.0,
                                             "ignore_eos": True})


@pytest.mark.engine
@pytest.mark.slow
def test_auto_server_passes_its_gates_with_a_depth_change(servers):
    auto, _ = servers
    gates = {g["name"]: g for g in json.load(open(auto.gates_json))["gates"]}
    # the default long warm request (1500 words, more than 4096 tokens on the tiny tokenizer) was
    # cut to what the engine's default max_model_len holds, and the gate line says so
    warm = gates["warm_request"]
    assert warm["status"] == "PASS", warm
    cut = re.search(r"K=auto long warm request cut to (\d+) of the 1500 words asked \((\d+) prompt "
                    r"tokens\): max_model_len 4096 holds no more", warm["observed"])
    assert cut and 3800 < int(cut.group(2)) <= 4096 - 8, warm["observed"]
    assert "MML=model default" not in auto.output and "MML=4096" in auto.output, auto.output
    depth = gates["served_depth"]
    assert depth["status"] == "PASS" and "K=auto over [3, 7]" in depth["expected"], depth
    # the gate read the census's steps per drafted depth (auto-depth-draft-depth), both depths
    assert "steps per drafted depth (census)" in depth["observed"] and "3: " in depth["observed"] \
        and "7: " in depth["observed"], depth
    import urllib.request

    with urllib.request.urlopen(auto.url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    rounds = {}
    for line in text.splitlines():
        if line.startswith(auto_depth.ROUNDS_PER_DEPTH_METRIC + "_total{"):
            d = int(line.split('depth="')[1].split('"')[0])
            rounds[d] = rounds.get(d, 0.0) + float(line.rsplit(" ", 1)[1])
    assert rounds.get(3, 0) > 0 and rounds.get(7, 0) > 0, rounds


@pytest.mark.engine
@pytest.mark.slow
def test_depth_follows_the_live_context_and_output_matches_no_speculation(servers):
    auto, off = servers
    t = _threshold()

    def tokens(words: int) -> int:
        return _complete(off, _prompt(words), 1)["usage"]["prompt_tokens"]

    def most_words_below(target: int) -> int:
        lo, hi = 1, 2
        while tokens(hi) < target:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if tokens(mid) < target else (lo, mid)
        return lo

    short = _prompt(8)
    assert tokens(8) + 24 < t
    long_words = most_words_below(t + 8) + 1
    long = _prompt(long_words)
    assert tokens(long_words) >= t + 8
    crossing_words = most_words_below(t - 6)
    crossing = _prompt(crossing_words)
    assert t - 30 < tokens(crossing_words) < t - 6

    before = _drafted(auto)
    a = _complete(auto, short, 24)
    after_short = _drafted(auto)
    assert all(after_short[p] > before[p] for p in range(3, 7)), (before, after_short)  # deep

    b = _complete(auto, long, 24)
    after_long = _drafted(auto)
    assert after_long[3:] == after_short[3:], (after_short, after_long)  # k=3 only
    assert after_long[0] > after_short[0]

    c = _complete(auto, crossing, 32)  # starts below the threshold, ends above it
    after_cross = _drafted(auto)
    deep = after_cross[3] - after_long[3]
    shallow = (after_cross[0] - after_long[0]) - deep
    assert deep > 0 and shallow > 0, (after_long, after_cross)

    for reply, prompt, n in ((a, short, 24), (b, long, 24), (c, crossing, 32)):
        plain = _complete(off, prompt, n)
        assert reply["choices"][0]["text"] == plain["choices"][0]["text"], prompt[:60]


@pytest.mark.engine
@pytest.mark.slow
def test_tool_calls_and_structured_output_match_no_speculation(servers):
    auto, off = servers
    tool = {"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"]}}}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    bodies = [
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool],
         "tool_choice": "required", "max_tokens": 48},
        {"messages": [{"role": "user", "content": _prompt(300)}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
         "max_tokens": 48},
    ]
    for body in bodies:
        body = {**body, "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}}
        got = _post(auto, "/v1/chat/completions", {**body, "model": auto.model})["choices"][0]["message"]
        want = _post(off, "/v1/chat/completions", {**body, "model": off.model})["choices"][0]["message"]
        assert (got.get("content"), got.get("tool_calls") and [
            (c["function"]["name"], c["function"]["arguments"]) for c in got["tool_calls"]]) == (
            want.get("content"), want.get("tool_calls") and [
                (c["function"]["name"], c["function"]["arguments"]) for c in want["tool_calls"]])
