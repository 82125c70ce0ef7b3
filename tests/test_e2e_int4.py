"""The integer families end to end on the real vLLM 0.32 CPU engine: INT4 W4A16 (issue 26 item 5)
and INT8 W8A16 (issue 41 item 4). The tiny model as AutoAWQ, GPTQ and compressed-tensors
pack-quantized checkpoints (qpn.scripts.checkpoints.make_int4_checkpoint, ``bits`` 4 or 8), each
served by the launcher a user runs (scripts/serve-qwen38-native.sh) with MTP speculation at K = 2,
claimed by the registered QPN config and every quantized module on its family's QPN route (qpn4*,
qpn8i*), and checked against the independent float32 reference (qpn.scripts.checkpoints.
int4_reference: vLLM's own AWQ / GPTQ dequantization and unpackers, compressed-tensors' own).

Seven boots in all, one server at a time (one module-scoped fixture, parametrized):

| server        | checkpoint                                   | what it adds                          |
|---------------|----------------------------------------------|---------------------------------------|
| awq           | AutoAWQ GEMM, asymmetric, group 32           | AWQ's interleaved nibbles             |
| gptq          | GPTQ v1 (zero - 1), asymmetric, group 64     | GPTQ's layout and its v1 zero points  |
| ct-sym        | compressed-tensors W4A16 (symmetric), g 128  | the symmetric member                  |
| gptq-sym-fp8kv| GPTQ v2, symmetric, group 32; FP8 KV forced  | gptq_v2, the FP8 KV path              |
| awq-tp2       | AutoAWQ, group 128, tensor parallel 2        | whole groups per rank (K 256 / 2)     |
| gptq8         | GPTQ 8-bit v1, asymmetric, group 128         | INT8: four bytes a word, v1 zeros     |
| ct8-channel   | compressed-tensors W8A16 symmetric, channel  | INT8 per channel, the symmetric member|

Every server: the launcher printed READY (so every boot gate passed; gates.json is read back and
each gate's verdict checked), prompt log-probabilities agree with the reference within the bound
of tests/_agreement.py (twice the reference's own bfloat16 floor; the nibble-swap and
zero-off-by-one controls far outside), and the census counts every INT4 module of the checkpoint on
a QPN route, every band of the route table used, zero fallbacks, no QPN lm_head (the checkpoint
leaves it in BF16). The fp8 server runs only where the cpu engine has an FP8 KV cache (x86 with
AVX-512 or AMX); elsewhere it is skipped saying so. Also here: TP = 4 on the group-128 checkpoint is
refused before any engine starts, naming the module whose group it would cut; and with
``QPN_INT4=0`` the engine's own AWQ config serves the AWQ checkpoint (one in-process load,
tests/_int4_engine_probe.py) and no QPN config reaches the census.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests._agreement import check_agreement
from tests.test_e2e_loader import PROMPT_TEXT, SERVED_NAME, _run_engine_python, _served_prompt_logprobs
from tests.test_launcher_server import _env

from qpn.scripts.launcher.launched import LaunchedServer

pytestmark = [pytest.mark.engine, pytest.mark.slow]

from tests._ci import REPO  # noqa: E402
K = 2
CONTROLS = ("swap-nibbles", "zero-off-by-one")
# name -> (convention, generator arguments, launcher settings, extra vLLM arguments)
SERVERS = {
    "awq": ("awq", {"group_size": 32}, {}, []),
    "gptq": ("gptq", {"group_size": 64, "checkpoint_format": "gptq"}, {}, []),
    "ct-sym": ("compressed-tensors", {"group_size": 128, "symmetric": True}, {}, []),
    "gptq-sym-fp8kv": ("gptq", {"group_size": 32, "symmetric": True, "checkpoint_format": "gptq_v2"}, {},
                       ["--kv-cache-dtype", "fp8_e4m3"]),
    "awq-tp2": ("awq", {"group_size": 128}, {"TP": "2"}, []),
    # group 128: at groups of 32 and 64 this seed's 8-bit checkpoint has one position where the
    # bfloat16 reference strays 1.7 nats, which leaves 7-8 positions decisive under twice that floor,
    # short of the 16 the agreement rule needs (measured with int4_reference, 2026-12-06)
    "gptq8": ("gptq", {"group_size": 128, "checkpoint_format": "gptq", "bits": 8}, {}, []),
    "ct8-channel": ("compressed-tensors", {"group_size": -1, "symmetric": True, "bits": 8}, {}, []),
}


def _family(served) -> str:
    """The integer family a server's checkpoint is of (its code width)."""
    from qpn.kernels import formats

    return formats.integer_family(served["gen"].get("bits", 4))
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")


