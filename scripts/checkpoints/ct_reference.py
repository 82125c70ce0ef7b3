"""Independent float32 reference for a compressed-tensors checkpoint: every quantized tensor is
decoded by compressed-tensors' own code (``unpack_fp4_from_uint8`` + ``dequantize`` with the
stored ``weight_global_scale`` as the library divides by it, for NVFP4;
``FloatQuantizationCompressor.decompress`` for FP8), loaded into transformers'
``Qwen3_5ForCausalLM`` in float32, and run teacher-forced through the runner of
qpn.scripts.checkpoints.checkpoint_reference (shared with the ModelOpt reference).

    python -m qpn.scripts.checkpoints.ct_reference CKPT_DIR --token-ids 1,2,3,... --variants float32,bfloat16,... --out FILE

Which modules are quantized, and how, is read with the library too: a module with
``weight_packed`` is NVFP4; an FP8 ``weight`` with a ``weight_scale`` is FP8 (per tensor or per
channel by the scale's shape). Nothing of the QPN path (conventions, formats, prepack) is used.

Negative controls (``--variants`` names): ``swap-nibbles`` (the two codes of each byte
exchanged), ``global-scale-as-multiplier`` (weight_global_scale read the ModelOpt way, as a
multiplier: the mistake a loader that ignores the convention makes), ``collapse-fp8-shards``
(the per-tensor FP8 scales of q/k/v replaced by their largest, codes unchanged).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from qpn.scripts.checkpoints import checkpoint_reference

PERTURBATIONS = ("none", "swap-nibbles", "global-scale-as-multiplier", "collapse-fp8-shards")
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def _decode_nvfp4(t: dict, m: str, perturb: str) -> torch.Tensor:
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = t[f"{m}.weight_packed"]
    if perturb == "swap-nibbles":
        packed = ((packed & 0x0F) << 4) | (packed >> 4)
    values = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
    g = t[f"{m}.weight_global_scale"].float()
    if perturb == "global-scale-as-multiplier":
        g = 1.0 / g  # the library divides by g: dividing by 1/g multiplies by it
    return dequantize(x_q=values, scale=t[f"{m}.weight_scale"].float(), global_scale=g, dtype=torch.float32)


def _decode_fp8(t: dict, m: str, scale: torch.Tensor) -> torch.Tensor:
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import FP8, FP8_DYNAMIC

    preset = FP8 if scale.numel() == 1 else FP8_DYNAMIC
    out = FloatQuantizationCompressor.decompress({"weight": t[f"{m}.weight"], "weight_scale": scale.float()},
                                                 QuantizationScheme(targets=["Linear"], **preset))
    return out["weight"].float()


def dequantized_state_dict(ckpt_dir: str | Path, perturb: str = "none") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if perturb not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {perturb!r}; choose from {PERTURBATIONS}")
    t: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        t.update(load_file(str(f)))
    nvfp4 = sorted(k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed"))
    fp8 = sorted(k[: -len(".weight")] for k, v in t.items()
                 if k.endswith(".weight") and v.dtype == torch.float8_e4m3fn)
    scales = {m: t[f"{m}.weight_scale"] for m in fp8}
    if perturb == "collapse-fp8-shards":
        for m in fp8:
            if m.endswith(_QKV) and scales[m].numel() == 1:
                base = m.rsplit(".", 2)[0]
                scales[m] = torch.stack([t[f"{base}.{s}.weight_scale"].reshape(()) for s in _QKV]).max().reshape(1)
    out: dict[str, torch.Tensor] = {}
    for m in nvfp4:
        out[f"{m}.weight"] = _decode_nvfp4(t, m, perturb)
    for m in fp8:
        out[f"{m}.weight"] = _decode_fp8(t, m, scales[m])
    quant_suffixes = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "input_scale",
                      "k_scale", "v_scale")
    for name, v in t.items():
        module = name.rsplit(".", 1)[0]
        if name.startswith("mtp.") or name.endswith(quant_suffixes) or module in fp8:
            continue
        out[name] = v.to(torch.float32)
    return {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
            for k, v in out.items()}


def load_reference_model(ckpt_dir: str | Path, perturb: str = "none"):
    return checkpoint_reference.float_model(ckpt_dir, dequantized_state_dict(ckpt_dir, perturb))


def reference_variants(ckpt_dir: str | Path, token_ids: list[int], variants: list[str],
                       kv_cache: str = "auto") -> dict[str, dict]:
    """``kv_cache``: 'auto' (the model dtype: what vLLM 0.32 resolves for these checkpoints) or
    'fp8_e4m3' (K and V through e4m3 with the checkpoint's self_attn.k_scale / v_scale, as the cpu
    engine stores them when FP8 KV is asked for explicitly)."""
    return checkpoint_reference.reference_variants(ckpt_dir, token_ids, variants, kv_cache,
                                                   load_model=load_reference_model, perturbations=PERTURBATIONS)


def main(argv: list[str] | None = None) -> int:
    return checkpoint_reference.variants_main("ct_reference", __doc__, PERTURBATIONS, reference_variants, argv)


if __name__ == "__main__":
    sys.exit(main())
