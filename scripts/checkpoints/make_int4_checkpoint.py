"""Write the tiny Qwen3.5 hybrid as an INT4 W4A16 checkpoint: AutoAWQ (GEMM) or compressed-tensors
pack-quantized.

    python -m qpn.scripts.checkpoints.make_int4_checkpoint OUT_DIR --convention awq|compressed-tensors
        [--seed S] [--group-size 32|64|128] [--symmetric] [--malformed KIND]

Same float model and tokenizer as qpn.scripts.checkpoints.make_checkpoint (imported, not copied);
W4A16 reads no activation scales, so there is no calibration pass. Every linear the mixed plan
quantizes (the attention and GDN projections, the MLP) is quantized to INT4 by
qpn.kernels.family_int4.quantize (min/max per group of ``--group-size`` inputs, the float16
scale rounded first); ``lm_head``, the embeddings, norms, the GDN convolution and
``in_proj_b/in_proj_a`` and the MTP head stay BF16 (AutoAWQ never quantizes lm_head;
llm-compressor's W4A16 recipes ignore it). The canonical source (codes, float16 scales, uint4
zero points) is written in the convention's layout (qpn.fork_patches.conventions.AWQ /
CT_PACK_QUANTIZED name the tensors and their shapes):

* ``--convention awq`` (AutoAWQ GEMM, asymmetric): ``qweight`` int32 [K, N/8] and ``qzeros``
  int32 [K/g, N/8], eight output columns per word in AutoAWQ's order (nibble j holds column
  8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]); ``scales`` float16 [K/g, N]; config.json
  ``quantization_config`` {quant_method awq, bits 4, group_size, zero_point true, version gemm,
  modules_to_not_convert}.
* ``--convention compressed-tensors`` (pack-quantized; ``--symmetric`` for the W4A16 preset,
  else W4A16_ASYM): ``weight_packed`` int32 [N, K/8] (nibble i of word j = input 8j + i, the
  signed code + 8), ``weight_scale`` float16 [N, K/g], ``weight_zero_point`` int32 [N/8, K/g]
  packed along N (asymmetric only), ``weight_shape`` int64 [N, K]; one config group targeting
  ``Linear`` with ``ignore`` for what stays BF16.

Byte for byte what vLLM 0.32's AutoAWQ packer (quant_utils.awq_pack) and compressed-tensors'
PackedQuantizationCompressor write from the same codes, scales and zero points, and decoded
alike by vLLM's AWQ dequantization (tests/test_int4_conventions.py).

``--malformed KIND`` writes a broken variant (MALFORMED) the launcher's pre-boot check
(serve_preflight.check_checkpoint_tensors) must refuse naming the module. Until formats.INT4 is
served, QPN does not claim these checkpoints: they are for the conventions, the pre-boot check, the
QPN4 method and the kernels' tests.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from qpn.fork_patches.conventions import AWQ, CT_PACK_QUANTIZED, INT4_CONVENTIONS
from qpn.kernels import family_int4, formats
from qpn.scripts.checkpoints import make_checkpoint, tiny_hybrid, tiny_tokenizer

AUTOAWQ_VERSION_FORM = "0.2.9"  # the AutoAWQ release whose GEMM layout this mirrors
CT_VERSION_FORM = "0.17.0"
DEFAULT_GROUP_SIZE = 32          # K = 128 / 256 in the tiny model: several groups per row
# What stays BF16 besides lm_head: AutoAWQ's skip list (substrings, as vLLM matches it) and the
# compressed-tensors ignore list (checkpoint names and re: patterns).
AWQ_NOT_CONVERTED = ["linear_attn.in_proj_b", "linear_attn.in_proj_a", "mtp."]
CT_IGNORE = ["lm_head", r"re:.*linear_attn\.in_proj_[ba]$", r"re:^mtp\."]


@dataclass(frozen=True)
class Malformed:
    kind: str
    tensor: str         # the broken checkpoint tensor (role name resolved per convention)
    module: str         # the checkpoint module the pre-boot refusal must name
    problem: str        # words the refusal must contain
    conventions: tuple[str, ...] = ("awq", "compressed-tensors")


_DOWN = "model.language_model.layers.0.mlp.down_proj"
_QPROJ = "model.language_model.layers.3.self_attn.q_proj"
MALFORMED: dict[str, Malformed] = {m.kind: m for m in (
    Malformed("missing-zeros", "zero_points", _DOWN, "needs tensor"),
    Malformed("missing-scales", "group_scales", _QPROJ, "needs tensor"),
    Malformed("wrong-shape", "group_scales", "model.language_model.layers.1.mlp.up_proj", "has shape"),
    Malformed("wrong-dtype", "codes", "model.language_model.layers.2.linear_attn.out_proj", "is I64"),
    Malformed("truncated", "codes", "", "truncated"),   # the module: the last tensor of the file
    Malformed("act-order", "g_idx", _DOWN, "activation-ordered", conventions=("compressed-tensors",)),
)}


def int4_modules(weights: dict[str, torch.Tensor]) -> list[str]:
    """The float model's modules (checkpoint names before the hub prefix) stored in INT4: every
    linear the mixed plan quantizes, less lm_head."""
    return sorted(m for m in tiny_hybrid.quantized_modules(weights) if m != "lm_head")


# --------------------------------------------------------------------------------- packing
def pack_nibbles(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Integer values 0..15 -> int32 words of eight along ``dim`` (padded with 0 to a multiple of
    8): nibble j of word c holds element 8c + order[j]."""
    v = values.to(torch.int64)
    if dim == 0:
        return pack_nibbles(v.t(), 1, order).t().contiguous()
    rows, cols = v.shape
    pad = -cols % 8
    if pad:
        v = torch.cat([v, torch.zeros(rows, pad, dtype=torch.int64)], 1)
    v = v.view(rows, -1, 8)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for j, src in enumerate(order):
        word |= v[:, :, src] << (4 * j)
    return (word - ((word >> 31) << 32)).to(torch.int32).contiguous()  # the same 32 bits, signed


