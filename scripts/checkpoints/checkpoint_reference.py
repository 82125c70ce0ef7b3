"""Independent float32 reference for a ModelOpt mixed NVFP4/FP8 checkpoint: dequantize every
quantized tensor with code that shares nothing with the QPN path, load the result into
HuggingFace ``transformers``' own implementation of the model, and compute teacher-forced
log-probabilities.

    python -m qpn.scripts.checkpoints.checkpoint_reference CKPT_DIR --token-ids 1,2,3,... [--out FILE]

Independence: the QPN path decodes packed buffers with qpn.kernels (formats, prepack,
reference) inside vLLM's model code. Here NVFP4 codes are decoded by ``compressed-tensors``'
``unpack_fp4_from_uint8`` (the llm-compressor project's NVFP4 codec), e4m3 scales and FP8
weights by torch's own float8_e4m3fn -> float32 conversion, and the network is transformers'
``Qwen3_5ForCausalLM`` in float32 (its reference PyTorch gated-delta-rule and causal-conv
fallbacks on CPU).

``--perturb swap-nibbles`` decodes NVFP4 with the two codes of each byte exchanged, and
``--perturb collapse-fp8-shards`` gives every fused FP8 shard the largest scale of its group
without requantizing the codes (what serving per-shard scales wrongly would do); both are
negative controls that a tolerance must reject.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

PERTURBATIONS = ("none", "swap-nibbles", "collapse-fp8-shards")
# Checkpoint modules that vLLM fuses, by shard suffix -> fused group key.
_FUSED_FP8 = {
    "self_attn.q_proj": "self_attn.qkv", "self_attn.k_proj": "self_attn.qkv",
    "self_attn.v_proj": "self_attn.qkv",
    "linear_attn.in_proj_qkv": "linear_attn.qkvz", "linear_attn.in_proj_z": "linear_attn.qkvz",
}


def decode_nvfp4(weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                 group_size: int = 16, swap_nibbles: bool = False) -> torch.Tensor:
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    n, half_k = weight_u8.shape
    k = 2 * half_k
    w = weight_u8
    if swap_nibbles:
        w = ((w & 0x0F) << 4) | (w >> 4)
    values = unpack_fp4_from_uint8(w, n, k, dtype=torch.float32)
    scales = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32).reshape(())
    return values * scales.repeat_interleave(group_size, dim=1)


def decode_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    s = weight_scale.to(torch.float32)
    return weight.to(torch.float32) * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))


def dequantized_state_dict(ckpt_dir: str | Path, perturb: str = "none") -> dict[str, torch.Tensor]:
    """float32 state dict of the checkpoint (MTP weights dropped: transformers has no MTP head)."""
    from safetensors.torch import load_file

    if perturb not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {perturb!r}; choose from {PERTURBATIONS}")
    ckpt = Path(ckpt_dir)
    quant = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    layers = quant["quantized_layers"]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    fp8_group_max: dict[str, float] = {}
    if perturb == "collapse-fp8-shards":
        for module, entry in layers.items():
            for suffix, group in _FUSED_FP8.items():
                if entry["quant_algo"].upper() == "FP8" and module.endswith(suffix):
                    key = module[: -len(suffix)] + group
                    s = float(tensors[f"{module}.weight_scale"])
                    fp8_group_max[key] = max(fp8_group_max.get(key, 0.0), s)
    out: dict[str, torch.Tensor] = {}
    for module, entry in layers.items():
        algo = entry["quant_algo"].upper()
        if algo in ("NVFP4", "W4A16_NVFP4"):
            out[f"{module}.weight"] = decode_nvfp4(
                tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"],
                tensors[f"{module}.weight_scale_2"], int(entry.get("group_size", 16)),
                swap_nibbles=(perturb == "swap-nibbles"))
        elif algo == "FP8":
            scale = tensors[f"{module}.weight_scale"]
            for suffix, group in _FUSED_FP8.items():
                key = module[: -len(suffix)] + group
                if module.endswith(suffix) and key in fp8_group_max:
                    scale = torch.tensor(fp8_group_max[key])
            out[f"{module}.weight"] = decode_fp8(tensors[f"{module}.weight"], scale)
        else:
            raise ValueError(f"{module}: quant_algo {algo} has no reference decoder here")
    quantized_keys = {f"{m}.{p}" for m in layers for p in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    for name, t in tensors.items():
        if name in quantized_keys or name.startswith("mtp.") or name.endswith(("k_scale", "v_scale")):
            continue
        out[name] = t.to(torch.float32)
    # Hub layout (model.language_model.*) -> transformers' Qwen3_5ForCausalLM layout (model.*).
    return {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
            for k, v in out.items()}


def e4m3_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn rounded toward zero and saturated at +-448: the conversion vLLM
    0.32's CPU attention applies when it writes an FP8 KV cache (its AVX-512 path truncates the
    mantissa instead of rounding to nearest; measured byte for byte against
    ``torch.ops._C.cpu_attn_reshape_and_cache`` by tests/test_kv_fp8_emulation.py). Rounding to
    nearest instead biases nothing but misses the engine's systematic shrink of every K and V
    element by up to one e4m3 step, which is why the served logprobs once fell outside a bound
    measured with a round-to-nearest reference."""
    x = x.float().clamp(-448.0, 448.0)
    nearest = x.to(torch.float8_e4m3fn)
    codes = nearest.view(torch.uint8).clone()
    # e4m3 codes are monotone in magnitude within a sign: one code down is one step toward zero.
    codes[nearest.float().abs() > x.abs()] -= 1
    return codes.view(torch.float8_e4m3fn)


