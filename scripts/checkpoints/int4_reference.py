"""Independent float32 reference for an integer checkpoint, INT4 W4A16 or INT8 W8A16 (AutoAWQ, GPTQ,
compressed-tensors pack-quantized): every quantized module is dequantized by the engine's or the
library's own code, loaded
into transformers' ``Qwen3_5ForCausalLM`` in float32 and run teacher-forced through the runner of
qpn.scripts.checkpoints.checkpoint_reference (shared with the ModelOpt and compressed-tensors
references).

    python -m qpn.scripts.checkpoints.int4_reference CKPT_DIR --token-ids 1,2,3,... --variants float32,bfloat16,... --out FILE

Who decodes what (nothing of the QPN path: no qpn.kernels, no conventions):

* AWQ: vLLM's ``_unpack_and_dequant_int4_awq`` (fused_moe/oracle/int_wna16.py, the torch
  dequantization of its emulation path), in float32.
* GPTQ: vLLM's ``_unpack_and_dequant_int4_gptq`` (same file), which reads zero points as stored in
  the v2 format; a v1 checkpoint's words (``checkpoint_format`` gptq, zero - 1, the convention
  vLLM's exllama kernel documents) are first unpacked, given their 1 back and repacked with vLLM's
  own ``unpack_quantized_values_into_int32`` / ``pack_quantized_values_into_int32``. A symmetric
  checkpoint reads no zero points (uint4b8, as vLLM does). Its ``g_idx`` must be the identity
  order (k // g), which is what vLLM's function assumes; another is refused. 8-bit GPTQ (``bits: 8``,
  which that function does not read): vLLM's ``unpack_quantized_values_into_int32`` with
  ``scalar_types.uint8`` unpacks the codes and zero points (v1: given their 1 back; symmetric:
  zero 128), and (code - zero) x scale is computed here in float32, group by g_idx.
* compressed-tensors pack-quantized: the library's ``unpack_from_int32`` (codes, and zero points
  packed along N) and ``dequantize`` (quantization.lifecycle.forward), what its
  PackedQuantizationCompressor.decompress calls, asked for float32 (decompress itself returns the
  scale's float16, which rounds some (code - zero) x scale products).

Which modules are INT4 and how is read from the files and config.json alone: a module holding
``qweight`` (AWQ / GPTQ) or ``weight_packed`` (compressed-tensors) is INT4; the group size is K /
the number of scale groups; AWQ is asymmetric, GPTQ reads ``sym`` and ``checkpoint_format``,
compressed-tensors ``symmetric`` of its config group's weights.

Negative controls (``--variants`` names): ``swap-nibbles`` (the two 4-bit values of every byte of the
codes words exchanged, neighbouring inputs or outputs trading places) and ``zero-off-by-one``
(every zero point read one higher: the GPTQ v1 / v2 mistake, applied to every convention).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from qpn.scripts.checkpoints import checkpoint_reference

PERTURBATIONS = ("none", "swap-nibbles", "zero-off-by-one")
_CODES = {"qweight": ("awq", "gptq"), "weight_packed": ("compressed-tensors",)}


def _swap_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words with the two nibbles of every byte exchanged (the same 32 bits otherwise)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    swapped = ((w & 0x0F0F0F0F) << 4) | ((w >> 4) & 0x0F0F0F0F)
    return (swapped - ((swapped >> 31) << 32)).to(torch.int32)


def _uint(bits: int = 4):
    from vllm.scalar_type import scalar_types

    return {4: scalar_types.uint4, 8: scalar_types.uint8}[bits]


def _zero_words(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Zero points [groups, N] as qzeros words (32 / bits per int32 along N), by vLLM's own packer."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_quantized_values_into_int32

    if int(values.min()) < 0 or int(values.max()) >= 1 << bits:
        raise ValueError(f"zero points {int(values.min())}..{int(values.max())} do not fit {bits} bits (a GPTQ v1 "
                         "checkpoint storing the largest value, AutoGPTQ's wrap of zero 0?)")
    return pack_quantized_values_into_int32(values, _uint(bits), packed_dim=1)


def _zero_values(qzeros: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """qzeros words -> the zero points [groups, N] they store, by vLLM's own unpacker."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32

    return unpack_quantized_values_into_int32(qzeros, _uint(bits), packed_dim=1)