@pytest.fixture(scope="module", params=list(SERVERS))
def served(request, tmp_path_factory):
    """One launched server per checkpoint, stopped (nothing of it left) before the next boots."""
    from qpn.scripts.checkpoints.make_int4_checkpoint import make_int4_checkpoint

    name = request.param
    convention, gen, settings, extra = SERVERS[name]
    if "--kv-cache-dtype" in extra:
        from qpn.fork_patches.engine.kv_policy import cpu_lacks_fp8_kv

        if cpu_lacks_fp8_kv():
            pytest.skip("this CPU has no FP8 KV cache in vLLM 0.32 (needs AVX-512 or AMX)")
    tmp = tmp_path_factory.mktemp(f"e2e-int4-{name}")
    ckpt = tmp / name
    make_int4_checkpoint(ckpt, convention, seed=0, **gen)
    env = _env(str(tmp), K=str(K), RUN_DIR=str(tmp / "run"), SERVED_NAME=SERVED_NAME, **settings)
    server = LaunchedServer(str(ckpt), env=env, extra_args=extra)
    server.start(timeout=900)
    try:
        yield {"name": name, "server": server, "api": _Api(server), "ckpt": ckpt, "tmp": tmp,
               "tp": int(settings.get("TP", 1)), "kv": "fp8_e4m3" if extra else "auto",
               "census_dir": tmp / "run" / "census", "convention": convention, "gen": gen}
    finally:
        server.stop()
        assert not server.leftover(), f"{name}: a process of the launcher or its server is left"


class _Api:
    """The launched server's HTTP API as the end-to-end harness asks it (``post``)."""

    def __init__(self, server: LaunchedServer):
        assert server.model == SERVED_NAME, server.model
        self.root = server.url[: -len("/v1")]

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.root + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())


def test_every_boot_gate_passed_through_the_launcher(served):
    """READY means the launcher found no failing gate; here each verdict is read back from the
    gates.json it wrote, with what an integer checkpoint makes of it."""
    from qpn.kernels import formats

    gates = json.loads(Path(served["server"].gates_json).read_text())
    by = {g["name"]: g for g in gates["gates"]}
    assert gates["passed"] is True and gates["k"] == K, gates
    status = {n: g["status"] for n, g in by.items()}
    assert status == {"warm_request": "PASS", "served_depth": "PASS", "census_platform": "PASS",
                      "quant_config": "PASS", "qpn_routes": "PASS", "lm_head_from_codes": "PASS",
                      "kv_cache_dtype": "n/a", "decode_attention_route": "n/a", "skipped_hooks": "PASS"}, by
    tp = served["tp"]
    assert by["served_depth"]["observed"].startswith(f"{K} positions")
    assert by["census_platform"]["observed"].startswith(f"ranks {list(range(tp))}:")
    assert by["quant_config"]["observed"] == "; ".join(f"rank {r}: qpn" for r in range(tp))
    assert f'QPN claims this {served["convention"]} checkpoint' in by["quant_config"]["expected"]
    routes = by["qpn_routes"]
    family = _family(served)
    assert "declared modules (50)" in routes["expected"] and f"regions ['{family}']" in routes["expected"], routes
    others = {f.route_prefix for f in formats.FAMILIES.values()} - {formats.FAMILIES[family].route_prefix}
    assert "fallbacks 0" in routes["observed"] and not any(f"{p}_" in routes["observed"] or f"'{p}'" in routes["observed"]
                                                           for p in others), routes
    assert "leaves lm_head unquantized" in by["lm_head_from_codes"]["expected"]


