"""The independent float32 reference for INT4 checkpoints (qpn.scripts.checkpoints.int4_reference):
its decoders (vLLM's AWQ / GPTQ dequantization, compressed-tensors' unpacker and dequantize) and
QPN's (the conventions' unpackers into qpn.kernels.families.int4) share no code, and agree bit for bit
in float32 on every INT4 module of every convention, member and GPTQ format the generator writes;
its negative controls change every module; what it cannot read is refused naming it. The teacher-
forced run itself is checkpoint_reference's (tests/test_e2e_int4.py uses it end to end)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.fast

pytest.importorskip("vllm", reason="the reference decodes with vLLM's own code (run under .venv-cpu)")
pytest.importorskip("compressed_tensors")
pytest.importorskip("tokenizers")

from qpn.fork_patches.quant import conventions as cv  # noqa: E402
from qpn.kernels.families.int4 import codec as int4_codec
from qpn.scripts.checkpoints import int4_reference as ref  # noqa: E402
from qpn.scripts.checkpoints import make_int4_checkpoint as mi  # noqa: E402

VARIANTS = {
    "awq": ("awq", {}),
    "gptq-v1": ("gptq", {}),
    "gptq-v2": ("gptq", {"checkpoint_format": "gptq_v2"}),
    "gptq-sym-v1": ("gptq", {"symmetric": True}),
    "gptq-sym-v2": ("gptq", {"symmetric": True, "checkpoint_format": "gptq_v2"}),
    "ct": ("compressed-tensors", {}),
    "ct-sym": ("compressed-tensors", {"symmetric": True}),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-ref")
    for name, (convention, kw) in VARIANTS.items():
        mi.make_int4_checkpoint(root / name, convention, seed=1, group_size=64, **kw)
    return root


def _engine_key(module: str) -> str:
    return "model." + module[len("model.language_model."):] + ".weight"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_decode_is_the_familys_bit_for_bit(ckpts, name):
    from safetensors.torch import load_file

    ckpt = ckpts / name
    sd = ref.dequantized_state_dict(ckpt)
    conv, schemes = cv.declared_modules(ckpt)
    assert len(schemes) == 50
    t = load_file(str(ckpt / "model.safetensors"))
    for module, scheme in schemes.items():
        src = conv.inputs(t, module, scheme)
        got = sd[_engine_key(module)]
        assert got.dtype == torch.float32 and torch.equal(got, int4_codec.dequantize(*src)), module
    # everything else is the checkpoint's BF16 tensor in float32, under transformers' names; no MTP
    assert not any(k.startswith("mtp.") or k.endswith(("qweight", "qzeros", "scales", "g_idx", "weight_packed"))
                   for k in sd)
    assert torch.equal(sd["lm_head.weight"], t["lm_head.weight"].float())
    assert torch.equal(sd["model.layers.0.linear_attn.in_proj_b.weight"],
                       t["model.language_model.layers.0.linear_attn.in_proj_b.weight"].float())
    for control in ref.PERTURBATIONS[1:]:
        bad = ref.dequantized_state_dict(ckpt, control)
        changed = [m for m in schemes if not torch.equal(bad[_engine_key(m)], sd[_engine_key(m)])]
        assert len(changed) == len(schemes), (control, len(changed))
        assert torch.equal(bad["lm_head.weight"], sd["lm_head.weight"])


def test_what_the_reference_cannot_read_is_refused(ckpts, tmp_path):
    bad = tmp_path / "gptq-scattered"
    shutil.copytree(ckpts / "gptq-v1", bad)
    from safetensors.torch import load_file, save_file

    t = load_file(str(bad / "model.safetensors"))
    name = "model.language_model.layers.0.mlp.down_proj.g_idx"
    t[name] = torch.flip(t[name], [0]).contiguous()
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="^model.language_model.layers.0.mlp.down_proj: g_idx is not k // 64"):
        ref.dequantized_state_dict(bad)
    with pytest.raises(ValueError, match="unknown perturbation 'swap'"):
        ref.dequantized_state_dict(ckpts / "awq", "swap")
    other = tmp_path / "modelopt"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "modelopt"}}))
    with pytest.raises(ValueError, match="no AWQ, GPTQ or compressed-tensors quantization_config"):
        ref.dequantized_state_dict(other)
    assert ref.main([str(other), "--token-ids", "1,2,3"]) == 2
    assert ref.main([str(ckpts / "awq"), "--token-ids", "1"]) == 2


def test_reference_command_lines_read_ids_and_write_json(tmp_path, capsys):
    """The convention references' shared command line (checkpoint_reference.variants_main): fewer
    than two token ids is refused naming the tool, the variants and ids reach the run, the JSON goes
    to --out or stdout, and a checkpoint the run refuses exits 2 with its message."""
    from qpn.scripts.checkpoints import checkpoint_reference as cr
    seen = []

    def run(ckpt, ids, variants, kv):
        if ckpt == "bad":
            raise ValueError("module x: no scales")
        seen.append((ckpt, ids, variants, kv))
        return {v: {"ids": ids} for v in variants}

    assert cr.variants_main("int4_reference", "doc", ("none", "zero"), run, ["c", "--token-ids", "5"]) == 2
    assert "int4_reference: need at least two token ids" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert cr.variants_main("int4_reference", "doc", ("none", "zero"), run,
                            ["c", "--token-ids", "5, 6,7", "--variants", "float32,zero", "--kv-cache", "fp8_e4m3",
                             "--out", str(out)]) == 0
    assert seen == [("c", [5, 6, 7], ["float32", "zero"], "fp8_e4m3")]
    assert json.loads(out.read_text()) == {"float32": {"ids": [5, 6, 7]}, "zero": {"ids": [5, 6, 7]}}
    assert cr.variants_main("ct_reference", "doc", ("none",), run, ["c", "--token-ids", "1,2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"float32": {"ids": [1, 2]}}
    assert cr.variants_main("ct_reference", "doc", ("none",), run, ["bad", "--token-ids", "1,2"]) == 2
    assert "ct_reference: module x: no scales" in capsys.readouterr().err
