"""Write the tiny Qwen3.5 hybrid as an integer checkpoint, INT4 W4A16 or INT8 W8A16: AutoAWQ
(GEMM, 4-bit only), GPTQ or compressed-tensors pack-quantized.

    python -m qpn.scripts.checkpoints.make_int4_checkpoint OUT_DIR --convention awq|gptq|compressed-tensors
        [--bits 4|8] [--seed S] [--group-size 32|64|128|-1] [--symmetric]
        [--checkpoint-format gptq|gptq_v2] [--malformed KIND]

``--bits 8`` writes the same layouts with four 8-bit values per int32 word instead of eight
nibbles (GPTQModel's and compressed-tensors' 8-bit packing: value i of a word in bits 8i..8i+7),
codes from qpn.kernels.families.int8.codec.quantize, and group size -1 (one scale per output row:
GPTQ ``group_size: -1``, compressed-tensors ``strategy: channel``) besides 32 / 64 / 128.

Same float model and tokenizer as qpn.scripts.checkpoints.make_checkpoint (imported, not copied);
W4A16 reads no activation scales, so there is no calibration pass. Every linear the mixed plan
quantizes (the attention and GDN projections, the MLP) is quantized to INT4 by
qpn.kernels.families.int4.codec.quantize (min/max per group of ``--group-size`` inputs, the float16
scale rounded first); ``lm_head``, the embeddings, norms, the GDN convolution and
``in_proj_b/in_proj_a`` and the MTP head stay BF16 (AutoAWQ never quantizes lm_head;
llm-compressor's W4A16 recipes ignore it). The canonical source (codes, float16 scales, uint4
zero points) is written in the convention's layout (qpn.fork_patches.quant.conventions.AWQ / GPTQ /
COMPRESSED_TENSORS name the tensors and their shapes):

* ``--convention awq`` (AutoAWQ GEMM, asymmetric): ``qweight`` int32 [K, N/8] and ``qzeros``
  int32 [K/g, N/8], eight output columns per word in AutoAWQ's order (nibble j holds column
  8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]); ``scales`` float16 [K/g, N]; config.json
  ``quantization_config`` {quant_method awq, bits 4, group_size, zero_point true, version gemm,
  modules_to_not_convert}.
* ``--convention gptq`` (AutoGPTQ / GPTQModel, no act order; ``--symmetric`` for uint4b8, else
  asymmetric): ``qweight`` int32 [K/8, N], eight consecutive inputs per word (nibble i = input
  8r + i); ``qzeros`` int32 [K/g, N/8], eight output columns per word, holding the zero point less
  1 (``--checkpoint-format gptq``, the v1 format the exllama kernels read, so a symmetric
  checkpoint stores 7) or the zero point itself (``gptq_v2``); ``scales`` float16 [K/g, N];
  ``g_idx`` int32 [K] = k // g (the identity order: groups in checkpoint order); config.json
  ``quantization_config`` {quant_method gptq, bits 4, group_size, desc_act false, sym,
  checkpoint_format, lm_head false, dynamic: GPTQModel's negative rules for what stays BF16}. The
  v1 format cannot store zero point 0 (it would be -1): such a module is refused, naming it.
* ``--convention compressed-tensors`` (pack-quantized; ``--symmetric`` for the W4A16 preset,
  else W4A16_ASYM): ``weight_packed`` int32 [N, K/8] (nibble i of word j = input 8j + i, the
  signed code + 8), ``weight_scale`` float16 [N, K/g], ``weight_zero_point`` int32 [N/8, K/g]
  packed along N (asymmetric only), ``weight_shape`` int64 [N, K]; one config group targeting
  ``Linear`` with ``ignore`` for what stays BF16.

Byte for byte what vLLM 0.32's AutoAWQ and GPTQ packers (quant_utils.awq_pack, pack_rows,
pack_cols; the exllama kernel's own v1 zero points for a symmetric checkpoint) and
compressed-tensors' PackedQuantizationCompressor write from the same codes, scales and zero
points, and decoded alike by vLLM's AWQ and GPTQ dequantization (tests/test_int4_conventions.py).
QPN serves all three (formats.INT4); the float32 reference they are checked against end to end is
qpn.scripts.checkpoints.int4_reference (tests/test_e2e_int4.py).

``--malformed KIND`` writes a broken variant (MALFORMED) the launcher's pre-boot check
(serve_preflight.check_checkpoint_tensors) must refuse naming the module.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from qpn.fork_patches.quant.conventions import AWQ, COMPRESSED_TENSORS, GPTQ, INTEGER_CONVENTIONS
from qpn.kernels import formats
from qpn.kernels.families.int4 import codec as int4_codec
from qpn.scripts.checkpoints import make_checkpoint, tiny_hybrid, tiny_tokenizer

AUTOAWQ_VERSION_FORM = "0.2.9"  # the AutoAWQ release whose GEMM layout this mirrors
CT_VERSION_FORM = "0.17.0"
DEFAULT_GROUP_SIZE = 32          # K = 128 / 256 in the tiny model: several groups per row
# What stays BF16 besides lm_head: AutoAWQ's skip list (substrings, as vLLM matches it), GPTQModel's
# negative dynamic rules (re.match on the module name; the engine's fused in_proj_ba matches too) and
# the compressed-tensors ignore list (checkpoint names and re: patterns).
AWQ_NOT_CONVERTED = ["linear_attn.in_proj_b", "linear_attn.in_proj_a", "mtp."]
GPTQ_DYNAMIC = {r"-:.*linear_attn\.in_proj_[ab]": {}, r"-:(.*\.)?mtp\.": {}}
GPTQ_FORMATS = ("gptq", "gptq_v2")   # checkpoint_format: v1 stores zero - 1, v2 the zero
CT_IGNORE = ["lm_head", r"re:.*linear_attn\.in_proj_[ba]$", r"re:^mtp\."]


@dataclass(frozen=True)
class Malformed:
    kind: str
    tensor: str         # the broken checkpoint tensor (role name resolved per convention)
    module: str         # the checkpoint module the pre-boot refusal must name
    problem: str        # words the refusal must contain
    conventions: tuple[str, ...] = ("awq", "gptq", "compressed-tensors")


_DOWN = "model.language_model.layers.0.mlp.down_proj"
_QPROJ = "model.language_model.layers.3.self_attn.q_proj"
MALFORMED: dict[str, Malformed] = {m.kind: m for m in (
    Malformed("missing-zeros", "zero_points", _DOWN, "needs tensor"),
    Malformed("missing-scales", "group_scales", _QPROJ, "needs tensor"),
    Malformed("wrong-shape", "group_scales", "model.language_model.layers.1.mlp.up_proj", "has shape"),
    Malformed("wrong-dtype", "codes", "model.language_model.layers.2.linear_attn.out_proj", "is I64"),
    Malformed("truncated", "codes", "", "truncated"),   # the module: the last tensor of the file
    Malformed("act-order", "g_idx", _DOWN, "activation-ordered", conventions=("gptq", "compressed-tensors")),
)}


def int4_modules(weights: dict[str, torch.Tensor]) -> list[str]:
    """The float model's modules (checkpoint names before the hub prefix) stored in INT4: every
    linear the mixed plan quantizes, less lm_head."""
    return sorted(m for m in tiny_hybrid.quantized_modules(weights) if m != "lm_head")


# --------------------------------------------------------------------------------- packing
def pack_nibbles(values: torch.Tensor, dim: int, order=None, bits: int = 4) -> torch.Tensor:
    """Integer values of ``bits`` bits -> int32 words of p = 32 / bits along ``dim`` (padded with 0
    to a multiple of p): value j of word c holds element p*c + order[j] (default j), in bits
    bits*j .. bits*j + bits - 1."""
    p = 32 // bits
    order = tuple(range(p)) if order is None else order
    v = values.to(torch.int64)
    if dim == 0:
        return pack_nibbles(v.t(), 1, order, bits).t().contiguous()
    rows, cols = v.shape
    pad = -cols % p
    if pad:
        v = torch.cat([v, torch.zeros(rows, pad, dtype=torch.int64)], 1)
    v = v.view(rows, -1, p)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for j, src in enumerate(order):
        word |= v[:, :, src] << (bits * j)
    return (word - ((word >> 31) << 32)).to(torch.int32).contiguous()  # the same 32 bits, signed


def family_codec(bits: int):
    """The codec module of the integer family of ``bits``-bit codes (kernels/families/<family>/)."""
    family = formats.integer_family(bits)
    if family is None:
        raise ValueError(f"--bits {bits}: no integer family has {bits}-bit codes")
    return importlib.import_module(f"qpn.kernels.families.{family}.codec")


def code_values(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The canonical codes as one integer per input [N, K] (4-bit codes are stored two per byte)."""
    return int4_codec.unpack_codes(codes) if bits == 4 else codes.to(torch.int64)