def test_served_logprobs_agree_with_the_float32_reference(served):
    """The bound of every end-to-end test (tests/_agreement.py): mean and max |delta log-prob| over
    the teacher-forced positions within twice the reference's own bfloat16 floor, on the same KV
    path; both controls (nibbles swapped, zero points one off) beyond five times the mean bound."""
    api = served["api"]
    ids = api.post("/tokenize", {"model": SERVED_NAME, "prompt": PROMPT_TEXT, "add_special_tokens": False})["tokens"]
    assert len(ids) >= 65, "need at least 64 teacher-forced positions"
    got, top1 = _served_prompt_logprobs(api, ids)
    out = served["tmp"] / "references.json"
    _run_engine_python(["-m", "qpn.scripts.checkpoints.int4_reference", str(served["ckpt"]),
                        "--token-ids", ",".join(map(str, ids)), "--variants", ",".join(["float32", "bfloat16", *CONTROLS]),
                        "--kv-cache", served["kv"], "--out", str(out)])
    refs = json.loads(out.read_text())
    # A zero point one off moves an 8-bit weight by one of 255 steps, not 15: for INT8 that control
    # is subtle (the bound must still reject it), the swapped nibbles stay gross.
    subtle = ("zero-off-by-one",) if _family(served) == "int8" else ()
    check_agreement(got, top1, refs, f"{served['name']} (TP={served['tp']}, KV {served['kv']})",
                    gross=tuple(c for c in CONTROLS if c not in subtle), subtle=subtle)


def test_census_every_quantized_module_on_a_qpn_route(served):
    """One prompt per band of the route table (M = 5, 12, 40, 130 tokens), each with a decode step:
    every module the checkpoint declares is on its family's QPN route on every rank, each band used,
    zero fallbacks; modules are served fused as vLLM fuses them (32 in this model), each prepacked
    and proven; the head stays the engine's. At TP = 2 every row-parallel module holds K / 2 = 128
    inputs per rank: one whole group of 128."""
    from qpn.fork_patches.route_census.census import aggregate
    from qpn.kernels import formats
    from qpn.kernels.routes import QPN_ROUTES
    from qpn.scripts.launcher import boot_gates

    api = served["api"]
    words = "north south east west river stone cloud field light music paper window".split()
    for n in (5, 12, 40, 130):
        ids = api.post("/tokenize", {"model": SERVED_NAME, "prompt": " ".join(words * 20),
                                     "add_special_tokens": False})["tokens"][:n]
        ids[0] = (ids[0] + n) % 400  # distinct prompts
        api.post("/v1/completions", {"model": SERVED_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0})
    time.sleep(2.5)  # each rank's census thread writes at most once a second
    agg = aggregate(str(served["census_dir"]))
    config = json.loads((served["ckpt"] / "config.json").read_text())
    layers = config["num_hidden_layers"]
    family = _family(served)
    prefix = formats.FAMILIES[family].route_prefix
    expected = {family: 4 * layers}  # per layer: in_proj_qkvz / qkv_proj, out_proj / o_proj, gate_up_proj, down_proj
    tp = served["tp"]
    assert [r["rank"] for r in agg["ranks"]] == list(range(tp))
    assert agg["modules_by_region"] == {family: expected[family] * tp}
    assert agg["modules_on_qpn"] == agg["modules_total"] == expected[family] * tp
    assert agg["fallback_calls"] == 0 and agg["fallbacks"] == [] and agg["non_qpn_routes"] == []
    assert set(agg["route_counts"]) <= {r for r in QPN_ROUTES if r == prefix or r.startswith(prefix + "_")}, \
        agg["route_counts"]
    for band in (prefix, f"{prefix}_mt2", f"{prefix}_chunked", f"{prefix}_reconstruct"):
        assert agg["route_counts"].get(band, {}).get("eager", 0) > 0, band
    assert agg["lm_head"] == [] or all(h is None for h in agg["lm_head"]), agg["lm_head"]
    _, declared = boot_gates.declared_modules(str(served["ckpt"]))
    engine_names = {c.replace("model.language_model.", "model.", 1) for c in declared}
    g = served["gen"]["group_size"]
    for rank in agg["ranks"]:
        assert rank["quant_config"] == "qpn" and rank["serving"]["num_speculative_tokens"] == K
        assert set(rank["declared_on_qpn"]) == engine_names and not rank["declared_off_qpn"]
        # the by-name record the gate pairs through, every convention
        assert rank["checkpoint_modules"] == {c: c.replace("model.language_model.", "model.", 1) for c in declared}
        modules = json.loads((Path(served["census_dir"]) / f"census_rank{rank['rank']}.json").read_text())["modules"]
        assert len(modules) == expected[family]
        for mname, m in modules.items():
            assert m["region"] == family and m["eligible"] and m["prepack_verified"], mname
            if mname.rsplit(".", 1)[-1] in ROW_PARALLEL:
                assert m["k"] == 256 // tp and (g == -1 or m["k"] % g == 0), (mname, m["k"], g)


