"""Bindings: each QPN route as a torch.library custom op, and the public entry ``qpn_linear``.

``qpn_linear(x, packed, route=None, bias=None) -> fp16``: on CUDA runs the kernel of ``route``
(``routes.route_for`` when None); on CPU runs the reference that reads the same packed buffers.
The ops ``qpn::linear_nvfp4`` and ``qpn::linear_fp8`` carry fake (meta) implementations, so
torch.compile traces through them and CUDA graphs capture their launches.
"""
from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch

from . import jit, reference, routes
from .atoms import geometry
from .prepack import PackedFP8, PackedNVFP4

THREADS = 256
WARPS = THREADS // 32


class QpnArgs(ctypes.Structure):
    # Must match struct QpnArgs in csrc/qpn_kernels.cu.
    _fields_ = [
        ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("chscale", ctypes.c_void_p),
        ("x", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("y", ctypes.c_void_p),
        ("m", ctypes.c_int), ("n", ctypes.c_int), ("kblocks", ctypes.c_int), ("ldx", ctypes.c_int),
        ("ksplit", ctypes.c_int), ("tiles_per_block", ctypes.c_int), ("m_chunks", ctypes.c_int),
        ("chscale_per_channel", ctypes.c_int),
    ]


def build(arch="sm70", atom: str = "m8n8k4") -> str:
    """Compile every kernel for ``arch`` (cached) and check every expected entry point exists.
    Returns the cubin path. Raises jit.QpnBuildError naming a missing symbol, and
    nvrtc.NvrtcUnavailable naming the package to install when NVRTC is absent."""
    cubin, path = jit.compile_cubin(arch)
    jit.check_entry_points(cubin, atom)
    return path


def _route_kernel(route: str, fmt: str, m: int) -> tuple[str, int, int]:
    """(entry point prefix, tiles per weight pass MT, m_chunks) for a packed route."""
    prefix = routes.ROUTE_PREFIX[fmt]
    max_m = routes.route_max_m(route)
    if max_m is not None and m > max_m:
        raise ValueError(f"route {route} serves M <= {max_m}, got M={m}; use routes.route_for() to pick one")
    if route == prefix:
        return f"{prefix}_mt1", 1, 1
    if route == prefix + "_mt2":
        return f"{prefix}_mt2", 2, 1
    if route == prefix + "_chunked":
        return f"{prefix}_mt2", 2, -(-m // routes.CHUNK_ROWS)
    raise ValueError(route)


_sm_count: dict = {}


def _split(n_tiles: int, kblocks: int, m_chunks: int, device) -> tuple[int, int]:
    """(ksplit, tiles_per_block): split K across the warps of a block until the grid offers
    about 32 warps per SM (fewer weight tiles -> more K splitting)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = _sm_count.get(idx)
    if sms is None:
        sms = _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    want = 32 * sms
    ksplit = 1
    while ksplit < WARPS and n_tiles * m_chunks * ksplit < want and ksplit * 2 <= max(1, kblocks):
        ksplit *= 2
    return ksplit, WARPS // ksplit


def _prep_x(x2: torch.Tensor, k: int, k_pad: int) -> torch.Tensor:
    xh = x2.to(torch.float16)
    if k_pad != k:
        xh = torch.nn.functional.pad(xh, (0, k_pad - k))
    if not xh.is_contiguous() or xh.data_ptr() % 16:
        xh = xh.contiguous().clone()
    return xh


def _launch_packed(fmt: str, route: str, xh: torch.Tensor, codes, scales, chscale, n: int, k_pad: int,
                   atom: str, bias) -> torch.Tensor:
    m = xh.shape[0]
    g = geometry(atom)
    name, mt, m_chunks = _route_kernel(route, fmt, m)
    n_tiles = -(-n // g.tile_n)
    kblocks = k_pad // g.k_block
    ksplit, tpb = _split(n_tiles, kblocks, m_chunks, xh.device)
    y = torch.empty((m, n), dtype=torch.float16, device=xh.device)
    if m == 0:
        return y
    mod = jit.module_for(xh.device)
    a = QpnArgs(codes.data_ptr(), scales.data_ptr() if scales is not None else 0, chscale.data_ptr(),
                xh.data_ptr(), bias.data_ptr() if bias is not None else 0, y.data_ptr(),
                m, n, kblocks, k_pad, ksplit, tpb, m_chunks, int(chscale.numel() != 1))
    grid = -(-n_tiles // tpb) * m_chunks
    smem = WARPS * g.tile_n * 8 * mt * 4
    stream = torch.cuda.current_stream(xh.device).cuda_stream
    jit.launch(mod, f"{name}_{atom}", grid, THREADS, smem, stream, [a])
    return y


def _mm_f32(xh: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """FP16 x FP16 -> FP32 GEMM with FP32 accumulation (cuBLAS through torch)."""
    return torch.mm(xh, ws.t(), out_dtype=torch.float32)


def _launch_reconstruct(fmt: str, xh: torch.Tensor, codes, scales, chscale, n: int, n_pad: int,
                        k_pad: int, atom: str, bias) -> torch.Tensor:
    g = geometry(atom)
    n_tiles, kblocks = n_pad // g.tile_n, k_pad // g.k_block
    mod = jit.module_for(xh.device)
    ws = torch.empty((n_pad, k_pad), dtype=torch.float16, device=xh.device)  # lives for this call only
    total = n_tiles * kblocks * 32
    args = [ctypes.c_void_p(codes.data_ptr()),
            ctypes.c_void_p(scales.data_ptr() if scales is not None else 0),
            ctypes.c_void_p(ws.data_ptr()), ctypes.c_int(n_tiles), ctypes.c_int(kblocks)]
    stream = torch.cuda.current_stream(xh.device).cuda_stream
    jit.launch(mod, f"{routes.ROUTE_PREFIX[fmt]}_reconstruct_ws_{atom}", -(-total // THREADS), THREADS, 0,
               stream, args)
    y32 = _mm_f32(xh, ws[:n])
    del ws
    y32 *= chscale.reshape(1, -1) if chscale.numel() != 1 else chscale.reshape(())
    if bias is not None:
        y32 += bias.to(torch.float32).reshape(1, -1)
    return y32.to(torch.float16)


def _bias16(bias: Optional[torch.Tensor], n: int, device) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    if bias.numel() != n:
        raise ValueError(f"bias has {bias.numel()} elements, the layer has N={n} outputs")
    return bias.reshape(n).to(device=device, dtype=torch.float16).contiguous()


# ---------------------------------------------------------------------------- custom ops
@torch.library.custom_op("qpn::linear_nvfp4", mutates_args=())
def linear_nvfp4_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                    n: int, k: int, route: str, atom: str, bias: Optional[torch.Tensor]) -> torch.Tensor:
    packed = PackedNVFP4(codes, scales, global_scale, n, k, atom)
    if x.device.type != "cuda":
        return reference.linear_nvfp4(x, packed, bias)
    xh = _prep_x(x, k, packed.k_pad)
    b = _bias16(bias, n, x.device)
    gs = global_scale.to(torch.float32).reshape(1)
    if route.endswith("_reconstruct"):
        return _launch_reconstruct("nvfp4", xh, codes, scales, gs, n, packed.n_pad, packed.k_pad, atom, b)
    return _launch_packed("nvfp4", route, xh, codes, scales, gs, n, packed.k_pad, atom, b)


@linear_nvfp4_op.register_fake
def _(x, codes, scales, global_scale, n, k, route, atom, bias):
    return x.new_empty((x.shape[0], n), dtype=torch.float16)


@torch.library.custom_op("qpn::linear_fp8", mutates_args=())
def linear_fp8_op(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, n: int, k: int, route: str,
                  atom: str, bias: Optional[torch.Tensor]) -> torch.Tensor:
    packed = PackedFP8(codes, scale, n, k, atom)
    if x.device.type != "cuda":
        return reference.linear_fp8(x, packed, bias)
    xh = _prep_x(x, k, packed.k_pad)
    b = _bias16(bias, n, x.device)
    sc = scale.to(torch.float32).reshape(-1)
    if route.endswith("_reconstruct"):
        return _launch_reconstruct("fp8", xh, codes, None, sc, n, packed.n_pad, packed.k_pad, atom, b)
    return _launch_packed("fp8", route, xh, codes, None, sc, n, packed.k_pad, atom, b)


@linear_fp8_op.register_fake
def _(x, codes, scale, n, k, route, atom, bias):
    return x.new_empty((x.shape[0], n), dtype=torch.float16)


def qpn_linear(x: torch.Tensor, packed, route: Optional[str] = None,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a packed NVFP4 / FP8 weight; x [..., K] -> fp16 [..., N]."""
    if isinstance(packed, PackedNVFP4):
        fmt = "nvfp4"
    elif isinstance(packed, PackedFP8):
        fmt = "fp8"
    else:
        raise TypeError(f"expected PackedNVFP4 or PackedFP8, got {type(packed).__name__}")
    if x.shape[-1] != packed.k:
        raise ValueError(f"activations have K={x.shape[-1]} but the weight expects K={packed.k}")
    if x.device != packed.codes.device:
        raise ValueError(f"activations on {x.device} but the packed weight on {packed.codes.device}; "
                         "move the packed weight with packed.to(device) at load time")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.k)
    m = x2.shape[0]
    if route is None:
        route = routes.route_for(fmt, max(m, 1), packed.n, packed.k)
    elif routes.route_format(route) != fmt:
        raise ValueError(f"route {route} serves {routes.route_format(route)}, the weight is {fmt}")
    if fmt == "nvfp4":
        y = torch.ops.qpn.linear_nvfp4(x2, packed.codes, packed.scales, packed.global_scale,
                                       packed.n, packed.k, route, packed.atom, bias)
    else:
        y = torch.ops.qpn.linear_fp8(x2, packed.codes, packed.scale, packed.n, packed.k, route,
                                     packed.atom, bias)
    return y.reshape(*lead, packed.n)