def to_awq(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """Canonical INT4 (codes uint8 [N, K/2], float16 scales [N, K/g], zero points uint8 [N, K/g])
    -> AutoAWQ GEMM {qweight, qzeros, scales}."""
    q = int4_codec.unpack_codes(codes)
    order = AWQ.layout.order(8)
    n = AWQ.names(formats.INT4)
    return {n.codes: pack_nibbles(q.t(), 1, order), n.zero_points: pack_nibbles(zeros.t(), 1, order),
            n.group_scales: scales.t().contiguous()}


def to_gptq(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
            checkpoint_format: str = "gptq", module: str = "", bits: int = 4) -> dict[str, torch.Tensor]:
    """Canonical integer codes -> GPTQ {qweight, qzeros, scales, g_idx}; ``zeros`` None: symmetric
    (zero point 8 / 128, still stored in qzeros as GPTQ writers do). The v1 format (``gptq``)
    stores zero - 1, so a zero point 0 has no v1 word: ValueError naming ``module``."""
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r}; choose {' or '.join(GPTQ_FORMATS)}")
    q = code_values(codes, bits)                                   # [N, K]
    z = zeros if zeros is not None else torch.full(scales.shape, family_codec(bits).SYM_ZERO, dtype=torch.uint8)
    stored = z.to(torch.int64) - (1 if checkpoint_format == "gptq" else 0)
    if int(stored.min()) < 0:
        raise ValueError(f"{module or 'module'}: zero point 0 cannot be stored in GPTQ's v1 format (zero - 1 "
                         "= -1); write --checkpoint-format gptq_v2")
    n = GPTQ.names(formats.INT4)
    k = q.shape[1]
    g = k if group_size == -1 else group_size  # per channel: one group of every input
    return {n.codes: pack_nibbles(q.t(), 0, bits=bits), n.zero_points: pack_nibbles(stored.t(), 1, bits=bits),
            n.group_scales: scales.t().contiguous(),
            n.g_idx: (torch.arange(k, dtype=torch.int32) // g).contiguous()}


def to_pack_quantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      bits: int = 4) -> dict[str, torch.Tensor]:
    """Canonical integer codes -> compressed-tensors pack-quantized {weight_packed, weight_scale,
    weight_shape[, weight_zero_point]} (the unsigned code is the library's signed value + 8 / 128)."""
    q = code_values(codes, bits)
    n = COMPRESSED_TENSORS.names(formats.INT4)
    out = {n.codes: pack_nibbles(q, 1, bits=bits), n.group_scales: scales.contiguous(),
           n.shape: torch.tensor(list(q.shape), dtype=torch.int64)}
    if zeros is not None:
        out[n.zero_points] = pack_nibbles(zeros, 0, bits=bits)
    return out


def encode(w: torch.Tensor, convention: str, group_size: int, symmetric: bool,
           checkpoint_format: str = "gptq", module: str = "", bits: int = 4) -> dict[str, torch.Tensor]:
    """float [N, K] -> the convention's tensors of one module (local names)."""
    src = family_codec(bits).quantize(w, group_size, symmetric=symmetric)
    zeros = None if symmetric else src[2]
    if convention == AWQ.name:
        return to_awq(*src)
    if convention == GPTQ.name:
        return to_gptq(src[0], src[1], zeros, group_size, checkpoint_format, module, bits=bits)
    return to_pack_quantized(src[0], src[1], zeros, bits=bits)


# ------------------------------------------------------------------------------ declaration
def quantization_config(convention: str, group_size: int, symmetric: bool, act_order: bool = False,
                        checkpoint_format: str = "gptq", bits: int = 4) -> dict:
    """config.json ``quantization_config`` as AutoAWQ / GPTQModel / llm-compressor write it for
    this model."""
    if convention == AWQ.name:
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": list(AWQ_NOT_CONVERTED)}
    if convention == GPTQ.name:
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                "sym": symmetric, "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
                "lm_head": False, "checkpoint_format": checkpoint_format, "dynamic": dict(GPTQ_DYNAMIC)}
    channel = group_size == -1
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "channel" if channel else "group",
               "group_size": None if channel else group_size, "dynamic": False, "block_structure": None,
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
                   symmetric: bool, checkpoint_format: str = "gptq", bits: int = 4) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under hub names: the INT4 modules in the convention's layout, the rest BF16."""
    quantized = set(int4_modules(weights))
    out: dict[str, torch.Tensor] = {}
    for key, w in weights.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module not in quantized:
            out[make_checkpoint.hub_name(key)] = w.to(torch.bfloat16).contiguous()
            continue
        m = make_checkpoint.hub_name(module)
        for name, t in encode(w, convention, group_size, symmetric, checkpoint_format, m, bits=bits).items():
            out[f"{m}.{name}"] = t
    return out


