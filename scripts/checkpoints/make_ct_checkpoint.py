"""Write a small compressed-tensors checkpoint (the llm-compressor layout) of the same tiny
Qwen3.5 hybrid the ModelOpt generator writes: NVFP4 MLP and lm_head, FP8 attention projections.

    python -m qpn.scripts.checkpoints.make_ct_checkpoint OUT_DIR [--seed S]

Same float model, tokenizer and calibration pass as qpn.scripts.checkpoints.make_checkpoint (imported, not
copied); only the encoding and the declaration follow compressed-tensors
(qpn.fork_patches.quant.conventions.COMPRESSED_TENSORS):

* NVFP4 (``nvfp4-pack-quantized``, the library's NVFP4 preset: W4A4, group 16):
  ``mlp.gate_proj/up_proj/down_proj`` and ``lm_head``. ``weight_global_scale`` = 448 * 6 / amax
  (the divisor; gate and up share one, as llm-compressor unifies the global scales of fused
  linears), per group scale = e4m3(group amax / 6 * global) (0 -> 0.125, the library's e4m3
  epsilon), codes = e2m1(w / (scale / global)), packed two per byte (even element low nibble);
  ``input_global_scale`` = 448 * 6 / input amax.
* FP8 (``float-quantized``) in two layouts, so both are served:
  ``self_attn.q_proj/k_proj/v_proj/o_proj`` per tensor (the library's FP8 preset: ``weight_scale``
  [1] = amax / 448, static ``input_scale``; q, k and v keep their own scales);
  ``linear_attn.in_proj_qkv/in_proj_z/out_proj`` per output channel (FP8_DYNAMIC: ``weight_scale``
  [N, 1], dynamic per-token activations, so no input scale).
* BF16: embeddings, norms, the GDN convolution, ``in_proj_b/in_proj_a``, the MTP head.
* ``kv_cache_scheme`` FP8 per tensor with ``self_attn.k_scale`` / ``v_scale`` (amax / 448) on the
  attention module, as llm-compressor writes them.

``--moe`` writes the MoE family instead (``Qwen3_5MoeForCausalLM``): the float model, tokenizer
and calibration of qpn.scripts.checkpoints.make_moe_checkpoint (imported), encoded the same way:
every routed expert's ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and the shared expert in
NVFP4 (gate and up of each expert share one global scale, as llm-compressor unifies them), the
router and the shared-expert gate in BF16, attention and lm_head as above. vLLM fuses the
experts into ``w13_weight_packed`` / ``w2_weight_packed`` stacks (the QPN MoE method, handed out
by the registered QPN config: fork_patches/quant/qpn_config.py).
``--fp8-experts 5,6:tensor`` puts the routed experts of those layers in FP8 instead (per channel,
the FP8_DYNAMIC preset, unless ``:tensor``; named in the FP8 config groups' targets, the other
layers' experts in NVFP4's): one checkpoint carries both expert formats, as a recipe that keeps
some layers at 8 bits writes it.

Every code and scale is byte-identical to what compressed-tensors 0.17's own quantizer
(calculate_qparams, generate_gparam) and compressors (NVFP4PackedCompressor,
FloatQuantizationCompressor) make from the same float32 weights (tests/test_ct_checkpoint.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from qpn.fork_patches.quant.conventions import COMPRESSED_TENSORS, E2M1_MAX, E4M3_MAX, GROUP_SIZE
from qpn.kernels import codecs
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.scripts.checkpoints import make_checkpoint, tiny_hybrid, tiny_tokenizer

CT_VERSION_FORM = "0.17.0"  # the compressed-tensors release whose layout this mirrors
E4M3_EPS = 0.125  # what the library puts in place of a zero e4m3 scale

# Module name patterns of each config group, written as regexes that match the checkpoint's hub
# names (model.language_model.layers.N...) and vLLM's names (model.layers.N...) alike; anchored
# at the trunk so that the MTP head (mtp.layers.N...) stays BF16.
_TRUNK = r"re:^model\.(language_model\.)?layers\.\d+\."
NVFP4_TARGETS = [_TRUNK + r"mlp\.(gate|up|down)_proj$", "lm_head"]
FP8_TENSOR_TARGETS = [_TRUNK + r"self_attn\.(q|k|v|o)_proj$"]
FP8_CHANNEL_TARGETS = [_TRUNK + r"linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$"]
# the MoE family: routed experts and the shared expert in place of the dense MLP
NVFP4_MOE_TARGETS = [_TRUNK + r"mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj$", "lm_head"]
_EXPERTS = r"mlp\.experts\.\d+\.(gate|up|down)_proj$"
FP8_EXPERT_LAYOUTS = ("tensor", "channel")


def expert_layer(module: str) -> int | None:
    """The decoder layer of a routed expert's module name (None: not a routed expert)."""
    head, sep, _ = module.partition(".mlp.experts.")
    return int(head.rsplit(".", 1)[-1]) if sep and not head.startswith("mtp.") else None


