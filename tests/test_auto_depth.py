"""K=auto (issue 28 items 1-2): the launcher's settings and refusals, the engine hooks over a
scheduler stand-in, the drafted-per-position counter and the served_depth gate under auto (fast);
then a real cpu-engine server whose depth follows the context, with greedy output identical to
the same requests without speculation (engine). The policy's own decision table is
tests/test_depth_policy.py."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

from qpn.fork_patches import auto_depth, depth_policy
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
def test_only_an_engine_that_drafts_per_step_serves_auto():
    assert CPU.no_per_step_depth is None
    assert SM70.no_per_step_depth and "fixed depth" in SM70.no_per_step_depth


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
    for name in (auto_depth.ENV_LADDER, auto_depth.ENV_CONSTANTS, auto_depth.ENV_PRIOR_ROUNDS):
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
    monkeypatch.setattr(auto_depth, "_COUNTERS", {})

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
    counters = auto_depth._COUNTERS
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


# ---- a real server on the cpu engine (engine) ------------------------------------------------

def _prompt(words: int) -> str:
    from qpn.scripts.launcher.serve import long_warm_prompt

    return long_warm_prompt(words)


@pytest.fixture(scope="module")
def servers(mixed_checkpoint, tmp_path_factory):
    """The launcher's K=auto server (its gates must pass) and a raw K=0 server, both greedy."""
    from qpn.scripts.launcher.launched import LaunchedServer
    from tests.test_launcher_server import _env

    tmp = tmp_path_factory.mktemp("auto")
    env = _env(str(tmp), K="auto", DEPTH_LADDER="3,7", DEPTH_PRIOR_ROUNDS=repr(PRIOR_ONLY),
               DEPTH_CONSTANTS=json.dumps(TEST_CONSTANTS), DEPTH_WARM_WORDS="400",
               RUN_DIR=str(tmp / "run"), TOOL_PARSER="hermes")
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
    depth = gates["served_depth"]
    assert depth["status"] == "PASS" and "K=auto over [3, 7]" in depth["expected"], depth
    assert "rounds per depth" in depth["observed"] and "3: " in depth["observed"] \
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
