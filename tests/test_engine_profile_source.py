"""The sm70 serving profile against the source of the engine it targets (1Cat-vLLM 1.2.2, 1.3.0)
and the cpu profile against the installed cpu engine: every flag of the launcher's command, every
value the engine checks against a fixed list, every key of its JSON flags and every VLLM_*
variable of its environment exists there; the capture ladder keeps the engine's own SM70 MTP
capture rule, whose constants are read from each archive."""
from __future__ import annotations

import ast
import json

import pytest

from qpn.fork_patches.engine import engine_source
from qpn.scripts.launcher import capture_ladder
from qpn.scripts.launcher.engine_profiles import CPU, SM70
from qpn.scripts.launcher.serve import Launch, server_command, server_env
from tests.test_engine_source import VERSIONS, _archive, _engine_site_packages

# The flag checks parse whole engine sources (about 4 s each): full tier. The capture-ladder
# checks are quick and belong to the one-minute tier.


def _launch(profile, k=7, mns=4):
    tp = profile.default_tensor_parallel or 1
    return Launch(ckpt="/ckpt", extra_args=[], k=k, mns=mns, mml=profile.default_max_model_len,
                  gmu=profile.default_gpu_memory_utilization, tp=profile.default_tensor_parallel,
                  host="127.0.0.1", port=8000,
                  capture=capture_ladder.resolve_capture(None, mns, k, profile.engine_capture_rules, tp),
                  python="/engine/bin/python", profile=profile, engine_version="x", served_name="m",
                  tool_parser="qwen3_coder", thinking=True, api_key=None, run_dir="/run", boot_timeout=1.0,
                  environ={"PATH": "/bin"})


_SOURCES: dict[str, engine_source.EngineSource] = {}


def _source(version):
    if version not in _SOURCES:
        _SOURCES[version] = engine_source.open_source(_archive(version))
    return _SOURCES[version]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_flag_value_and_variable_of_the_sm70_command_exists_in_1cat(version):
    launch = _launch(SM70)
    cmd, env = server_command(launch), server_env(launch)
    rows = engine_source.verify_profile(_source(version), cmd, env)
    checked = {r.hook for r in rows}
    for must in ("flag --attention-backend", "flag --kv-cache-dtype", "flag --speculative-config",
                 "flag --compilation-config", "flag --tool-call-parser",
                 "env VLLM_FLASH_V100_DECODE_PARTITION_SIZE"):
        assert must in checked, (must, sorted(checked))
    misses = [f"{r.hook}: {r.detail}" for r in rows if r.miss]
    assert not misses, misses
    spec = next(r for r in rows if r.hook == "flag --speculative-config")
    assert "draft_sample_method" in spec.detail and "use_local_argmax_reduction" in spec.detail


def test_profile_check_fails_on_what_the_engine_does_not_have():
    src = _source(VERSIONS[0])
    cmd = ["py", "-m", "vllm.entrypoints.openai.api_server", "--attention-backend", "FLASH_ATTN_V101",
           "--kv-cache-dtype", "float8", "--tool-call-parser", "qwen3_xmlish", "--no-such-flag",
           "--speculative-config", json.dumps({"method": "mtp", "draft_sampling": "greedy"})]
    rows = {r.hook: r for r in engine_source.verify_profile(src, cmd, {"VLLM_NO_SUCH_KNOB": "1", "PATH": "/"})}
    assert all(r.miss for r in rows.values()), rows
    assert "FLASH_ATTN_V101" in rows["flag --attention-backend"].detail
    assert "draft_sampling" in rows["flag --speculative-config"].detail
    assert "has no --no-such-flag" in rows["flag --no-such-flag"].detail
    assert set(rows) >= {"env VLLM_NO_SUCH_KNOB"} and "env PATH" not in rows


def test_every_flag_of_the_cpu_command_exists_in_the_installed_cpu_engine():
    site = _engine_site_packages()
    if not (site / "vllm").is_dir():
        pytest.skip("no engine installed for QPN_ENGINE_PYTHON")
    launch = _launch(CPU, k=3, mns=1)
    rows = engine_source.verify_profile(engine_source.open_source(site), server_command(launch), server_env(launch))
    assert not [r for r in rows if r.miss], [(r.hook, r.detail) for r in rows if r.miss]


def _engine_rule_constants(src):
    """The base capture lists in 1Cat's _maybe_apply_sm70_mtp_defaults, and whether it adds every
    (K+1)*N for N in 1..max_num_seqs."""
    tree = ast.parse(src.text("engine/arg_utils.py"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_maybe_apply_sm70_mtp_defaults")
    lists = [tuple(ast.literal_eval(n)) for n in ast.walk(fn) if isinstance(n, ast.List)
             and n.elts and all(isinstance(e, ast.Constant) and isinstance(e.value, int) for e in n.elts)]
    text = ast.unparse(fn)
    dense = "decode_query_len * num_reqs for num_reqs in range(1, max_num_seqs + 1)" in text
    tp4 = "self.tensor_parallel_size >= 4" in text
    return lists, dense, tp4


@pytest.mark.fast
@pytest.mark.parametrize("version", VERSIONS)
def test_capture_rule_constants_are_the_engines(version):
    lists, dense, tp4 = _engine_rule_constants(_source(version))
    assert capture_ladder.SM70_ENGINE_BASE_TP4 in lists and capture_ladder.SM70_ENGINE_BASE in lists
    assert dense and tp4
    rounding = ast.unparse(next(
        n for n in ast.walk(ast.parse(_source(version).text("config/compilation.py")))
        if isinstance(n, ast.FunctionDef) and n.name == "adjust_cudagraph_sizes_for_spec_decode"))
    assert "round_up(size, multiple_of) <= self.max_cudagraph_capture_size" in rounding


@pytest.mark.fast
@pytest.mark.parametrize("mns,k,tp", [(1, 7, 4), (4, 7, 4), (16, 7, 4), (5, 3, 1), (1, 1, 1), (33, 4, 4)])
def test_sm70_ladder_keeps_every_size_the_engine_rule_would_capture(mns, k, tp):
    ours = capture_ladder.resolve_capture(None, mns, k, engine_rules=True, tp=tp)
    engine = capture_ladder.engine_sm70_capture_sizes(mns, k, tp)
    assert set(engine) <= set(ours)
    assert all(s % (k + 1) == 0 for s in ours)
    assert {n * (k + 1) for n in range(1, mns + 1)} <= set(ours)  # no verification step padded
    assert capture_ladder.uncovered_widths(ours, mns, k) == []


@pytest.mark.fast
def test_engine_rule_replica_matches_a_hand_computed_case():
    # MNS=1, K=7, TP=4: base {1,2,4,8,9,18} + {8}; max 18; rounded to 8s: 8, 16 (24 > 18 dropped)
    assert capture_ladder.engine_sm70_capture_sizes(1, 7, 4) == [8, 16]
    # TP=1: base {1,2,4,8,9} + {8}; max 9; 9 rounds to 16 > 9, dropped
    assert capture_ladder.engine_sm70_capture_sizes(1, 7, 1) == [8]
