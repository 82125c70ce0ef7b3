"""Independent float32 reference for an INT4 W4A16 checkpoint (AutoAWQ GEMM, GPTQ, compressed-tensors
pack-quantized): every INT4 tensor is decoded by the engine's or the library's own code, loaded into
transformers' ``Qwen3_5ForCausalLM`` in float32, and run teacher-forced through the runner of
qpn.scripts.checkpoints.checkpoint_reference (shared with the ModelOpt and compressed-tensors
references).

    python -m qpn.scripts.checkpoints.int4_reference CKPT_DIR --token-ids 1,2,3,... --variants float32,bfloat16,... --out FILE

Decoders (nothing of the QPN path -- qpn.kernels.family_int4, conventions, formats, prepack -- is used):

* AWQ: vLLM 0.32's ``_unpack_and_dequant_int4_awq`` (fused_moe/oracle/int_wna16.py, the torch
  reference of its INT4 emulation path: AutoAWQ's interleaved nibble order undone, zero points
  subtracted, times the group scale), asked for float32.
* GPTQ: vLLM 0.32's ``_unpack_and_dequant_int4_gptq`` (the same file), which reads zero points as
  stored (``checkpoint_format`` gptq_v2) and a symmetric checkpoint as uint4b8; for
  ``checkpoint_format`` gptq (v1) the stored zero points are zero - 1, so they are read with vLLM's
  ``unpack_cols``, given their 1 back (what vLLM's exllama kernel does on the GPU,
  ``use_v2_format=False``) and packed again with its ``pack_cols``. ``g_idx`` must be k // g
  (this reference does not reorder inputs).
* compressed-tensors: the library's ``PackedQuantizationCompressor.decompress`` with the scale in
  float32 (its ``dequantize`` then computes in float32).

Every product (code - zero) * float16 scale is exact in float32, so the reference weights are
exact; the served path rounds each operand to FP16 once (the bf16 floor variant measures the
rounding of a bf16 engine).

Negative controls (``--variants`` names; each a mistake an INT4 loader makes):
``swap-nibbles`` (the two codes of each byte of the packed words exchanged: inputs, or for AWQ
outputs, read in the wrong order), ``zero-off-by-one`` (every zero point one higher: reading a
GPTQ v2 checkpoint as v1, or the symmetric bias as 9), ``scales-one-group-off`` (each group
multiplied by the next group's scale along K: a group index off by one).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from qpn.scripts.checkpoints import checkpoint_reference

PERTURBATIONS = ("none", "swap-nibbles", "zero-off-by-one", "scales-one-group-off")


def _swap_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words with the two nibbles of each byte exchanged (the same 32 bits otherwise)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = ((w & 0x0F0F0F0F) << 4) | ((w >> 4) & 0x0F0F0F0F)
    return (w - ((w >> 31) << 32)).to(torch.int32)


def _awq(t: dict, m: str, group_size: int, perturb: str) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _unpack_and_dequant_int4_awq

    qweight, scales = t[f"{m}.qweight"], t[f"{m}.scales"]
    if perturb == "swap-nibbles":
        qweight = _swap_nibbles(qweight)
    w = _unpack_and_dequant_int4_awq(qweight[None], scales[None], t[f"{m}.qzeros"][None], transpose_output=True,
                                     output_dtype=torch.float32)[0]
    return w, scales.t().float().repeat_interleave(group_size, dim=1)


def _gptq(t: dict, m: str, group_size: int, quant_cfg: dict, perturb: str) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _unpack_and_dequant_int4_gptq
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_cols, unpack_cols

    qweight, scales = t[f"{m}.qweight"], t[f"{m}.scales"]
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    g_idx = t.get(f"{m}.g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group_size):
        raise ValueError(f"{m}: g_idx is not k // {group_size} (activation order); this reference reads "
                         "inputs in checkpoint order only")
    qzeros = None
    if not quant_cfg.get("sym", True):
        qzeros = t[f"{m}.qzeros"]
        if str(quant_cfg.get("checkpoint_format", "gptq")).lower() == "gptq":   # v1: stored zero - 1
            qzeros = pack_cols(unpack_cols(qzeros, 4, k // group_size, n) + 1, 4, k // group_size, n)
    if perturb == "swap-nibbles":
        qweight = _swap_nibbles(qweight)
    w = _unpack_and_dequant_int4_gptq(qweight[None], scales[None], None if qzeros is None else qzeros[None],
                                      transpose_output=True, output_dtype=torch.float32)[0]
    return w, scales.t().float().repeat_interleave(group_size, dim=1)


def _pack_quantized(t: dict, m: str, weights_args: dict, perturb: str) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    local = {k[len(m) + 1:]: v for k, v in t.items() if k.startswith(m + ".") and "." not in k[len(m) + 1:]}
    local["weight_scale"] = local["weight_scale"].float()   # the library's dequantize computes in its dtype
    if perturb == "swap-nibbles":
        local["weight_packed"] = _swap_nibbles(local["weight_packed"])
    scheme = QuantizationScheme(targets=["Linear"], weights=weights_args)
    w = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    group_size = w.shape[1] // local["weight_scale"].shape[1]
    return w, local["weight_scale"].repeat_interleave(group_size, dim=1)


def _perturbed(w: torch.Tensor, s: torch.Tensor, perturb: str, group_size: int) -> torch.Tensor:
    if perturb == "zero-off-by-one":        # (code - (zero + 1)) * scale
        return w - s
    if perturb == "scales-one-group-off":   # (code - zero) * the next group's scale (exact: w / s is an integer)
        return (w / s) * torch.roll(s, -group_size, dims=1)
    return w


def dequantized_state_dict(ckpt_dir: str | Path, perturb: str = "none") -> dict[str, torch.Tensor]:
    """float32 state dict of the checkpoint under transformers' names (MTP weights dropped:
    transformers has no MTP head)."""
    from safetensors.torch import load_file

    if perturb not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {perturb!r}; choose from {PERTURBATIONS}")
    quant_cfg = json.loads((Path(ckpt_dir) / "config.json").read_text()).get("quantization_config") or {}
    method = str(quant_cfg.get("quant_method", "")).lower()
    t: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        t.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    if method in ("awq", "gptq"):
        g = int(quant_cfg.get("group_size", quant_cfg.get("q_group_size", 0)))
        modules = sorted(k[: -len(".qweight")] for k in t if k.endswith(".qweight"))
        suffixes = ("qweight", "qzeros", "scales", "g_idx")
        for m in modules:
            w, s = _awq(t, m, g, perturb) if method == "awq" else _gptq(t, m, g, quant_cfg, perturb)
            out[f"{m}.weight"] = _perturbed(w, s, perturb, g)
    elif method == "compressed-tensors":
        groups = [grp for grp in (quant_cfg.get("config_groups") or {}).values()
                  if (grp.get("weights") or {}).get("type") == "int" and (grp.get("weights") or {}).get("num_bits") == 4]
        if len(groups) != 1:
            raise ValueError(f"{ckpt_dir}: expected one INT4 config group, found {len(groups)}")
        args = groups[0]["weights"]
        modules = sorted(k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed"))
        suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
        for m in modules:
            w, s = _pack_quantized(t, m, args, perturb)
            out[f"{m}.weight"] = _perturbed(w, s, perturb, int(args["group_size"]))
    else:
        raise ValueError(f"{ckpt_dir}: quant_method {method!r} is not an INT4 W4A16 convention this "
                         "reference reads (awq, gptq, compressed-tensors pack-quantized)")
    if not modules:
        raise ValueError(f"{ckpt_dir}: no INT4 module in the safetensors files")
    for name, v in t.items():
        if name.startswith("mtp.") or name.endswith(suffixes):
            continue
        out[name] = v.to(torch.float32)
    return {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
            for k, v in out.items()}


def load_reference_model(ckpt_dir: str | Path, perturb: str = "none"):
    return checkpoint_reference.float_model(ckpt_dir, dequantized_state_dict(ckpt_dir, perturb))


def reference_variants(ckpt_dir: str | Path, token_ids: list[int], variants: list[str],
                       kv_cache: str = "auto") -> dict[str, dict]:
    """``kv_cache``: 'auto' (the model dtype) or 'fp8_e4m3' (K and V through e4m3 as the cpu
    engine stores them when FP8 KV is asked for; these checkpoints carry no KV scales: 1.0)."""
    return checkpoint_reference.reference_variants(ckpt_dir, token_ids, variants, kv_cache,
                                                   load_model=load_reference_model, perturbations=PERTURBATIONS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qpn.scripts.checkpoints.int4_reference",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt_dir")
    p.add_argument("--token-ids", required=True, help="comma-separated prompt token ids")
    p.add_argument("--variants", default="float32",
                   help=f"comma-separated list of float32, bfloat16 and {', '.join(PERTURBATIONS[1:])}")
    p.add_argument("--kv-cache", choices=("auto", "fp8_e4m3"), default="auto")
    p.add_argument("--out", help="write the JSON result here (default: stdout)")
    args = p.parse_args(argv)
    ids = [int(x) for x in args.token_ids.split(",") if x.strip()]
    if len(ids) < 2:
        print("int4_reference: need at least two token ids", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    try:
        result = reference_variants(args.ckpt_dir, ids, [v for v in args.variants.split(",") if v], args.kv_cache)
    except ValueError as e:
        print(f"int4_reference: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
