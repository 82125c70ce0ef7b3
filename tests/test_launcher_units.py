"""Launcher pieces that need no engine: capture ladder, refusals before boot, gate evaluation.

The refusal tests run the real shell entry point and check that it exits before the line that
precedes starting the engine, quickly, with a message naming the problem and the fix.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from qpn.scripts.launcher import boot_gates, serve_preflight
from qpn.scripts.launcher.capture_ladder import (
    CaptureSpecError, derive_capture_sizes, resolve_capture, uncovered_widths,
)
from qpn.scripts.launcher.engine_profiles import CPU, SM70

from tests._ci import REPO  # noqa: E402
SERVE_SH = os.path.join(REPO, "scripts", "serve-qwen38-native.sh")
ENGINE_STARTED = "starting the engine"

# The one-minute tier (pytest -m fast): nothing here boots an engine, builds a venv or downloads.
pytestmark = pytest.mark.fast


# ---- capture ladder (seed 001) ---------------------------------------------------------------

@pytest.mark.parametrize("mns,k,expected", [
    (1, 7, [8]),
    (16, 0, [1, 2, 3, 4, 6, 8, 12, 16]),
    (4, 4, [5, 10, 15, 20]),
])
def test_capture_ladder_pairs(mns, k, expected):
    sizes = derive_capture_sizes(mns, k)
    assert sizes == expected
    assert all(s % (k + 1) == 0 for s in sizes)
    assert uncovered_widths(sizes, mns, k) == []


@pytest.mark.parametrize("mns,k", [(n, k) for n in (1, 2, 3, 5, 7, 16, 33, 100, 256)
                                   for k in (0, 1, 3, 4, 7, 15)])
def test_capture_ladder_covers_every_width(mns, k):
    sizes = derive_capture_sizes(mns, k)
    for n in range(1, mns + 1):
        width = n * (k + 1)
        assert any(s >= width for s in sizes), (n, width, sizes)
    assert all(s % (k + 1) == 0 for s in sizes)
    assert sizes == sorted(set(sizes)) and sizes[-1] == mns * (k + 1)
    assert len(sizes) <= 2 * max(1, mns).bit_length() + 2  # geometric, not one per width


def test_capture_spec_resolution():
    assert resolve_capture(None, 4, 4) == [5, 10, 15, 20]
    assert resolve_capture("none", 4, 4) is None
    assert resolve_capture("5,20", 4, 4) == [5, 20]
    with pytest.raises(CaptureSpecError, match="not multiples of K\\+1=5"):
        resolve_capture("1,2,4,8,16", 4, 4)  # seed 001's failure: none is a multiple of 5
    with pytest.raises(CaptureSpecError, match="exceed the largest captured size"):
        resolve_capture("1,2", 16, 0)  # the SM70 stock list: widths 3..16 would run eager
    with pytest.raises(CaptureSpecError, match="comma-separated list"):
        resolve_capture("eight", 1, 7)


@pytest.mark.parametrize("mns,k", [(1, 0), (1, 7), (2, 3), (4, 4), (16, 0), (33, 3), (256, 7)])
def test_capture_coverage_checks_both_ends_of_the_width_range(mns, k):
    """The coverage check spans N = 1..MNS inclusive: a ladder that reaches every width but the
    largest (a check that stops at MNS - 1 passes it) is refused naming that width, and an empty
    ladder leaves the smallest, K+1, uncovered as well."""
    width = k + 1
    top = mns * width
    short = [s for s in derive_capture_sizes(mns, k) if s < top] + ([top - width] if mns > 1 else [])
    assert uncovered_widths(short, mns, k) == [top]
    assert uncovered_widths([], mns, k) == [n * width for n in range(1, mns + 1)]
    if short:
        with pytest.raises(CaptureSpecError, match=rf"decode widths \[{top}\] .*MNS={mns}.* exceed the "
                                                   rf"largest captured size {top - width} .*Use CAPTURE="):
            resolve_capture(",".join(map(str, short)), mns, k)
        assert resolve_capture(",".join(map(str, short + [top])), mns, k) == sorted(set(short + [top]))


def test_a_derived_ladder_short_of_the_top_is_refused(monkeypatch):
    """The derived ladder goes through the same coverage check as a hand-written one, for every
    depth it must cover (K=auto's ladder too): a derivation that drops the top rung is refused."""
    from qpn.scripts.launcher import capture_ladder

    real = capture_ladder.derive_capture_sizes
    monkeypatch.setattr(capture_ladder, "derive_capture_sizes", lambda mns, k: real(mns, k)[:-1])
    with pytest.raises(CaptureSpecError, match=r"derived capture ladder .* leaves decode widths \[20\]"):
        capture_ladder.resolve_capture(None, 4, 4)
    with pytest.raises(CaptureSpecError, match=r"widths \[16\] \(N\*\(K\+1\) for K=3, N up to MNS=4\)"):
        capture_ladder.resolve_capture(None, 4, 3, ladder=(1, 3))
    # on the sm70 engine its own rule adds every N*(K+1) up to MNS: the union still covers them
    assert capture_ladder.resolve_capture(None, 4, 4, engine_rules=True, tp=4)[-1] == 20


# ---- refusals before boot --------------------------------------------------------------------

def _serve(args, tmp_path, **env_over):
    env = {k: v for k, v in os.environ.items()
           if k not in ("HOST", "PORT", "K", "MNS", "CAPTURE", "I_UNDERSTAND_THIS_IS_UNAUTHENTICATED")}
    env.update(RUN_DIR=str(tmp_path / "run"), **env_over)
    start = time.monotonic()
    proc = subprocess.run(["bash", SERVE_SH, *args], capture_output=True, text=True, env=env,
                          timeout=120)
    return proc, time.monotonic() - start


def _fake_ckpt(tmp_path, mtp_layers=1, with_mtp_weights=True):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5ForCausalLM"], "mtp_num_hidden_layers": mtp_layers}))
    keys = ["model.embed_tokens.weight"] + (["mtp.fc.weight"] if with_mtp_weights else [])
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model.safetensors" for k in keys}}))
    return ckpt


def _refused(proc, elapsed, *needles):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "REFUSED" in proc.stderr
    assert ENGINE_STARTED not in out, "an engine process was started"
    assert elapsed < 60
    for needle in needles:
        assert needle in out, (needle, out)


def test_public_bind_without_ack_refused(tmp_path):
    proc, t = _serve([str(_fake_ckpt(tmp_path))], tmp_path, HOST="0.0.0.0")
    _refused(proc, t, "HOST=0.0.0.0", "I_UNDERSTAND_THIS_IS_UNAUTHENTICATED=1", "ssh -N -L")


def test_public_bind_with_ack_passes_the_bind_check():
    serve_preflight.check_bind("0.0.0.0", {"I_UNDERSTAND_THIS_IS_UNAUTHENTICATED": "1"})
    serve_preflight.check_bind("::1", {})
    serve_preflight.check_bind("localhost", {})
    with pytest.raises(serve_preflight.Refusal):
        serve_preflight.check_bind("10.1.2.3", {"I_UNDERSTAND_THIS_IS_UNAUTHENTICATED": "yes"})


def test_port_in_use_refused(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        proc, t = _serve([str(_fake_ckpt(tmp_path))], tmp_path, PORT=str(port))
    _refused(proc, t, f"port {port}", "already in use", "PORT=")


def test_missing_checkpoint_refused(tmp_path):
    proc, t = _serve([str(tmp_path / "nowhere")], tmp_path)
    _refused(proc, t, "does not exist", "hf download", serve_preflight.PINNED_REVISION)


def test_checkpoint_without_config_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    proc, t = _serve([str(tmp_path / "empty")], tmp_path)
    _refused(proc, t, "no config.json")


def test_no_checkpoint_argument_refused(tmp_path):
    proc, t = _serve([], tmp_path)
    _refused(proc, t, "usage:")


@pytest.mark.parametrize("k,layers,weights,needle", [
    (16, 1, True, "deeper than 15"),
    (-1, 1, True, "0 (off) or a positive"),
    (3, 0, True, "declares no MTP layers"),
    (3, 2, True, "multiple of it"),
    (3, 1, False, "no mtp.* tensors"),
])
def test_depth_outside_the_head_refused(tmp_path, k, layers, weights, needle):
    ckpt = _fake_ckpt(tmp_path, mtp_layers=layers, with_mtp_weights=weights)
    proc, t = _serve([str(ckpt)], tmp_path, K=str(k))
    _refused(proc, t, needle)


def test_depth_rule_follows_vllm_head_reuse(tmp_path):
    ckpt = _fake_ckpt(tmp_path, mtp_layers=2)
    config = json.loads((ckpt / "config.json").read_text())
    for k in (0, 1, 2, 4, 6):  # within the head, or whole passes of it
        serve_preflight.check_depth(k, config, str(ckpt))
    config["mtp_num_hidden_layers"] = 1
    for k in range(1, serve_preflight.MAX_DEPTH + 1):  # one layer reused: any depth
        serve_preflight.check_depth(k, config, str(ckpt))


def test_bad_capture_refused(tmp_path):
    proc, t = _serve([str(_fake_ckpt(tmp_path))], tmp_path, K="4", MNS="4",
                     CAPTURE="1,2,4,8,16", QPN_ENGINE_PYTHON=sys.executable)
    if "no vLLM engine we support" in proc.stderr:
        pytest.skip("the test python has no engine; the capture check runs after detection")
    _refused(proc, t, "not multiples of K+1=5", "CAPTURE=5,10,15,20")


# ---- pinned revision (a warning, not a refusal) ----------------------------------------------

def test_revision_from_hf_download_metadata(tmp_path):
    ckpt = _fake_ckpt(tmp_path)
    assert "unknown revision" in serve_preflight.revision_warning(str(ckpt))
    meta = ckpt / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (meta / "config.json.metadata").write_text(
        f"{serve_preflight.PINNED_REVISION}\n\"etag\"\n1760000000.0\n")
    assert serve_preflight.revision_warning(str(ckpt)) is None
    (meta / "config.json.metadata").write_text("0123456789abcdef\n")
    warning = serve_preflight.revision_warning(str(ckpt))
    assert "0123456789abcdef" in warning and "not comparable" in warning


def test_revision_file(tmp_path):
    ckpt = _fake_ckpt(tmp_path)
    (ckpt / "REVISION").write_text(serve_preflight.PINNED_REVISION + "\n")
    assert serve_preflight.revision_warning(str(ckpt)) is None


# ---- GPUs in use (nvidia-smi stand-in) -------------------------------------------------------

def _fake_nvidia_smi(tmp_path, apps: str) -> str:
    exe = tmp_path / "nvidia-smi"
    exe.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --query-gpu=*) printf "0, GPU-aaa\\n1, GPU-bbb\\n" ;;\n'
        f"  --query-compute-apps=*) printf '{apps}' ;;\n"
        "esac\n")
    exe.chmod(0o755)
    return str(exe)