def fp8_kv_emulation(model, ckpt_dir: str | Path):
    """Context manager: K (after RoPE) and V stored through e4m3 with the checkpoint's
    ``k_scale`` / ``v_scale`` (1.0 when absent) exactly as vLLM's CPU FP8 KV cache stores them
    (divide by the scale, saturate, round toward zero; see ``e4m3_toward_zero``)."""
    import contextlib
    import importlib

    from safetensors.torch import load_file

    # The module of the model at hand (Qwen3.5 dense, or its MoE sibling, which has its own copy
    # of apply_rotary_pos_emb): the one whose attention calls the function patched below.
    modeling_qwen3_5 = importlib.import_module(type(model).__module__)

    tensors = {}
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))

    def through_e4m3(t, scale):
        return (e4m3_toward_zero(t.float() / scale).float() * scale).to(t.dtype)

    layers = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]

    def scale_of(i, which):
        attn = f"model.language_model.layers.{i}.self_attn"
        # ModelOpt writes k_proj.k_scale; compressed-tensors writes k_scale on the attention module
        for key in (f"{attn}.{which}_proj.{which}_scale", f"{attn}.{which}_scale"):
            if key in tensors:
                return float(tensors[key])
        return 1.0

    @contextlib.contextmanager
    def active():
        rope = modeling_qwen3_5.apply_rotary_pos_emb
        order = []

        def rope_fp8(q, k, *a, **kw):
            q, k = rope(q, k, *a, **kw)
            i = layers[len(order) % len(layers)]
            order.append(i)
            return q, through_e4m3(k, scale_of(i, "k"))

        hooks = [model.model.layers[i].self_attn.v_proj.register_forward_hook(
            lambda mod, args, out, i=i: through_e4m3(out, scale_of(i, "v"))) for i in layers]
        modeling_qwen3_5.apply_rotary_pos_emb = rope_fp8
        try:
            yield
        finally:
            modeling_qwen3_5.apply_rotary_pos_emb = rope
            for h in hooks:
                h.remove()

    return active()


def load_reference_model(ckpt_dir: str | Path, perturb: str = "none"):
    return float_model(ckpt_dir, dequantized_state_dict(ckpt_dir, perturb))