def fp8_layout(module: str, fp8_experts: dict[int, str] | None = None) -> str:
    """The FP8 scale layout of an FP8 module: per channel for the GDN projections and for the
    routed experts of a layer ``fp8_experts`` ({layer: layout}) says so; per tensor otherwise."""
    layer = expert_layer(module)
    if layer is not None and fp8_experts and layer in fp8_experts:
        return fp8_experts[layer]
    return "channel" if ".linear_attn." in f".{module}" else "tensor"


def _layers(layers) -> str:
    return "(" + "|".join(str(n) for n in sorted(layers)) + r")\."


def moe_targets(fp8_experts: dict[int, str] | None) -> tuple[list[str], dict[str, list[str]]]:
    """(NVFP4 targets, {FP8 layout: extra FP8 targets}) of the MoE family: the routed experts of
    the layers in ``fp8_experts`` ({layer: 'tensor' | 'channel'}) in FP8, every other routed
    expert, the shared experts and lm_head in NVFP4. Without FP8 experts: NVFP4_MOE_TARGETS."""
    if not fp8_experts:
        return list(NVFP4_MOE_TARGETS), {}
    bad = {n: v for n, v in fp8_experts.items() if v not in FP8_EXPERT_LAYOUTS}
    if bad:
        raise ValueError(f"FP8 expert layout(s) {bad}: choose from {FP8_EXPERT_LAYOUTS}")
    trunk = r"re:^model\.(language_model\.)?layers\."
    nvfp4 = [trunk + r"(?!" + _layers(fp8_experts) + r")\d+\." + _EXPERTS,
             _TRUNK + r"mlp\.shared_expert\.(gate|up|down)_proj$", "lm_head"]
    fp8 = {layout: [trunk + _layers(n for n, v in fp8_experts.items() if v == layout) + _EXPERTS]
           for layout in FP8_EXPERT_LAYOUTS if layout in fp8_experts.values()}
    return nvfp4, fp8