def test_tp4_that_would_cut_a_group_is_refused_before_any_engine_starts(tmp_path):
    """The group-128 checkpoint of the TP = 2 server at TP = 4: 64 inputs per rank would cut every
    row-parallel module's groups; the launcher refuses before starting an engine, naming one."""
    from qpn.scripts.checkpoints.make_int4_checkpoint import make_int4_checkpoint

    make_int4_checkpoint(tmp_path / "awq128", "awq", seed=0, group_size=128)
    server = LaunchedServer(str(tmp_path / "awq128"), env=_env(str(tmp_path), K=str(K), TP="4",
                                                               RUN_DIR=str(tmp_path / "run")))
    with pytest.raises(RuntimeError) as err:
        server.start(timeout=300)
    out = str(err.value)
    assert "REFUSED" in out and "TP=4: this checkpoint cannot be split over 4 ranks" in out, out
    assert "mlp.down_proj: row-parallel K=256/TP=4 = 64 inputs per rank splits an INT4 W4A16 group " \
           "(one float16 scale per 128 inputs)" in out, out
    assert server.server_pid is None and not server.leftover()
    assert not (tmp_path / "run" / "census").exists()


def test_qpn_int4_0_leaves_the_checkpoint_to_the_engines_own_config(tmp_path):
    """QPN_INT4=0: the engine's own AWQ config (and its CPU kernels) serve the AWQ checkpoint, the
    registered QPN config claims nothing, so no rank writes a QPN census; the engine's own INT4 path
    agrees with the same float32 reference too (the reference is no mirror of QPN's decode)."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    from qpn.scripts.checkpoints.make_int4_checkpoint import make_int4_checkpoint

    ckpt = tmp_path / "awq"
    make_int4_checkpoint(ckpt, "awq", seed=0, group_size=32)
    census = tmp_path / "census"
    proc = subprocess.run([os.environ.get("QPN_ENGINE_PYTHON", sys.executable), str(REPO / "tests" / "_int4_engine_probe.py"),
                           str(ckpt), PROMPT_TEXT], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, QPN_INT4="0", QPN_CENSUS_DIR=str(census),
                                   VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), VLLM_CPU_KVCACHE_SPACE="1"))
    line = [x for x in proc.stdout.splitlines() if x.startswith("QPN_INT4_ENGINE ")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    run = json.loads(line[0][len("QPN_INT4_ENGINE "):])
    assert run["quant_config"] != "qpn"
    assert get_quantization_config(run["quant_config"]).__name__ == "AutoAWQConfig"
    assert not census.exists() or not list(census.glob("census_rank*.json")), "no QPN config may reach a rank"
    out = tmp_path / "references.json"
    _run_engine_python(["-m", "qpn.scripts.checkpoints.int4_reference", str(ckpt), "--token-ids",
                        ",".join(map(str, run["ids"])), "--variants", ",".join(["float32", "bfloat16", *CONTROLS]),
                        "--out", str(out)])
    # The engine's own CPU AWQ kernel is not QPN's arithmetic and its distance from the float32
    # reference depends on the host: within twice the bf16 floor on an AVX-512 host without AMX,
    # 2.5x (mean) and 2.0x (max) on an AMX host (2026-12-06, the same checkpoint and prompt). Three
    # times the floor holds on both; the gross controls must still land beyond five times that.
    check_agreement(run["logprobs"], run["top1"], json.loads(out.read_text()), "the engine's own AWQ path (QPN_INT4=0)",
                    gross=CONTROLS, floor_factor=3.0)