def to_awq(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """Canonical INT4 (codes uint8 [N, K/2], float16 scales [N, K/g], zero points uint8 [N, K/g])
    -> AutoAWQ GEMM {qweight, qzeros, scales}."""
    q = family_int4.unpack_codes(codes)
    order = AWQ.layout.nibble_order
    n = AWQ.names
    return {n.codes: pack_nibbles(q.t(), 1, order), n.zero_points: pack_nibbles(zeros.t(), 1, order),
            n.group_scales: scales.t().contiguous()}


def to_pack_quantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Canonical INT4 -> compressed-tensors pack-quantized {weight_packed, weight_scale,
    weight_shape[, weight_zero_point]} (the unsigned code is the library's signed value + 8)."""
    q = family_int4.unpack_codes(codes)
    n = CT_PACK_QUANTIZED.names
    out = {n.codes: pack_nibbles(q, 1), n.group_scales: scales.contiguous(),
           n.shape: torch.tensor(list(q.shape), dtype=torch.int64)}
    if zeros is not None:
        out[n.zero_points] = pack_nibbles(zeros, 0)
    return out


def encode(w: torch.Tensor, convention: str, group_size: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """float [N, K] -> the convention's tensors of one module (local names)."""
    src = family_int4.quantize(w, group_size, symmetric=symmetric)
    if convention == AWQ.name:
        return to_awq(*src)
    return to_pack_quantized(src[0], src[1], None if symmetric else src[2])


# ------------------------------------------------------------------------------ declaration
def quantization_config(convention: str, group_size: int, symmetric: bool, act_order: bool = False) -> dict:
    """config.json ``quantization_config`` as AutoAWQ / llm-compressor write it for this model."""
    if convention == AWQ.name:
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": list(AWQ_NOT_CONVERTED)}
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": group_size, "dynamic": False, "block_structure": None,
               "actorder": "group" if act_order else None, "observer": "minmax", "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "version": CT_VERSION_FORM,
        "global_compression_ratio": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": list(CT_IGNORE),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
    }


def export_tensors(weights: dict[str, torch.Tensor], convention: str, group_size: int,
                   symmetric: bool) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under hub names: the INT4 modules in the convention's layout, the rest BF16."""
    quantized = set(int4_modules(weights))
    out: dict[str, torch.Tensor] = {}
    for key, w in weights.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module not in quantized:
            out[make_checkpoint.hub_name(key)] = w.to(torch.bfloat16).contiguous()
            continue
        m = make_checkpoint.hub_name(module)
        for name, t in encode(w, convention, group_size, symmetric).items():
            out[f"{m}.{name}"] = t
    return out


def _break(kind: str, convention: str, tensors: dict[str, torch.Tensor], group_size: int) -> str | None:
    """Apply a malformed variant to the tensors (all but 'truncated', which cuts the file after it
    is written); returns the tensor broken."""
    bad = MALFORMED[kind]
    names = INT4_CONVENTIONS[convention].names
    if kind == "truncated":
        return None
    name = f"{bad.module}.{getattr(names, bad.tensor)}"
    if kind.startswith("missing-"):
        del tensors[name]
    elif kind == "wrong-shape":  # one scale per 2g inputs: half the groups
        s = tensors[name]
        tensors[name] = (s[: s.shape[0] // 2] if convention == AWQ.name else s[:, : s.shape[1] // 2]).contiguous()
    elif kind == "wrong-dtype":
        tensors[name] = tensors[name].to(torch.int64)
    elif kind == "act-order":  # every module carries weight_g_idx (actorder group); one scatters its groups
        for key in [k for k in tensors if k.endswith(f".{names.shape}")]:
            k_in = int(tensors[key][1])
            gi = torch.arange(k_in, dtype=torch.int32) // group_size
            if key == f"{bad.module}.{names.shape}":
                gi = (torch.arange(k_in, dtype=torch.int32) % (k_in // group_size))
            tensors[key[: -len(names.shape)] + names.g_idx] = gi.contiguous()
    return name


def make_int4_checkpoint(out_dir: str | os.PathLike, convention: str = "awq", seed: int = 0,
                         group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = False,
                         malformed: str | None = None, spec: tiny_hybrid.TinyHybridSpec | None = None) -> dict:
    """Write the checkpoint to ``out_dir`` (which must not exist); returns a summary dict."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if convention not in (AWQ.name, CT_PACK_QUANTIZED.name):
        raise ValueError(f"unknown convention {convention!r}; choose awq or compressed-tensors")
    if group_size not in formats.INT4_GROUP_SIZES:
        raise ValueError(f"group size {group_size}: the INT4 family packs groups of "
                         f"{', '.join(map(str, formats.INT4_GROUP_SIZES))}")
    if symmetric and convention == AWQ.name:
        raise ValueError("AutoAWQ GEMM checkpoints carry zero points; --symmetric is for compressed-tensors")
    if malformed is not None and (malformed not in MALFORMED or convention not in MALFORMED[malformed].conventions):
        kinds = sorted(k for k, m in MALFORMED.items() if convention in m.conventions)
        raise ValueError(f"unknown --malformed kind {malformed!r} for {convention}; choose from {kinds}")
    if malformed == "missing-zeros" and symmetric:
        raise ValueError("--malformed missing-zeros needs zero points: drop --symmetric")
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a new folder (the generator never overwrites)")
    spec = spec or tiny_hybrid.TinyHybridSpec()
    with make_checkpoint.checkpoint_folder(out) as tmp:
        ids = tiny_tokenizer.write_tokenizer(tmp, spec.vocab_size, spec.max_position_embeddings)
        weights = tiny_hybrid.float_weights(spec, seed)
        tensors = export_tensors(weights, convention, group_size, symmetric)
        broken = _break(malformed, convention, tensors, group_size) if malformed else None
        config = spec.config_dict(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
        config["quantization_config"] = quantization_config(convention, group_size, symmetric,
                                                            act_order=malformed == "act-order")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"], "do_sample": False}, indent=2) + "\n")
        path = tmp / "model.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        if malformed == "truncated":  # a download cut short: the last tensor loses its tail
            os.truncate(path, path.stat().st_size - 64)
        summary = {
            "out_dir": str(out), "seed": seed, "convention": convention, "group_size": group_size,
            "symmetric": symmetric, "malformed": malformed, "broken_tensor": broken,
            "architecture": config["architectures"][0], "layer_types": spec.layer_types(),
            "int4_modules": len(int4_modules(weights)), "tensors": len(tensors),
            "bytes": path.stat().st_size,
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qpn.scripts.checkpoints.make_int4_checkpoint",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder to create (must not exist)")
    p.add_argument("--convention", choices=[AWQ.name, CT_PACK_QUANTIZED.name], default=AWQ.name,
                   help="checkpoint layout: AutoAWQ GEMM (default) or compressed-tensors pack-quantized")
    p.add_argument("--seed", type=int, default=0, help="seed of the float weights (default 0)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=formats.INT4_GROUP_SIZES,
                   help=f"inputs per scale and zero point (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--symmetric", action="store_true",
                   help="compressed-tensors only: symmetric weights (zero point 8, no weight_zero_point)")
    p.add_argument("--malformed", choices=sorted(MALFORMED), default=None,
                   help="write a broken variant the launcher's pre-boot check must refuse")
    args = p.parse_args(argv)
    try:
        summary = make_int4_checkpoint(args.out_dir, args.convention, seed=args.seed, group_size=args.group_size,
                                       symmetric=args.symmetric, malformed=args.malformed)
    except (FileExistsError, ValueError) as e:
        print(f"make_int4_checkpoint: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