# ---------------------------------------------------------------------------------- encoding
def nvfp4_global_scale(amax: float) -> torch.Tensor:
    """weight_global_scale (the divisor) for a tensor whose largest |value| is ``amax``."""
    a = torch.tensor(amax, dtype=torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    g = (E4M3_MAX * E2M1_MAX) / a
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def encode_nvfp4(w: torch.Tensor, global_amax: float | None = None) -> dict[str, torch.Tensor]:
    """float [N, K] -> {weight_packed, weight_scale, weight_global_scale} in the library's order of
    operations (scale = group amax / 6 * global, cast to e4m3; value = w / (scale / global))."""
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"NVFP4 needs K to be a multiple of {GROUP_SIZE}, got K={k}")
    wf = w.detach().float()
    g = nvfp4_global_scale(float(wf.abs().max()) if global_amax is None else global_amax)
    groups = wf.view(n, k // GROUP_SIZE, GROUP_SIZE)
    gmax = torch.maximum(groups.amax(-1).clamp(min=0), (-groups.amin(-1)).clamp(min=0))
    scale = (g * (gmax / E2M1_MAX)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    scale = torch.where(scale == 0, torch.tensor(E4M3_EPS), scale)
    x = (groups / (scale / g).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).view(n, k)
    # round half to even with the sign bit set for x < 0: a negative value that rounds to 0 keeps
    # it (code 8), -0.0 does not (code 0), exactly as the library's cast_to_fp4 + pack does
    codes = codecs.round_to_e2m1_codes(x)
    names = COMPRESSED_TENSORS.names("nvfp4")
    return {names.codes: nvfp4_codec.pack_codes(codes), names.group_scales: scale.to(torch.float8_e4m3fn),
            names.global_scale: g}


def encode_fp8(w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """float [N, K] -> {weight (e4m3), weight_scale ([1] per tensor, [N, 1] per channel)}."""
    wf = w.detach().float()
    if layout == "channel":
        amax = torch.maximum(wf.amax(1, keepdim=True).clamp(min=0), (-wf.amin(1, keepdim=True)).clamp(min=0))
    else:
        amax = torch.maximum(wf.max().clamp(min=0), (-wf.min()).clamp(min=0)).reshape(1)
    scale = amax / E4M3_MAX
    # the library's epsilon for a float32 scale replaces a zero scale
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(torch.float32).eps), scale)
    q = (wf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return {COMPRESSED_TENSORS.names("fp8").codes: q, COMPRESSED_TENSORS.names("fp8").scale: scale}


# ------------------------------------------------------------------------------ declaration
def _args(bits: int, strategy: str, dynamic, group_size=None, observer="minmax", fp4: bool = False) -> dict:
    d = {"num_bits": bits, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
         "group_size": group_size, "block_structure": None, "actorder": None, "observer": observer,
         "observer_kwargs": {}}
    if fp4:
        d.update(scale_dtype="torch.float8_e4m3fn", zp_dtype="torch.float8_e4m3fn")
    return d


def quantization_config(moe: bool = False, fp8_experts: dict[int, str] | None = None) -> dict:
    """config.json ``quantization_config`` as llm-compressor writes it for this recipe (``moe``:
    the MoE family's NVFP4 targets; ``fp8_experts``: the routed experts of those layers in the FP8
    groups, per tensor or per channel, as a recipe naming them in the FP8 schemes' targets would)."""
    nvfp4, fp8 = moe_targets(fp8_experts) if moe else (list(NVFP4_TARGETS), {})
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "quantization_status": "compressed",
        "version": CT_VERSION_FORM,
        "global_compression_ratio": None,
        "config_groups": {
            "group_0": {"targets": nvfp4,
                        "format": "nvfp4-pack-quantized",
                        "weights": _args(4, "tensor_group", False, GROUP_SIZE, fp4=True),
                        "input_activations": _args(4, "tensor_group", "local", GROUP_SIZE,
                                                   observer="static_minmax", fp4=True),
                        "output_activations": None},
            "group_1": {"targets": list(FP8_TENSOR_TARGETS) + fp8.get("tensor", []), "format": "float-quantized",
                        "weights": _args(8, "tensor", False),
                        "input_activations": _args(8, "tensor", False, observer="static_minmax"),
                        "output_activations": None},
            "group_2": {"targets": list(FP8_CHANNEL_TARGETS) + fp8.get("channel", []), "format": "float-quantized",
                        "weights": _args(8, "channel", False),
                        "input_activations": _args(8, "token", True, observer=None),
                        "output_activations": None},
        },
        "ignore": [],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                            "dynamic": False, "group_size": None, "block_structure": None,
                            "actorder": None, "observer": "minmax", "observer_kwargs": {}},
        "sparsity_config": {},
        "transform_config": {},
    }


def export_tensors(weights: dict[str, torch.Tensor], quantized: dict[str, str],
                   input_amax: dict[str, float], kv_amax: dict[str, float],
                   shared: dict[str, float] | None = None,
                   fp8_experts: dict[int, str] | None = None) -> dict[str, torch.Tensor]:
    """``shared``: {module: the global amax it shares with its fused siblings} (default: the
    dense MLP's gate and up); ``fp8_experts``: {layer: FP8 layout} of FP8 routed experts."""
    shared = make_checkpoint.shared_global_amax(weights) if shared is None else shared
    out: dict[str, torch.Tensor] = {}
    for key, w in weights.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        region = quantized.get(module) if module else None
        if region is None:
            out[make_checkpoint.hub_name(key)] = w.to(torch.bfloat16).contiguous()
            continue
        m = make_checkpoint.hub_name(module)
        if region == "fp8":
            layout = fp8_layout(module, fp8_experts)
            for name, t in encode_fp8(w, layout).items():
                out[f"{m}.{name}"] = t.contiguous()
            if layout == "tensor":  # static activations; per-channel FP8 runs dynamic ones
                out[f"{m}.{COMPRESSED_TENSORS.names('fp8').input_scale}"] = torch.tensor(
                    [input_amax[module] / E4M3_MAX], dtype=torch.float32)
        else:
            for name, t in encode_nvfp4(w, shared.get(module)).items():
                out[f"{m}.{name}"] = t.contiguous()
            out[f"{m}.{COMPRESSED_TENSORS.names('nvfp4').input_scale}"] = nvfp4_global_scale(input_amax[module])
    for key, a in kv_amax.items():  # 'model.layers.N.self_attn.k' -> ...self_attn.k_scale
        attn, which = key.rsplit(".", 1)
        out[make_checkpoint.hub_name(f"{attn}.{which}_scale")] = torch.tensor([a / E4M3_MAX], dtype=torch.float32)
    return out