def test_busy_gpus_refused_with_holders(tmp_path):
    smi = _fake_nvidia_smi(tmp_path, "GPU-bbb, 4242, python3, 15000 MiB\\n")
    with pytest.raises(serve_preflight.Refusal) as err:
        serve_preflight.check_gpus_free(smi)
    assert "GPU 1: pid 4242 python3 (15000 MiB)" in str(err.value)
    # a process on a GPU outside CUDA_VISIBLE_DEVICES does not block
    assert serve_preflight.check_gpus_free(smi, visible="0") == "free"


def test_free_gpus_pass_and_missing_nvidia_smi_refused(tmp_path):
    assert serve_preflight.check_gpus_free(_fake_nvidia_smi(tmp_path, "")) == "free"
    with pytest.raises(serve_preflight.Refusal, match="not found"):
        serve_preflight.check_gpus_free(str(tmp_path / "absent-nvidia-smi"))


# ---- gate evaluation on census / metrics -----------------------------------------------------

def _metrics(k: int) -> str:
    lines = ["# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
              f'model_name="m",position="{i}"}} 0.0' for i in range(k)]
    lines += ['vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0',
              f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {3.0 * k}']
    return "\n".join(lines) + "\n"


def _census(**over) -> dict:
    census = {
        "ranks": [{"rank": 0, "pid": 1, "platform": "cpu", "backend": "reference",
                   "device_capability": None, "tensor_parallel_size": 1,
                   "modules_total": 5, "modules_on_qpn": 5}],
        "modules_by_region": {"nvfp4": 3, "fp8": 2}, "modules_on_qpn": 5, "modules_total": 5,
        "route_counts": {"qpn2": {"eager": 10, "graph": 0}, "qpn8": {"eager": 8, "graph": 0}},
        "non_qpn_routes": [], "fallback_calls": 0, "fallbacks": [],
        "lm_head": [{"module": "lm_head", "region": "nvfp4", "source": "checkpoint_codes",
                     "route_family": "qpn2", "repack_fallback": False}],
        "kv_resolved": [{"checkpoint_requested": "fp8", "resolved": "fp8_e4m3", "policy": "x"}],
    }
    census.update(over)
    return census


WARM_OK = {"ok": True, "completion_tokens": 8}


def _by_name(results):
    return {r.name: r for r in results}


def test_served_depth_from_metrics():
    assert boot_gates.served_depth(_metrics(7)) == 7
    assert boot_gates.served_depth(_metrics(0)) == 0
    assert boot_gates.served_depth("") == 0


def test_cpu_gates_pass_on_a_good_census():
    results = boot_gates.evaluate(CPU, 3, WARM_OK, _metrics(3), _census(), {"nvfp4", "fp8"})
    gates = _by_name(results)
    assert not any(r.failed for r in results), boot_gates.format_table(results)
    assert gates["kv_cache_dtype"].status == "n/a" and "fp8_e4m3" in gates["kv_cache_dtype"].observed
    assert gates["decode_attention_route"].status == "n/a"


@pytest.mark.parametrize("change,gate", [
    (dict(k_served=2), "served_depth"),
    (dict(warm={"ok": False, "error": "HTTP 500"}), "warm_request"),
    (dict(census=_census(modules_on_qpn=4, route_counts={
        "qpn2": {"eager": 10, "graph": 0}, "marlin": {"eager": 3, "graph": 0}},
        non_qpn_routes=["marlin"])), "qpn_routes"),
    (dict(census=_census(fallback_calls=2, fallbacks=[
        {"module": "model.layers.0.mlp.down_proj", "reason": "x", "count": 2, "rank": 0}])),
     "qpn_routes"),
    (dict(census=_census(modules_by_region={"nvfp4": 5}, modules_total=5)), "qpn_routes"),
    (dict(census=_census(route_counts={})), "qpn_routes"),
    (dict(census=_census(lm_head=[{"module": "lm_head", "source": "repacked",
                                   "route_family": "qpn2", "repack_fallback": True}])),
     "lm_head_from_codes"),
    (dict(census=_census(lm_head=[])), "lm_head_from_codes"),
    (dict(census=_census(ranks=[{"rank": 0, "platform": "cpu", "backend": "cuda"}])),
     "census_platform"),
    (dict(census={}), "census_platform"),
])
def test_cpu_gate_failures_name_the_gate(change, gate):
    k = 3
    results = boot_gates.evaluate(
        CPU, k, change.get("warm", WARM_OK), _metrics(change.get("k_served", k)),
        change.get("census", _census()), {"nvfp4", "fp8"})
    failed = [r.name for r in results if r.failed]
    assert gate in failed, boot_gates.format_table(results)


def test_sm70_gates_require_fp16_kv_and_tensor_core_attention():
    # the decode-attention decision table itself: tests/test_attention_routes.py
    rank = {"rank": 0, "platform": "cuda", "backend": "cuda", "device_capability": "7.0",
            "tensor_parallel_size": 1, "engine_version": "1.3.0", "modules_total": 5, "modules_on_qpn": 5,
            "serving": {"max_model_len": 32768, "enforce_eager": False, "num_speculative_tokens": 7,
                        "attention_backend": "FLASH_ATTN_V100"},
            "attention_layers": [{"impl": "FlashAttnV100Impl", "kv_cache_dtype": "auto",
                                  "cache_tensor_dtype": "float16", "head_size": 256, "num_heads": 24,
                                  "num_kv_heads": 4, "sliding_window": None, "layers": 16}],
            "attention_routes": {"decode_xqa_paged": {"eager": 0, "graph": 40},
                                 "prefill_smallq_decode_xqa": {"eager": 0, "graph": 16}}}
    good = _census(ranks=[rank], kv_resolved=[{"resolved": "float16"}])
    results = _by_name(boot_gates.evaluate(SM70, 7, WARM_OK, _metrics(7), good, {"nvfp4"}))
    assert not any(r.failed for r in results.values()), boot_gates.format_table(list(results.values()))
    fp8_kv = _census(ranks=[rank], kv_resolved=[{"resolved": "fp8_e4m3"}])
    assert _by_name(boot_gates.evaluate(SM70, 7, WARM_OK, _metrics(7), fp8_kv, {"nvfp4"})
                    )["kv_cache_dtype"].failed
    scalar = _census(ranks=[{**rank, "attention_routes": {
        **rank["attention_routes"], "decode_scalar_paged": {"eager": 2, "graph": 0}}}],
        kv_resolved=[{"resolved": "float16"}])
    assert _by_name(boot_gates.evaluate(SM70, 7, WARM_OK, _metrics(7), scalar, {"nvfp4"})
                    )["decode_attention_route"].failed
    unobserved = _census(ranks=[{k: v for k, v in rank.items() if k != "attention_routes"}],
                         kv_resolved=[{"resolved": "float16"}])
    assert _by_name(boot_gates.evaluate(SM70, 7, WARM_OK, _metrics(7), unobserved, {"nvfp4"})
                    )["decode_attention_route"].failed


def _sm70_two_ranks(**rank1) -> dict:
    """A TP2 sm70 census every gate passes; ``rank1`` overrides rank 1's record (None: drop the key)."""
    def rank(rid):
        return {"rank": rid, "platform": "cuda", "backend": "cuda", "device_capability": "7.0",
                "tensor_parallel_size": 2, "engine_version": "1.3.0", "quant_config": "qpn",
                "modules_total": 5, "modules_on_qpn": 5, "draft_depth_steps": {"3": 4, "7": 6},
                "serving": {"max_model_len": 32768, "enforce_eager": False, "num_speculative_tokens": 7,
                            "attention_backend": "FLASH_ATTN_V100"},
                "attention_layers": [{"impl": "FlashAttnV100Impl", "kv_cache_dtype": "auto",
                                      "cache_tensor_dtype": "float16", "head_size": 256, "num_heads": 12,
                                      "num_kv_heads": 2, "sliding_window": None, "layers": 16}],
                "attention_routes": {"decode_xqa_paged": {"eager": 0, "graph": 40},
                                     "prefill_smallq_decode_xqa": {"eager": 0, "graph": 16}}}
    second = {k: v for k, v in {**rank(1), **rank1}.items() if v is not None}
    head = {"module": "lm_head", "region": "nvfp4", "source": "checkpoint_codes", "route_family": "qpn2",
            "repack_fallback": False}
    return _census(ranks=[rank(0), second], modules_on_qpn=10, modules_total=10,
                   modules_by_region={"nvfp4": 6, "fp8": 4}, lm_head=[head, head],
                   kv_resolved=[{"resolved": "float16"}, {"resolved": "float16"}],
                   draft_depth_steps={"3": 4, "7": 6})


# Rank 0 right, rank 1 wrong, one gate at a time: a gate that passes when one rank is right (or
# fails without saying which rank is wrong) does not guard every rank.
_RANK1_WRONG = [
    ("kv_cache_dtype", dict(census=dict(kv_resolved=[{"resolved": "float16"}, {"resolved": "fp8_e4m3"}])),
     "rank(s) [1] not on float16"),
    ("kv_cache_dtype", dict(census=dict(kv_resolved=[{"resolved": "float16"}])), "rank 1: not recorded"),
    ("kv_cache_dtype", dict(census=dict(kv_resolved=[{"resolved": "float16"}, None])), "rank(s) [1] not on"),
    ("qpn_routes", dict(rank1=dict(modules_total=0, modules_on_qpn=0), census=dict(modules_total=5, modules_on_qpn=5)),
     "rank 1: no quantized module admitted"),
    ("qpn_routes", dict(rank1=dict(modules_on_qpn=3), census=dict(modules_on_qpn=8)),
     "rank 1: 2 of 5 module(s) not on a QPN route"),
    ("qpn_routes", dict(rank1=dict(backend="reference")), "backend ['reference'] on rank(s) [1]"),
    ("lm_head_from_codes", dict(census=dict(lm_head=[
        {"module": "lm_head", "region": "nvfp4", "source": "checkpoint_codes", "route_family": "qpn2",
         "repack_fallback": False},
        {"module": "lm_head", "region": "nvfp4", "source": "repacked", "route_family": "qpn2",
         "repack_fallback": True}])), "rank(s) [1] not served from the checkpoint's codes"),
    ("lm_head_from_codes", dict(census=dict(lm_head=[
        {"module": "lm_head", "region": "nvfp4", "source": "checkpoint_codes", "route_family": "qpn2",
         "repack_fallback": False}, None])), "no lm_head entry in the census of 1 rank(s) [1]"),
    ("quant_config", dict(rank1=dict(quant_config=None)), "rank(s) [1] were not served through the QPN config"),
    ("census_platform", dict(rank1=dict(device_capability="8.0")), "rank(s) [1] not on"),
    ("decode_attention_route", dict(rank1=dict(attention_routes={
        "decode_xqa_paged": {"eager": 0, "graph": 40}, "decode_scalar_paged": {"eager": 2, "graph": 0},
        "prefill_smallq_decode_xqa": {"eager": 0, "graph": 16}})), "rank 1 "),
    ("served_depth", dict(rank1=dict(draft_depth_steps={"3": 4, "5": 6})),
     "rank 1 drafted depth(s) [5] outside the ladder"),
    ("skipped_hooks", dict(census=dict(hooks_skipped=[{"hook": "qpn-moe-method", "needed_for": "moe",
                                                       "engine": "sm70", "rank": 1}])),
     "qpn-moe-method (rank(s) [1])"),
]


@pytest.mark.parametrize("gate,change,needle", _RANK1_WRONG,
                         ids=[f"{g}-{i}" for i, (g, _, _) in enumerate(_RANK1_WRONG)])
def test_every_per_rank_gate_requires_every_rank(gate, change, needle):
    auto = boot_gates.AutoDepth((3, 7), short=(30, 7), long=(400, 3))
    declared = {"lm_head": {"quant_algo": "NVFP4"}, "model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4"}}

    def gates(census):
        return _by_name(boot_gates.evaluate(SM70, 7, WARM_OK, _metrics(7), census, {"nvfp4", "fp8"}, tp=2,
                                            declared=declared, auto_depth=auto, qpn_claim="modelopt_mixed"))

    good = gates(_sm70_two_ranks())
    assert not any(r.failed for r in good.values()), boot_gates.format_table(list(good.values()))
    bad = gates({**_sm70_two_ranks(**change.get("rank1", {})), **change.get("census", {})})
    assert bad[gate].failed and needle in bad[gate].observed, boot_gates.format_table(list(bad.values()))