def _decode_gptq_8bit(t: dict, quant_cfg: dict, g_idx: torch.Tensor, off: int, perturb: str) -> torch.Tensor:
    """8-bit GPTQ: vLLM's unpacker for the words, (code - zero) x scale in float32 here."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32

    qweight = _swap_nibbles(t["qweight"]) if perturb == "swap-nibbles" else t["qweight"]
    q = unpack_quantized_values_into_int32(qweight, _uint(8), packed_dim=0).to(torch.float32)  # [K, N]
    scales = t["scales"].to(torch.float32)                                                    # [groups, N]
    if quant_cfg.get("sym"):
        zeros = torch.full(scales.shape, 128.0 + off)
    else:
        v1 = str(quant_cfg.get("checkpoint_format", "gptq")).lower() == "gptq"
        zeros = _zero_values(t["qzeros"], 8).to(torch.float32)[:, : scales.shape[1]] + (1 if v1 else 0) + off
    gi = g_idx.to(torch.int64)
    return ((q - zeros[gi]) * scales[gi]).t().contiguous()


def decode_awq(t: dict, perturb: str = "none") -> torch.Tensor:
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _unpack_and_dequant_int4_awq

    qweight, qzeros = t["qweight"], t["qzeros"]
    if perturb == "swap-nibbles":
        qweight = _swap_nibbles(qweight)
    if perturb == "zero-off-by-one":
        # AWQ interleaves its columns, but adding 1 to every nibble is the same in any order
        qzeros = _zero_words(_zero_values(qzeros) + 1)
    return _unpack_and_dequant_int4_awq(qweight[None], t["scales"][None], qzeros[None], transpose_output=True,
                                        output_dtype=torch.float32)[0]


def decode_gptq(t: dict, quant_cfg: dict, module: str, perturb: str = "none") -> torch.Tensor:
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _unpack_and_dequant_int4_gptq

    qweight, scales = t["qweight"], t["scales"]
    bits = int(quant_cfg.get("bits", 4))
    k = qweight.shape[0] * (32 // bits)
    g = k // scales.shape[0]
    g_idx = t.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // g):
        raise ValueError(f"{module}: g_idx is not k // {g}; this reference reads GPTQ in checkpoint order only")
    if bits == 8:
        return _decode_gptq_8bit(t, quant_cfg, torch.arange(k) // g, 1 if perturb == "zero-off-by-one" else 0, perturb)
    if perturb == "swap-nibbles":
        qweight = _swap_nibbles(qweight)
    v1 = str(quant_cfg.get("checkpoint_format", "gptq")).lower() == "gptq"
    off = 1 if perturb == "zero-off-by-one" else 0
    if quant_cfg.get("sym"):
        # uint4b8: the function subtracts its bias 8 when given no zero points
        qzeros = _zero_words(torch.full(scales.shape, 8 + off, dtype=torch.int32)) if off else None
    else:
        qzeros = _zero_words(_zero_values(t["qzeros"]) + (1 if v1 else 0) + off)
    return _unpack_and_dequant_int4_gptq(qweight[None], scales[None], None if qzeros is None else qzeros[None],
                                         transpose_output=True, output_dtype=torch.float32)[0]


def decode_pack_quantized(t: dict, weights_args: dict, perturb: str = "none") -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs.model_validate(weights_args)
    shape = torch.Size(int(d) for d in t["weight_shape"])
    packed = _swap_nibbles(t["weight_packed"]) if perturb == "swap-nibbles" else t["weight_packed"]
    scale = t["weight_scale"].to(torch.float32)
    values = unpack_from_int32(packed, args.num_bits, shape)
    zero = None
    if not args.symmetric:
        zero = unpack_from_int32(t["weight_zero_point"], args.num_bits, (shape[0], scale.shape[1]), packed_dim=0)
    if perturb == "zero-off-by-one":
        zero = (torch.zeros(scale.shape, dtype=torch.int8) if zero is None else zero) + 1
    return dequantize(x_q=values, scale=scale, zero_point=zero, g_idx=t.get("weight_g_idx"), dtype=torch.float32)


def _config(ckpt_dir: Path) -> dict:
    cfg = json.loads((ckpt_dir / "config.json").read_text()).get("quantization_config")
    if not isinstance(cfg, dict) or str(cfg.get("quant_method", "")).lower() not in ("awq", "gptq", "compressed-tensors"):
        raise ValueError(f"{ckpt_dir}: config.json declares no AWQ, GPTQ or compressed-tensors quantization_config")
    return cfg


def _ct_weights_args(quant_cfg: dict) -> dict:
    groups = [g for g in (quant_cfg.get("config_groups") or {}).values() if g.get("weights")]
    if len(groups) != 1:
        raise ValueError(f"this reference reads a compressed-tensors checkpoint with one weights group, found {len(groups)}")
    return groups[0]["weights"]


def dequantized_state_dict(ckpt_dir: str | Path, perturb: str = "none") -> dict[str, torch.Tensor]:
    """float32 state dict of the checkpoint, transformers' names (MTP weights dropped: transformers
    has no MTP head)."""
    from safetensors.torch import load_file

    if perturb not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {perturb!r}; choose from {PERTURBATIONS}")
    ckpt_dir = Path(ckpt_dir)
    quant_cfg = _config(ckpt_dir)
    method = str(quant_cfg["quant_method"]).lower()
    t: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        t.update(load_file(str(f)))
    codes = next(c for c, methods in _CODES.items() if method in methods)
    modules = sorted(k[: -len(codes) - 1] for k in t if k.endswith("." + codes))
    if not modules:
        raise ValueError(f"{ckpt_dir}: no module holds {codes!r}; not an INT4 {method} checkpoint")
    out: dict[str, torch.Tensor] = {}
    owned: set[str] = set()
    for m in modules:
        local = {k[len(m) + 1:]: v for k, v in t.items() if k.startswith(m + ".") and "." not in k[len(m) + 1:]}
        owned.update(f"{m}.{k}" for k in local)
        if method == "awq":
            w = decode_awq(local, perturb)
        elif method == "gptq":
            w = decode_gptq(local, quant_cfg, m, perturb)
        else:
            w = decode_pack_quantized(local, _ct_weights_args(quant_cfg), perturb)
        out[f"{m}.weight"] = w.to(torch.float32).contiguous()
    for name, v in t.items():
        if name in owned or name.startswith("mtp."):
            continue
        out[name] = v.to(torch.float32)
    hub = "model.language_model."
    return {("model." + k[len(hub):] if k.startswith(hub) else k): v for k, v in out.items()}


def load_reference_model(ckpt_dir: str | Path, perturb: str = "none"):
    return checkpoint_reference.float_model(ckpt_dir, dequantized_state_dict(ckpt_dir, perturb))


def reference_variants(ckpt_dir: str | Path, token_ids: list[int], variants: list[str],
                       kv_cache: str = "auto") -> dict[str, dict]:
    """``kv_cache``: 'auto' (the model dtype) or 'fp8_e4m3' (K and V through e4m3 as the cpu engine
    stores them when FP8 KV is asked for; these checkpoints carry no KV scales, so 1.0)."""
    return checkpoint_reference.reference_variants(ckpt_dir, token_ids, variants, kv_cache,
                                                   load_model=load_reference_model, perturbations=PERTURBATIONS)


def main(argv: list[str] | None = None) -> int:
    return checkpoint_reference.variants_main("int4_reference", __doc__, PERTURBATIONS, reference_variants, argv)


if __name__ == "__main__":
    sys.exit(main())