def make_ct_checkpoint(out_dir: str | os.PathLike, seed: int = 0,
                       spec: tiny_hybrid.TinyHybridSpec | None = None, moe: bool = False,
                       fp8_experts: dict[int, str] | None = None) -> dict:
    """Write the checkpoint to ``out_dir`` (which must not exist); returns a summary dict.
    ``moe``: the MoE family (make_moe_checkpoint's float model, NVFP4 experts); ``fp8_experts``
    ({layer: 'tensor' | 'channel'}, MoE only): those layers' routed experts in FP8 instead, every
    other layer's in NVFP4 (one checkpoint, both expert formats)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    out = Path(out_dir)
    fp8_experts = dict(fp8_experts or {})
    if fp8_experts and not moe:
        raise ValueError("FP8 experts need the MoE family (--moe)")
    moe_targets(fp8_experts)  # refuses an unknown layout before anything is written
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a new folder (the generator never overwrites)")
    from qpn.scripts.checkpoints import make_moe_checkpoint

    spec = spec or (make_moe_checkpoint.TinyMoeSpec() if moe else tiny_hybrid.TinyHybridSpec())
    with make_checkpoint.checkpoint_folder(out) as tmp:
        ids = tiny_tokenizer.write_tokenizer(tmp, spec.vocab_size, spec.max_position_embeddings)
        calib_ids = Tokenizer.from_file(str(tmp / "tokenizer.json")).encode(
            " ".join(tiny_tokenizer.CORPUS)).ids[:256]
        if moe:
            weights = make_moe_checkpoint.float_weights(spec, seed)
            quantized = make_moe_checkpoint.quantized_modules(weights, "nvfp4")
            layers = {expert_layer(m) for m in quantized} - {None}
            if set(fp8_experts) - layers:
                raise ValueError(f"FP8 expert layer(s) {sorted(set(fp8_experts) - layers)} are not MoE "
                                 f"layers of this model (0..{max(layers)})")
            quantized.update({m: "fp8" for m in quantized if expert_layer(m) in fp8_experts})
            input_amax, kv_amax = make_moe_checkpoint.calibrate(spec, weights, quantized, calib_ids)
            shared = make_moe_checkpoint.shared_global_amax(weights, quantized)
        else:
            weights = tiny_hybrid.float_weights(spec, seed)
            quantized = tiny_hybrid.quantized_modules(weights)
            input_amax, kv_amax = make_checkpoint.calibrate(spec, weights, sorted(quantized), calib_ids)
            shared = None
        tensors = export_tensors(weights, quantized, input_amax, kv_amax, shared, fp8_experts)
        config = spec.config_dict(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
        config["quantization_config"] = quantization_config(moe, fp8_experts)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"], "do_sample": False}, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        summary = {
            "out_dir": str(out), "seed": seed, "convention": COMPRESSED_TENSORS.name,
            "architecture": config["architectures"][0], "layer_types": spec.layer_types(),
            "quantized_modules": {r: sum(1 for v in quantized.values() if v == r) for r in ("fp8", "nvfp4")},
            "tensors": len(tensors), "bytes": (tmp / "model.safetensors").stat().st_size,
            "fp8_experts": {str(n): v for n, v in sorted(fp8_experts.items())},
        }
    return summary


def parse_fp8_experts(text: str) -> dict[int, str]:
    """'5,6:tensor' -> {5: 'channel', 6: 'tensor'} (a layer without a layout: per channel)."""
    out: dict[int, str] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        layer, _, layout = item.partition(":")
        if not layer.strip().isdigit():
            raise ValueError(f"--fp8-experts entry {item!r}: expected LAYER or LAYER:LAYOUT")
        out[int(layer)] = layout.strip() or "channel"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qpn.scripts.checkpoints.make_ct_checkpoint",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder to create (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="seed of the float weights (default 0)")
    p.add_argument("--moe", action="store_true",
                   help="the Qwen3.5 MoE family (NVFP4 routed and shared experts) instead of the dense hybrid")
    p.add_argument("--fp8-experts", default="", metavar="LAYER[:LAYOUT],...",
                   help="with --moe: these layers' routed experts in FP8 (LAYOUT tensor or channel, default "
                        "channel, the FP8_DYNAMIC preset), the other layers' in NVFP4; e.g. 5,6:tensor")
    args = p.parse_args(argv)
    try:
        fp8_experts = parse_fp8_experts(args.fp8_experts)
        summary = make_ct_checkpoint(args.out_dir, seed=args.seed, moe=args.moe, fp8_experts=fp8_experts)
    except (FileExistsError, ValueError) as e:
        print(f"make_ct_checkpoint: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