def float_model(ckpt_dir: str | Path, state: dict[str, torch.Tensor]):
    """transformers' Qwen3_5ForCausalLM of the checkpoint's config, in float32, holding ``state``."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
    for key in ("architectures", "model_type", "dtype", "quantization_config", "transformers_version"):
        cfg.pop(key, None)
    config = Qwen3_5TextConfig(**cfg)
    model = Qwen3_5ForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"reference model and checkpoint disagree: missing {missing}, unexpected {unexpected}")
    return model


@torch.no_grad()
def teacher_forced_logprobs(model, token_ids: list[int]) -> dict:
    """Per position p >= 1: log P(token_ids[p] | token_ids[:p]), plus the top-2 margin."""
    logits = model(torch.tensor([token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(token_ids[1:])
    chosen = logp[:-1].gather(1, targets.unsqueeze(1)).squeeze(1)
    top2 = logp[:-1].topk(2, dim=-1)
    return {
        "token_logprobs": [float(v) for v in chosen],
        "argmax": [int(i) for i in top2.indices[:, 0]],
        "top2_margin": [float(a - b) for a, b in zip(top2.values[:, 0], top2.values[:, 1])],
    }


def reference_variants(ckpt_dir: str | Path, token_ids: list[int], variants: list[str],
                       kv_cache: str = "auto", load_model=None,
                       perturbations: tuple[str, ...] = PERTURBATIONS) -> dict[str, dict]:
    """Several references in one process. A variant is 'float32', 'bfloat16' or a perturbation
    name (computed in float32). ``load_model(ckpt_dir, perturb)`` (default: this ModelOpt
    reader) and its ``perturbations`` let another checkpoint convention reuse the runner."""
    import contextlib

    load_model = load_model or load_reference_model
    out = {}
    for variant in variants:
        perturb = variant if variant in perturbations else "none"
        dtype = variant if variant in ("float32", "bfloat16") else "float32"
        model = load_model(ckpt_dir, perturb).to(getattr(torch, dtype))
        ctx = fp8_kv_emulation(model, ckpt_dir) if kv_cache == "fp8_e4m3" else contextlib.nullcontext()
        with ctx:
            out[variant] = teacher_forced_logprobs(model, token_ids)
    return out


def _token_ids(text: str, prog: str) -> list[int] | None:
    """The prompt's token ids from --token-ids, or None (the error printed) when fewer than two."""
    ids = [int(t) for t in text.split(",") if t.strip()]
    if len(ids) < 2:
        print(f"{prog}: need at least two token ids", file=sys.stderr)
        return None
    return ids


def _emit(result: dict, out: str | None) -> int:
    """Write the JSON result to --out, or print it."""
    text = json.dumps(result)
    if out:
        Path(out).write_text(text)
    else:
        print(text)
    return 0


def variants_main(prog: str, doc: str, perturbations: tuple[str, ...], run, argv: list[str] | None = None) -> int:
    """The command line of a convention's reference (ct_reference, int4_reference): prompt token
    ids and variants in, the JSON of ``run(ckpt_dir, ids, variants, kv_cache)`` out."""
    p = argparse.ArgumentParser(prog=f"python -m qpn.scripts.checkpoints.{prog}", description=doc.split("\n\n")[0])
    p.add_argument("ckpt_dir")
    p.add_argument("--token-ids", required=True, help="comma-separated prompt token ids")
    p.add_argument("--variants", default="float32",
                   help=f"comma-separated list of float32, bfloat16 and {', '.join(perturbations[1:])}")
    p.add_argument("--kv-cache", choices=("auto", "fp8_e4m3"), default="auto")
    p.add_argument("--out", help="write the JSON result here (default: stdout)")
    args = p.parse_args(argv)
    ids = _token_ids(args.token_ids, prog)
    if ids is None:
        return 2
    torch.manual_seed(0)
    try:
        result = run(args.ckpt_dir, ids, [v for v in args.variants.split(",") if v], args.kv_cache)
    except ValueError as e:  # a checkpoint the reference cannot decode, named by the reference
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return _emit(result, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qpn.scripts.checkpoints.checkpoint_reference",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt_dir")
    p.add_argument("--token-ids", required=True, help="comma-separated prompt token ids")
    p.add_argument("--perturb", choices=PERTURBATIONS, default="none")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16 measures the rounding floor of a bf16 engine")
    p.add_argument("--kv-cache", choices=("auto", "fp8_e4m3"), default="auto",
                   help="fp8_e4m3 stores K and V through e4m3 as the cpu engine's FP8 KV cache does")
    p.add_argument("--variants", help="comma-separated list of float32, bfloat16 and perturbation names; "
                   "writes {variant: result} (overrides --perturb and --dtype)")
    p.add_argument("--out", help="write the JSON result here (default: stdout)")
    args = p.parse_args(argv)
    ids = _token_ids(args.token_ids, "checkpoint_reference")
    if ids is None:
        return 2
    torch.manual_seed(0)
    if args.variants:
        result = reference_variants(args.ckpt_dir, ids, [v for v in args.variants.split(",") if v],
                                    args.kv_cache)
    else:
        variant = args.perturb if args.perturb != "none" else args.dtype
        if args.perturb != "none" and args.dtype != "float32":
            p.error("--perturb runs in float32; do not combine it with --dtype")
        result = reference_variants(args.ckpt_dir, ids, [variant], args.kv_cache)[variant]
        result.update(ckpt_dir=str(args.ckpt_dir), perturb=args.perturb, dtype=args.dtype,
                      kv_cache=args.kv_cache, token_ids=ids)
    return _emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