def _break(kind: str, convention: str, tensors: dict[str, torch.Tensor], group_size: int) -> str | None:
    """Apply a malformed variant to the tensors (all but 'truncated', which cuts the file after it
    is written); returns the tensor broken."""
    bad = MALFORMED[kind]
    names = INTEGER_CONVENTIONS[convention].names(formats.INT4)
    if kind == "truncated":
        return None
    name = f"{bad.module}.{getattr(names, bad.tensor)}"
    if kind.startswith("missing-"):
        del tensors[name]
    elif kind == "wrong-shape":  # one scale per 2g inputs: half the groups
        s = tensors[name]
        axis = INTEGER_CONVENTIONS[convention].layout.group_scales.index("K/g")
        tensors[name] = s.narrow(axis, 0, s.shape[axis] // 2).contiguous()
    elif kind == "wrong-dtype":
        tensors[name] = tensors[name].to(torch.int64)
    elif kind == "act-order" and convention == GPTQ.name:  # desc_act: one module's g_idx scatters its groups
        k_in = tensors[name].numel()
        tensors[name] = (torch.arange(k_in, dtype=torch.int32) % (k_in // group_size)).contiguous()
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
                         malformed: str | None = None, spec: tiny_hybrid.TinyHybridSpec | None = None,
                         checkpoint_format: str | None = None, bits: int = 4) -> dict:
    """Write the checkpoint to ``out_dir`` (which must not exist); returns a summary dict.
    ``checkpoint_format``: GPTQ only, "gptq" (v1, the default) or "gptq_v2"; ``bits``: 4 (INT4) or 8
    (INT8; GPTQ and compressed-tensors)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if convention not in INTEGER_CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}; choose {', '.join(INTEGER_CONVENTIONS)}")
    if checkpoint_format is not None and convention != GPTQ.name:
        raise ValueError(f"--checkpoint-format is GPTQ's (gptq | gptq_v2); {convention} has none")
    checkpoint_format = checkpoint_format or GPTQ_FORMATS[0]
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r}; choose {' or '.join(GPTQ_FORMATS)}")
    family = formats.integer_family(bits)
    if family is None or (bits != 4 and convention == AWQ.name):
        what = "AutoAWQ GEMM stores 4-bit codes only" if convention == AWQ.name else "no integer family has them"
        raise ValueError(f"--bits {bits}: {what}")
    fmt = formats.members_of(family)[0]
    if group_size not in fmt.group_sizes and not (group_size == -1 and fmt.channel_groups):
        raise ValueError(f"group size {group_size}: the {fmt.title} family packs groups of "
                         f"{', '.join(map(str, fmt.group_sizes))}" + (" or -1 (per channel)" if fmt.channel_groups else ""))
    if symmetric and convention == AWQ.name:
        raise ValueError("AutoAWQ GEMM checkpoints carry zero points; --symmetric is for GPTQ and compressed-tensors")
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
        tensors = export_tensors(weights, convention, group_size, symmetric, checkpoint_format, bits=bits)
        broken = _break(malformed, convention, tensors, group_size) if malformed else None
        config = spec.config_dict(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
        config["quantization_config"] = quantization_config(convention, group_size, symmetric,
                                                            act_order=malformed == "act-order",
                                                            checkpoint_format=checkpoint_format, bits=bits)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"], "do_sample": False}, indent=2) + "\n")
        path = tmp / "model.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        if malformed == "truncated":  # a download cut short: the last tensor loses its tail
            os.truncate(path, path.stat().st_size - 64)
        summary = {
            "out_dir": str(out), "seed": seed, "convention": convention, "bits": bits, "group_size": group_size,
            "symmetric": symmetric, "malformed": malformed, "broken_tensor": broken,
            "checkpoint_format": checkpoint_format if convention == GPTQ.name else None,
            "architecture": config["architectures"][0], "layer_types": spec.layer_types(),
            "int4_modules": len(int4_modules(weights)), "tensors": len(tensors),
            "bytes": path.stat().st_size,
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qpn.scripts.checkpoints.make_int4_checkpoint",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder to create (must not exist)")
    p.add_argument("--convention", choices=list(INTEGER_CONVENTIONS), default=AWQ.name,
                   help="checkpoint layout: AutoAWQ GEMM (default), GPTQ or compressed-tensors pack-quantized")
    p.add_argument("--seed", type=int, default=0, help="seed of the float weights (default 0)")
    p.add_argument("--bits", type=int, default=4, choices=(4, 8),
                   help="code width: 4 (INT4 W4A16, default) or 8 (INT8 W8A16; GPTQ and compressed-tensors)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=(32, 64, 128, -1),
                   help=f"inputs per scale and zero point (default {DEFAULT_GROUP_SIZE}; -1 one per row, 8-bit only)")
    p.add_argument("--symmetric", action="store_true",
                   help="GPTQ and compressed-tensors: symmetric weights (zero point 8; compressed-tensors then "
                        "stores no weight_zero_point)")
    p.add_argument("--checkpoint-format", choices=GPTQ_FORMATS, default=None,
                   help="GPTQ only: gptq (v1, zero points stored minus 1; default) or gptq_v2")
    p.add_argument("--malformed", choices=sorted(MALFORMED), default=None,
                   help="write a broken variant the launcher's pre-boot check must refuse")
    args = p.parse_args(argv)
    try:
        summary = make_int4_checkpoint(args.out_dir, args.convention, seed=args.seed, group_size=args.group_size,
                                       symmetric=args.symmetric, malformed=args.malformed,
                                       checkpoint_format=args.checkpoint_format, bits=args.bits)
    except (FileExistsError, ValueError) as e:
        print(f"make_int4_checkpoint: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