def test_quant_config_reads_every_record_of_a_rank():
    # two census records for rank 0 (a stale file beside a fresh one): the wrong one is not hidden
    # behind the right one, whichever is read last
    for records in ([None, "qpn"], ["qpn", None]):
        g = boot_gates.gate_quant_config({"ranks": [{"rank": 0, "quant_config": q} for q in records]},
                                         "modelopt_mixed")
        assert g.failed and "rank(s) [0] were not served through the QPN config" in g.observed, g


def test_gate_table_and_json():
    results = boot_gates.evaluate(CPU, 2, WARM_OK, _metrics(1), _census(), set())
    table = boot_gates.format_table(results)
    assert table.splitlines()[0].split()[:2] == ["gate", "status"]
    assert "served_depth" in table and "FAIL" in table
    doc = json.loads(boot_gates.to_json(results, engine="cpu", k=2))
    assert doc["passed"] is False and doc["k"] == 2
    assert [g["name"] for g in doc["gates"]][0] == "warm_request"


def test_run_dir_with_an_earlier_census_refused(tmp_path):
    (tmp_path / "run" / "census").mkdir(parents=True)
    proc, t = _serve([str(_fake_ckpt(tmp_path))], tmp_path, QPN_ENGINE_PYTHON=sys.executable)
    if "no vLLM engine we support" in proc.stderr:
        pytest.skip("the test python has no engine; the run-dir check runs after detection")
    _refused(proc, t, "already holds a census", "new RUN_DIR")


