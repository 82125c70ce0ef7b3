"""Bindings: each QPN route as a torch.library custom op, and the public entry ``qpn_linear``.

``qpn_linear(x, packed, route=None, bias=None) -> fp16``: on CUDA runs the kernel of ``route``
(a ``routes.Route`` or its name; ``routes.route_for`` when None); on CPU runs the reference that
reads the same packed buffers. The op ``qpn::linear`` carries a fake (meta) implementation, so
torch.compile traces through it and CUDA graphs capture its launches.

A packed weight reaches the kernels as one ``WeightOperands`` record (kernel_inputs). This module
launches the m8n8k4 (SM70) kernels and the reconstruct pass itself; a tiled route on the m16n8k16
atom (sm_80+) is planned and launched by sm80_plan.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Optional

import torch

from . import families, formats, jit, routes, sm80_plan
from .atoms import arch_for_atom, atom_for_arch, geometry
from .kernel_inputs import (THREADS, WARPS, WeightOperands, bias16, fp16_activations, fp32_scale, kernel_member,
                            operands)
from .routes import Route

_logger = logging.getLogger("vllm.qpn.kernels")


class QpnArgs(ctypes.Structure):
    # struct QpnArgs in csrc/qpn_kernels.cu; names, offsets and size checked by tests/test_ctypes_structs.py.
    _fields_ = [
        ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("chscale", ctypes.c_void_p),
        ("x", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("y", ctypes.c_void_p),
        ("m", ctypes.c_int), ("n", ctypes.c_int), ("kblocks", ctypes.c_int), ("ldx", ctypes.c_int),
        ("ksplit", ctypes.c_int), ("tiles_per_block", ctypes.c_int), ("m_chunks", ctypes.c_int),
        ("chscale_per_channel", ctypes.c_int), ("group_shift", ctypes.c_int),
    ]


def build(arch="sm70", atom: Optional[str] = None) -> str:
    """Compile the kernels for ``arch`` (cached) and check every expected entry point exists.
    ``atom`` None builds every atom the architecture runs (m8n8k4 everywhere; m16n8k16 on sm_80+)
    and returns the cubin path of its native atom; a named atom builds that one. Raises
    jit.QpnBuildError naming a missing symbol, and nvrtc.NvrtcUnavailable naming the package to
    install when NVRTC is absent."""
    wanted = jit.atoms_for_arch(arch) if atom is None else (atom,)
    path = ""
    for a in wanted:
        if a not in jit.ATOM_SOURCES:
            raise ValueError(f"unknown MMA atom {a!r}; known atoms: {', '.join(jit.ATOM_SOURCES)}")
        cubin, path = jit.compile_cubin(arch, source=jit.ATOM_SOURCES[a])
        jit.check_entry_points(cubin, a)
    return path


# ------------------------------------------------------------------ architecture -> atom
def atom_for_device(device=None) -> str:
    """The MMA atom QPN kernels use on a CUDA device: m8n8k4 on sm_70/sm_75 (HMMA.884), m16n8k16
    on sm_80 and later (where m8n8k4 is emulated). Prepack with this atom for that device."""
    return atom_for_arch(torch.cuda.get_device_capability(device))


SM80_OPT_IN_ENV = "QPN_SM80_OPT_IN"


def sm80_opt_in() -> bool:
    """True when the operator asked for QPN kernels on sm_80+ GPUs (``QPN_SM80_OPT_IN=1``).
    Off by default: on sm_80+ vLLM has its own NVFP4 / FP8 paths, and the QPN m16n8k16 kernels
    replace them only once measured against those paths on the same GPU."""
    return sm80_plan.env_switch(SM80_OPT_IN_ENV, False,
                                "route ModelOpt NVFP4/FP8 layers to the QPN kernels on sm_80+", "leave them to vLLM")


def serving_target(capability) -> Optional[dict]:
    """What the overlay should serve a CUDA GPU of ``capability`` (a (major, minor) tuple) with:
    {"arch": "sm90", "atom": "m16n8k16"} for the QPN kernels, or None to leave vLLM alone.
    sm_70 always gets QPN (m8n8k4); sm_80+ only with QPN_SM80_OPT_IN=1; sm_75 and older never
    (the loader's SM70 gate decides those). The loader then builds with build(arch) and prepacks
    every weight with ``atom``."""
    major, minor = int(capability[0]), int(capability[1])
    num = major * 10 + minor
    if num == 70:
        return {"arch": "sm70", "atom": "m8n8k4"}
    if num >= 80 and sm80_opt_in():
        return {"arch": f"sm{num}", "atom": atom_for_arch(num)}
    return None


def route_kernel(route: Route, m: int, form: str = "restore",
                  member: Optional[formats.WeightFormat] = None) -> tuple[str, int, int]:
    """(entry point prefix, tiles per weight pass MT, m_chunks) of a tiled route on the m8n8k4 atom;
    ``form`` "s7" names the S7 form of an e4m3-grouped format's kernels (nvfp4_form); ``member`` is
    the format member whose kernels run (kernel_member; default the route family's)."""
    route.check_m(m)
    member = member or route.weight_format
    s7 = "_s7" if form == "s7" and member.has_s7_form else ""
    return f"{member.kernel_prefix}_mt{route.tiles_per_pass}{s7}", route.tiles_per_pass, route.chunks(m)


# Warps of an m8n8k4 GEMM an SM holds: 4 blocks of 8 at the 64-register cap (sm70_check).
SM70_RESIDENT_WARPS = 32


def sm70_split(n_tiles: int, kblocks: int, m_chunks: int, sms: int) -> tuple[int, int]:
    """(ksplit, tiles_per_block) of an m8n8k4 GEMM on a GPU of ``sms`` SMs: split K across the
    warps of a block (fewer weight tiles -> more K splitting) while the grid still fits in one
    resident wave. A split that spills into a second, partial wave leaves most SMs idle at its end
    (TP4 lm_head on a V100: 1,940 tiles, split in two, is 1.5 waves); one wave of 16 or more
    warps per SM keeps what the calibrated model needs in flight (results/perf_model_v100_*)."""
    wave = SM70_RESIDENT_WARPS * sms
    ksplit = 1
    while ksplit < WARPS and n_tiles * m_chunks * ksplit * 2 <= wave and ksplit * 2 <= max(1, kblocks):
        ksplit *= 2
    return ksplit, WARPS // ksplit


def _split(n_tiles: int, kblocks: int, m_chunks: int, device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return sm70_split(n_tiles, kblocks, m_chunks, jit.sm_count(idx))


def _launch_packed(route: Route, xh: torch.Tensor, w: WeightOperands, bias, pdl: bool = False,
                   form: Optional[str] = None) -> torch.Tensor:
    member, group_shift = kernel_member(w)   # refuses an atom the format has no kernels for
    if w.atom == "m16n8k16":
        return sm80_plan.launch_sm80(route, xh, w, bias, pdl=pdl)
    m = xh.shape[0]
    g = geometry(w.atom)
    form = form or (nvfp4_form(xh.device) if member.has_s7_form else "restore")
    name, mt, m_chunks = route_kernel(route, m, form, member)
    n_tiles = -(-w.n // g.tile_n)
    kblocks = w.k_pad // g.k_block
    ksplit, tpb = _split(n_tiles, kblocks, m_chunks, xh.device)
    y = torch.empty((m, w.n), dtype=torch.float16, device=xh.device)
    if m == 0:
        return y
    mod = jit.module_for(xh.device, w.atom)
    a = QpnArgs(w.codes.data_ptr(), w.scales.data_ptr() if w.scales is not None else 0, w.chscale.data_ptr(),
                xh.data_ptr(), bias.data_ptr() if bias is not None else 0, y.data_ptr(),
                m, w.n, kblocks, w.k_pad, ksplit, tpb, m_chunks, int(w.chscale.numel() != 1), group_shift)
    grid = -(-n_tiles // tpb) * m_chunks
    smem = WARPS * g.tile_n * 8 * mt * 4
    stream = torch.cuda.current_stream(xh.device).cuda_stream
    jit.launch(mod, f"{name}_{w.atom}", grid, THREADS, smem, stream, [a])
    return y


# ------------------------------------------------------------ NVFP4 operand form (m8n8k4)
# The two forms of the NVFP4 tiled kernels (kernels/families/nvfp4/m8n8k4.cuh, DecNVFP4Form): "s7" folds the
# decoder's 2^14 into the group scale (one FP16 multiply per operand register instead of two, 16
# issue slots fewer per k-block) and hands the tensor cores FP16-subnormal operands wherever a
# group scale is an e4m3 subnormal; "restore" keeps every operand a normal. Both give identical
# results on a GPU whose tensor cores take subnormal operands as they are. That is a property of
# the hardware, settled per device by probe_nvfp4_s7 on first use, never assumed.
NVFP4_FORMS = ("s7", "restore")
NVFP4_FORM_ENV = "QPN_SM70_NVFP4_FORM"
nvfp4_forms: dict = {}   # device index -> form


def nvfp4_form(device) -> str:
    """The NVFP4 tiled-kernel form this device runs: ``QPN_SM70_NVFP4_FORM`` (s7 | restore) when
    set, else "s7" if the device passes probe_nvfp4_s7 (run once per device and kept), else
    "restore". Under CUDA-graph capture a device not yet probed runs "restore" (a probe
    synchronises, which capture forbids) and is probed on its next uncaptured call."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    form = nvfp4_forms.get(idx)
    if form is not None:
        return form
    want = os.environ.get(NVFP4_FORM_ENV, "").strip().lower()
    if want and want not in NVFP4_FORMS:
        raise ValueError(f"{NVFP4_FORM_ENV}={want!r}: expected s7 (the 2^14 folded into the group scale; "
                         "needs tensor cores that take FP16-subnormal operands exactly) or restore (every "
                         "operand a normal); unset means: probe the GPU once and choose")
    if want:
        form = want
    elif torch.cuda.is_current_stream_capturing():
        return "restore"
    else:
        passed = probe_nvfp4_s7(torch.device("cuda", idx))
        form = "s7" if passed else "restore"
        _logger.log(logging.INFO if passed else logging.WARNING,
                    "QPN NVFP4 kernels on cuda:%d (%s): the %s form (subnormal-operand probe %s; "
                    "%s=s7|restore overrides)", idx, torch.cuda.get_device_name(idx), form,
                    "passed" if passed else "failed", NVFP4_FORM_ENV)
    nvfp4_forms[idx] = form
    return form


def probe_nvfp4_s7(device) -> bool:
    """True when both NVFP4 tiled kernels (one and two token tiles) give bit-identical outputs in
    the S7 and restore forms for a weight whose every group scale is an e4m3 subnormal (0x01-0x07,
    and the same with the sign bit): in the S7 form most nonzero operands are then FP16 subnormals
    (from 2^-17 up), in the restore form every one is a normal. The codes take every byte value."""
    from .families.nvfp4.layout import prepack as prepack_nvfp4
    n, k = 64, 256
    codes = (torch.arange(n * k // 2, dtype=torch.int64) * 37 % 256).to(torch.uint8).reshape(n, k // 2)
    sub = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87], dtype=torch.uint8)
    scales = sub[torch.arange(n * k // 16) % sub.numel()].reshape(n, k // 16).view(torch.float8_e4m3fn)
    w = fp32_scale(operands(prepack_nvfp4(codes.to(device), scales.to(device), 1.0, atom="m8n8k4")))
    gen = torch.Generator().manual_seed(14)
    for m, tiles in ((8, 1), (16, 2)):
        x = torch.randn((m, k), generator=gen).to(device=device, dtype=torch.float16)
        route = routes.tiled_route(w.fmt, tiles)
        restore = _launch_packed(route, x, w, None, form="restore")
        s7 = _launch_packed(route, x, w, None, form="s7")
        if not torch.equal(restore, s7):
            return False
    return True


def _mm_f32(xh: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """FP16 x FP16 -> FP32 GEMM with FP32 accumulation (cuBLAS through torch)."""
    return torch.mm(xh, ws.t(), out_dtype=torch.float32)


def _launch_reconstruct(route: Route, xh: torch.Tensor, w: WeightOperands, bias) -> torch.Tensor:
    g = geometry(w.atom)
    member, group_shift = kernel_member(w)
    n_tiles, kblocks = w.n_pad // g.tile_n, w.k_pad // g.k_block
    mod = jit.module_for(xh.device, w.atom)
    ws = torch.empty((w.n_pad, w.k_pad), dtype=torch.float16, device=xh.device)  # lives for this call only
    total = n_tiles * kblocks * 32
    args = [ctypes.c_void_p(w.codes.data_ptr()),
            ctypes.c_void_p(w.scales.data_ptr() if w.scales is not None else 0),
            ctypes.c_void_p(ws.data_ptr()), ctypes.c_int(n_tiles), ctypes.c_int(kblocks)]
    # the m8n8k4 reconstruct pass reads the group records' stride, and so does the m16n8k16 one of
    # a format whose weights choose their group size (QPN80_RECONSTRUCT_GS_ENTRY)
    if w.atom == "m8n8k4" or member.group_sizes:
        args.append(ctypes.c_int(group_shift))
    stream = torch.cuda.current_stream(xh.device).cuda_stream
    jit.launch(mod, f"{member.kernel_prefix}_reconstruct_ws_{w.atom}", -(-total // THREADS), THREADS, 0,
               stream, args)
    y32 = _mm_f32(xh, ws[:w.n])
    del ws
    chscale = w.chscale
    y32 *= chscale.reshape(1, -1) if chscale.numel() != 1 else chscale.reshape(())
    if bias is not None:
        y32 += bias.to(torch.float32).reshape(1, -1)
    return y32.to(torch.float16)


# ---------------------------------------------------------------------------- custom op
def linear_operands(x: torch.Tensor, w: WeightOperands, route: Route, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] -> fp16 [M, N] through ``route`` (CUDA) or the reference (CPU)."""
    if x.device.type != "cuda":
        return families.numerics(w.format).reference_linear(x, w.packed(), bias)
    # a *_pdl kernel reads the scale before it waits: only the weight's own FP32 tensor, never a
    # copy this call just made
    own_scale = w.chscale.dtype == torch.float32 and w.chscale.is_contiguous()
    w = fp32_scale(w)
    xh = fp16_activations(x, w.k, w.k_pad)
    b = bias16(bias, w.n, x.device)
    if route.kernel == routes.RECONSTRUCT:
        return _launch_reconstruct(route, xh, w, b)
    return _launch_packed(route, xh, w, b, pdl=own_scale)


@torch.library.custom_op("qpn::linear", mutates_args=())
def linear_op(x: torch.Tensor, codes: torch.Tensor, scales: Optional[torch.Tensor], chscale: torch.Tensor,
              n: int, k: int, fmt: str, atom: str, route: str, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The traced form of qpn_linear: the weight arguments are WeightOperands' fields in order."""
    return linear_operands(x, WeightOperands(codes, scales, chscale, n, k, fmt, atom), routes.as_route(route), bias)


@linear_op.register_fake
def _(x, codes, scales, chscale, n, k, fmt, atom, route, bias):
    return x.new_empty((x.shape[0], n), dtype=torch.float16)


def qpn_linear(x: torch.Tensor, packed, route: Route | str | None = None,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a packed NVFP4 / FP8 / INT4 weight; x [..., K] -> fp16 [..., N]."""
    if x.is_cuda and x.dtype == torch.float16 and x.dim() == 2 and not torch.compiler.is_compiling():
        y = sm80_plan.eager_tiled(x, packed, route, bias)
        if y is not None:
            return y
    w = operands(packed)
    if x.shape[-1] != w.k:
        raise ValueError(f"activations have K={x.shape[-1]} but the weight expects K={w.k}")
    if x.device != w.codes.device:
        raise ValueError(f"activations on {x.device} but the packed weight on {w.codes.device}; "
                         "move the packed weight with packed.to(device) at load time")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    m = x2.shape[0]
    if route is None:
        route = routes.route_for(w.fmt, max(m, 1), w.n, w.k, arch=arch_for_atom(w.atom), served_only=False)
    else:
        route = routes.as_route(route)
        if route.kernel not in (routes.TILED, routes.RECONSTRUCT) or route.format != w.fmt:
            raise ValueError(f"route {route} serves {route.format} {route.kernel} layers, the weight is a "
                             f"dense {w.fmt} layer; pass a dense {w.fmt} route or None")
    # Traced (torch.compile): through the registered custom op. Eager: the same implementation
    # called directly, which saves the custom-op dispatcher's host time on every call (measured
    # on the H200: tens of microseconds, more than a small layer's kernel).
    if torch.compiler.is_compiling():
        y = torch.ops.qpn.linear(x2, *w, str(route), bias)
    else:
        y = linear_operands(x2, w, route, bias)
    return y.reshape(*lead, w.n)
