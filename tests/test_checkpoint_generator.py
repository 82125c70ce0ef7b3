"""The checkpoint generator writes a true ModelOpt mixed checkpoint: layout, encodings (checked
with an independent decoder), per-shard scales, tokenizer and chat template, malformed variants,
and never a half-written folder."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from qpn.scripts.checkpoints import make_checkpoint as mc  # noqa: E402
from qpn.scripts.checkpoints import tiny_hybrid, tiny_tokenizer  # noqa: E402
from qpn.scripts.checkpoints.checkpoint_reference import decode_fp8, decode_nvfp4  # noqa: E402

SPEC = tiny_hybrid.TinyHybridSpec()
HUB = "model.language_model."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "ckpt"
    summary = mc.make_checkpoint(out, seed=0)
    return out, summary


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_layout_is_modelopt_mixed_precision(ckpt):
    out, summary = ckpt
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "config.json", "hf_quant_config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["model_type"] == "qwen3_5_text"
    assert "quantization_config" not in config  # declared only in hf_quant_config.json by default
    assert config["layer_types"].count("linear_attention") == 3 * config["layer_types"].count("full_attention")
    assert config["linear_key_head_dim"] in (64, 128) and config["linear_value_head_dim"] in (64, 128)
    assert config["mtp_num_hidden_layers"] == 1
    q = json.loads((out / "hf_quant_config.json").read_text())
    assert q["producer"]["name"] == "modelopt"
    assert q["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert q["quantization"]["kv_cache_quant_algo"] == "FP8"
    layers = q["quantization"]["quantized_layers"]
    fp8 = {k for k, v in layers.items() if v == {"quant_algo": "FP8"}}
    nvfp4 = {k for k, v in layers.items() if v == {"quant_algo": "NVFP4", "group_size": 16}}
    assert fp8 | nvfp4 == set(layers)
    n_gdn, n_attn = config["layer_types"].count("linear_attention"), config["layer_types"].count("full_attention")
    assert len(fp8) == 3 * n_gdn + 4 * n_attn  # in_proj_qkv, in_proj_z, out_proj | q, k, v, o
    assert len(nvfp4) == 3 * config["num_hidden_layers"] + 1  # gate, up, down per layer + lm_head
    assert "lm_head" in nvfp4
    assert all(k.startswith(HUB) for k in layers if k != "lm_head")
    assert summary["quantized_modules"] == {"fp8": len(fp8), "nvfp4": len(nvfp4)}


def test_encodings_decode_close_to_the_float_weights(ckpt):
    out, _ = ckpt
    t = _tensors(out)
    master = tiny_hybrid.float_weights(SPEC, seed=0)
    layers = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    for module, entry in layers.items():
        w = master[("model." + module[len(HUB):] if module.startswith(HUB) else module) + ".weight"]
        if entry["quant_algo"] == "FP8":
            assert t[f"{module}.weight"].dtype == torch.float8_e4m3fn
            assert t[f"{module}.weight_scale"].shape == () and t[f"{module}.weight_scale"].dtype == torch.float32
            deq = decode_fp8(t[f"{module}.weight"], t[f"{module}.weight_scale"])
            # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 relative, plus the subnormal floor.
            bound = w.abs() * 2 ** -4 + float(t[f"{module}.weight_scale"]) * 2 ** -9
        else:
            assert t[f"{module}.weight"].dtype == torch.uint8
            assert t[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
            assert t[f"{module}.weight_scale"].shape == (w.shape[0], w.shape[1] // 16)
            deq = decode_nvfp4(t[f"{module}.weight"], t[f"{module}.weight_scale"], t[f"{module}.weight_scale_2"])
            # e2m1: half a step of the largest gap (6 - 4) of each group's scale, plus e4m3 scale rounding.
            gscale = (t[f"{module}.weight_scale"].float() * t[f"{module}.weight_scale_2"]).repeat_interleave(16, 1)
            bound = gscale * 1.0 + w.abs() * 2 ** -3
        assert t[f"{module}.input_scale"] > 0
        assert bool(((deq - w).abs() <= bound + 1e-12).all()), module


def test_fused_shards_scales_as_real_checkpoints_have_them(ckpt):
    out, _ = ckpt
    t = _tensors(out)
    for i, kind in enumerate(SPEC.layer_types()):
        p = f"{HUB}layers.{i}"
        if kind == "full_attention":
            s = {float(t[f"{p}.self_attn.{x}_proj.weight_scale"]) for x in "qkv"}
            assert len(s) == 3, "q, k and v must carry different FP8 scales"
            assert t[f"{p}.self_attn.k_proj.k_scale"] > 0 and t[f"{p}.self_attn.v_proj.v_scale"] > 0
        else:
            assert float(t[f"{p}.linear_attn.in_proj_qkv.weight_scale"]) != float(t[f"{p}.linear_attn.in_proj_z.weight_scale"])
        # gate and up share one NVFP4 global scale (ModelOpt unifies it for fused shards)
        assert torch.equal(t[f"{p}.mlp.gate_proj.weight_scale_2"], t[f"{p}.mlp.up_proj.weight_scale_2"])
    assert all(t[k].dtype == torch.bfloat16 for k in t if k.startswith("mtp."))


def test_generation_is_deterministic(ckpt, tmp_path):
    out, _ = ckpt
    again = tmp_path / "again"
    mc.make_checkpoint(again, seed=0)
    for name in ("model.safetensors", "tokenizer.json", "hf_quant_config.json", "config.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    other = tmp_path / "other"
    mc.make_checkpoint(other, seed=1)
    assert (other / "model.safetensors").read_bytes() != (out / "model.safetensors").read_bytes()


def test_tokenizer_and_chat_template(ckpt):
    from transformers import AutoTokenizer

    out, _ = ckpt
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) <= SPEC.vocab_size
    for special in tiny_tokenizer.CONTROL_TOKENS + tiny_tokenizer.MARKUP_TOKENS:
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [special], special
    assert tok.eos_token == "<|im_end|>"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = msgs + [
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "20 C"}]
    text = tok.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert '<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n20 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("kind", sorted(mc.MALFORMED))
def test_malformed_variants_carry_their_defect(tmp_path, kind):
    out = tmp_path / kind
    mc.make_checkpoint(out, seed=0, malformed=kind)
    t = _tensors(out)
    bad = mc.MALFORMED[kind]
    layers = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    if kind == "missing-scale":
        assert bad.tensor not in t and bad.tensor.replace("k_proj", "q_proj") in t
    elif kind == "wrong-scale-shape":
        assert t[bad.tensor].shape[1] * 32 == t[bad.tensor.replace("weight_scale", "weight")].shape[1] * 2
    elif kind == "nan-scale":
        assert torch.isnan(t[bad.tensor]).all()
    elif kind == "inf-scale":
        assert torch.isinf(t[bad.tensor]).all()
    elif kind == "unknown-algo":
        assert layers[bad.tensor]["quant_algo"] == "NVFP3"
    elif kind == "k-not-multiple":
        assert json.loads((out / "config.json").read_text())["intermediate_size"] % 16 != 0
        assert t[bad.tensor].shape[1] * 2 % 16 != 0


def test_failure_leaves_no_half_written_checkpoint(tmp_path, monkeypatch):
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="simulated"):
        mc.make_checkpoint(tmp_path / "ckpt", seed=0)
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_an_existing_folder_and_an_unknown_kind(tmp_path, capsys):
    (tmp_path / "exists").mkdir()
    assert mc.main([str(tmp_path / "exists")]) == 2
    assert "exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mc.main([str(tmp_path / "x"), "--malformed", "no-such-kind"])


@pytest.mark.fast
def test_checkpoint_folder_publishes_whole_or_nothing(tmp_path):
    """Every generator writes through checkpoint_folder: a failure leaves neither the checkpoint
    nor a partial folder; success renames one readable folder into place."""
    import os

    from qpn.scripts.checkpoints.make_checkpoint import checkpoint_folder

    out = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with checkpoint_folder(out) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("generator failed half way")
    assert list(tmp_path.iterdir()) == []
    with checkpoint_folder(out) as tmp:
        (tmp / "config.json").write_text("{}")
        assert not out.exists()  # nothing visible before the block ends
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert oct(os.stat(out).st_mode & 0o777) == "0o755"
    assert oct(os.stat(out / "config.json").st_mode & 0o777) == "0o644"