# ---- the command and environment each engine profile produces --------------------------------

def _launch(profile, **over):
    from qpn.scripts.launcher.serve import Launch

    fields = dict(ckpt="/ckpt", extra_args=["--max-num-batched-tokens", "4096"], k=7, mns=4,
                  mml=profile.default_max_model_len, gmu=profile.default_gpu_memory_utilization,
                  tp=profile.default_tensor_parallel, host="127.0.0.1", port=8000,
                  capture=derive_capture_sizes(4, 7), python="/engine/bin/python",
                  profile=profile, engine_version="x", served_name="m", tool_parser="hermes",
                  thinking=True, api_key=None, run_dir="/run", boot_timeout=1.0,
                  environ={"PATH": "/bin"})
    fields.update(over)
    return Launch(**fields)


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_sm70_command_carries_the_profile():
    from qpn.scripts.launcher.serve import server_command, server_env

    launch = _launch(SM70)
    cmd = server_command(launch)
    assert cmd[:3] == ["/engine/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(cmd, "--dtype") == "float16" and _flag(cmd, "--kv-cache-dtype") == "float16"
    assert _flag(cmd, "--attention-backend") == "FLASH_ATTN_V100"
    assert _flag(cmd, "--tensor-parallel-size") == "4"
    assert json.loads(_flag(cmd, "--compilation-config")) == {
        "cudagraph_capture_sizes": [8, 16, 24, 32]}
    assert json.loads(_flag(cmd, "--speculative-config")) == {
        "method": "mtp", "num_speculative_tokens": 7, "draft_sample_method": "greedy",
        "use_local_argmax_reduction": True}
    assert _flag(cmd, "--reasoning-parser") == "qwen3"
    assert _flag(cmd, "--tool-call-parser") == "hermes" and "--enable-auto-tool-choice" in cmd
    assert cmd[-2:] == ["--max-num-batched-tokens", "4096"]  # pass-through comes last
    env = server_env(launch)
    assert env["QPN_CENSUS_DIR"] == "/run/census"
    assert env["VLLM_FLASH_V100_DECODE_PARTITION_SIZE"] == "256"
    pinned = server_env(_launch(SM70, environ={"VLLM_FLASH_V100_DECODE_PARTITION_SIZE": "1024"}))
    assert pinned["VLLM_FLASH_V100_DECODE_PARTITION_SIZE"] == "1024"  # the user's value wins


def test_cpu_command_runs_eager_without_capture_and_k0_drops_speculation():
    from qpn.scripts.launcher.serve import server_command, server_env

    cmd = server_command(_launch(CPU))
    assert "--enforce-eager" in cmd and "--no-enable-prefix-caching" in cmd
    assert "--compilation-config" not in cmd and "--tensor-parallel-size" not in cmd
    assert "--gpu-memory-utilization" not in cmd
    assert server_env(_launch(CPU))["VLLM_CPU_KVCACHE_SPACE"] == "1"
    off = server_command(_launch(CPU, k=0, tool_parser=None, capture=None))
    assert "--speculative-config" not in off and "--enable-auto-tool-choice" not in off


def test_tool_parser_follows_the_chat_template(tmp_path):
    from qpn.scripts.launcher.serve import tool_parser_for

    (tmp_path / "chat_template.jinja").write_text('<tool_call>\n{"name": ...}\n</tool_call>')
    assert tool_parser_for(str(tmp_path)) == "hermes"
    (tmp_path / "chat_template.jinja").write_text("<tool_call>\n<function=NAME>\n</tool_call>")
    assert tool_parser_for(str(tmp_path)) == "qwen3_coder"  # 1Cat's recommendation for Qwen3.x
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert tool_parser_for(str(tmp_path)) is None
