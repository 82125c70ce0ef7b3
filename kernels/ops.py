"""Bindings: each QPN route as a torch.library custom op, and the public entry ``qpn_linear``.

``qpn_linear(x, packed, route=None, bias=None) -> fp16``: on CUDA runs the kernel of ``route``
(a ``routes.Route`` or its name; ``routes.route_for`` when None); on CPU runs the reference that
reads the same packed buffers. The op ``qpn::linear`` carries a fake (meta) implementation, so
torch.compile traces through it and CUDA graphs capture its launches.

A packed weight reaches the kernels as one ``WeightOperands`` record: built once per call by
``operands(packed)``, handed whole to every launcher, and spread into the custom op's arguments
(torch.library ops take tensors and scalars, not records) in its field order.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import weakref
from typing import NamedTuple, Optional

import torch

from . import families, formats, jit, routes
from .atoms import atom_for_arch, geometry
from .prepack import PackedLayout
from .routes import Route

THREADS = 256
WARPS = THREADS // 32
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


def arch_for_atom(atom: str) -> str:
    """The route-table architecture key of an atom's kernels (the bands are the same today)."""
    return "sm70" if atom == "m8n8k4" else "sm80"


SM80_OPT_IN_ENV = "QPN_SM80_OPT_IN"


def env_switch(name: str, default: bool, on_means: str, off_means: str) -> bool:
    """An on/off setting from the environment (1/true/yes/on, 0/false/no/off, unset: ``default``);
    any other value is an error naming the setting and what each value does."""
    v = os.environ.get(name, "").strip().lower()
    if v == "":
        return default
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={v!r}: expected 1 ({on_means}) or 0 ({off_means}); unset means "
                     f"{1 if default else 0}")


def sm80_opt_in() -> bool:
    """True when the operator asked for QPN kernels on sm_80+ GPUs (``QPN_SM80_OPT_IN=1``).
    Off by default: on sm_80+ vLLM has its own NVFP4 / FP8 paths, and the QPN m16n8k16 kernels
    replace them only once measured against those paths on the same GPU."""
    return env_switch(SM80_OPT_IN_ENV, False, "route ModelOpt NVFP4/FP8 layers to the QPN kernels on sm_80+",
                      "leave them to vLLM")


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


class WeightOperands(NamedTuple):
    """A packed weight as the kernels and the reference read it. Its fields, in this order, are
    the custom op's weight arguments (``qpn::linear``)."""
    codes: torch.Tensor              # uint8, fragment order
    scales: Optional[torch.Tensor]   # NVFP4 e4m3 group scales / INT4 group records (fragment order); None for FP8
    chscale: torch.Tensor            # scale of the result: NVFP4 global [1]; FP8 [1] or [N]; INT4 [1] = 1
    n: int
    k: int
    fmt: str                         # the kernel family (formats.KERNEL_FAMILIES key)
    atom: str

    # padded sizes, as every packed weight answers them (a NamedTuple cannot subclass PackedLayout)
    n_pad = PackedLayout.n_pad
    k_pad = PackedLayout.k_pad

    @property
    def format(self) -> formats.WeightFormat:
        """The kernel family's description (``formats.KERNEL_FAMILIES``)."""
        return formats.KERNEL_FAMILIES[self.fmt]

    def packed(self):
        """The packed weight (PackedNVFP4, PackedFP8, ...) these operands came from (what the
        reference reads)."""
        return families.numerics(self.format).packed_from_tensors(self.codes, self.scales, self.chscale,
                                                                self.n, self.k, self.atom)


# The packed dense weight class of each format family with its numerics, resolved once
# (operands() runs under torch.compile).
_DENSE_PACKED = tuple((families.numerics(f).packed_type, f, families.numerics(f))
                      for f in formats.KERNEL_FAMILIES.values())


def operands(packed) -> WeightOperands:
    """The WeightOperands of a packed dense weight, from its format's ``packed_tensors`` (the
    inverse of WeightOperands.packed)."""
    for packed_type, f, num in _DENSE_PACKED:
        if isinstance(packed, packed_type):
            return WeightOperands(*num.packed_tensors(packed), packed.n, packed.k, f.family, packed.atom)
    kinds = " or ".join(t.__name__ for t, _, _ in _DENSE_PACKED)
    raise TypeError(f"expected a packed dense weight ({kinds}), got {type(packed).__name__}")


def _route_kernel(route: Route, m: int, form: str = "restore",
                  member: Optional[formats.WeightFormat] = None) -> tuple[str, int, int]:
    """(entry point prefix, tiles per weight pass MT, m_chunks) of a tiled route on the m8n8k4 atom;
    ``form`` "s7" names the S7 form of an e4m3-grouped format's kernels (nvfp4_form); ``member`` is
    the format member whose kernels run (kernel_member; default the route family's)."""
    route.check_m(m)
    member = member or route.weight_format
    s7 = "_s7" if form == "s7" and member.has_s7_form else ""
    return f"{member.kernel_prefix}_mt{route.tiles_per_pass}{s7}", route.tiles_per_pass, route.chunks(m)


def kernel_member(w: WeightOperands) -> tuple[formats.WeightFormat, int]:
    """(the format member whose kernels serve ``w``, log2 of a lane's input runs per group record:
    m8n8k4 k-blocks of 32, m16n8k16 runs of 16, AtomGeometry.lane_run). Only a family whose weights
    choose their group size (``group_sizes``: INT4) has either to read off the tensors (the packed
    weight names its member and group size); the others run the family's kernels, whose group is
    fixed."""
    f = w.format
    if w.atom not in f.kernel_atoms:
        raise ValueError(f"{f.title} has no {w.atom} kernels (they exist for {', '.join(f.kernel_atoms)}); "
                         f"prepack it with atom={f.kernel_atoms[-1]!r}, or run it on the CPU reference")
    if not f.group_sizes:
        return f, 0
    p = w.packed()
    run = geometry(w.atom).lane_run
    kpg = p.group_size // run
    if kpg < 1 or kpg & (kpg - 1) or p.group_size % run:
        raise ValueError(f"{f.title}: group size {p.group_size} is not a power-of-two number of "
                         f"{w.atom} lane runs ({run} inputs)")
    return formats.format_of(p), kpg.bit_length() - 1


_sm_count: dict = {}


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
    sms = _sm_count.get(idx)
    if sms is None:
        sms = _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return sm70_split(n_tiles, kblocks, m_chunks, sms)


def fp16_activations(x2: torch.Tensor, k: int, k_pad: int) -> torch.Tensor:
    """x [M, K] as the kernels read it (dense and MoE alike): FP16, K zero-padded to ``k_pad``,
    contiguous and 16-byte aligned."""
    xh = x2.to(torch.float16)
    if k_pad != k:
        xh = torch.nn.functional.pad(xh, (0, k_pad - k))
    if not xh.is_contiguous() or xh.data_ptr() % 16:
        xh = xh.contiguous().clone()
    return xh


def _launch_packed(route: Route, xh: torch.Tensor, w: WeightOperands, bias, pdl: bool = False,
                   form: Optional[str] = None) -> torch.Tensor:
    member, group_shift = kernel_member(w)   # refuses an atom the format has no kernels for
    if w.atom == "m16n8k16":
        return _launch_sm80(route, xh, w, bias, pdl=pdl)
    m = xh.shape[0]
    g = geometry(w.atom)
    form = form or (nvfp4_form(xh.device) if member.has_s7_form else "restore")
    name, mt, m_chunks = _route_kernel(route, m, form, member)
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
# The two forms of the NVFP4 tiled kernels (csrc/qpn_family.cuh, DecNVFP4Form): "s7" folds the
# decoder's 2^14 into the group scale (one FP16 multiply per operand register instead of two, 16
# issue slots fewer per k-block) and hands the tensor cores FP16-subnormal operands wherever a
# group scale is an e4m3 subnormal; "restore" keeps every operand a normal. Both give identical
# results on a GPU whose tensor cores take subnormal operands as they are. That is a property of
# the hardware, settled per device by probe_nvfp4_s7 on first use, never assumed.
NVFP4_FORMS = ("s7", "restore")
NVFP4_FORM_ENV = "QPN_SM70_NVFP4_FORM"
_nvfp4_forms: dict = {}   # device index -> form


def nvfp4_form(device) -> str:
    """The NVFP4 tiled-kernel form this device runs: ``QPN_SM70_NVFP4_FORM`` (s7 | restore) when
    set, else "s7" if the device passes probe_nvfp4_s7 (run once per device and kept), else
    "restore". Under CUDA-graph capture a device not yet probed runs "restore" (a probe
    synchronises, which capture forbids) and is probed on its next uncaptured call."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    form = _nvfp4_forms.get(idx)
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
    _nvfp4_forms[idx] = form
    return form


def probe_nvfp4_s7(device) -> bool:
    """True when both NVFP4 tiled kernels (one and two token tiles) give bit-identical outputs in
    the S7 and restore forms for a weight whose every group scale is an e4m3 subnormal (0x01-0x07,
    and the same with the sign bit): in the S7 form most nonzero operands are then FP16 subnormals
    (from 2^-17 up), in the restore form every one is a normal. The codes take every byte value."""
    from .prepack import prepack_nvfp4
    n, k = 64, 256
    codes = (torch.arange(n * k // 2, dtype=torch.int64) * 37 % 256).to(torch.uint8).reshape(n, k // 2)
    sub = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87], dtype=torch.uint8)
    scales = sub[torch.arange(n * k // 16) % sub.numel()].reshape(n, k // 16).view(torch.float8_e4m3fn)
    w = _fp32_scale(operands(prepack_nvfp4(codes.to(device), scales.to(device), 1.0, atom="m8n8k4")))
    gen = torch.Generator().manual_seed(14)
    for m, tiles in ((8, 1), (16, 2)):
        x = torch.randn((m, k), generator=gen).to(device=device, dtype=torch.float16)
        route = routes.tiled_route(w.fmt, tiles)
        restore = _launch_packed(route, x, w, None, form="restore")
        s7 = _launch_packed(route, x, w, None, form="s7")
        if not torch.equal(restore, s7):
            return False
    return True


# ------------------------------------------------------------------------- sm_80+ (m16n8k16)
class Qpn80Args(ctypes.Structure):
    # struct Qpn80Args in csrc/qpn_kernels_sm80.cu; names, offsets and size checked by tests/test_ctypes_structs.py.
    _fields_ = [
        ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("chscale", ctypes.c_void_p),
        ("x", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("y", ctypes.c_void_p),
        ("partials", ctypes.c_void_p), ("counters", ctypes.c_void_p),
        ("m", ctypes.c_int), ("n", ctypes.c_int), ("kblocks", ctypes.c_int), ("ldx", ctypes.c_int),
        ("n_groups", ctypes.c_int), ("nwarps", ctypes.c_int), ("chunks", ctypes.c_int),
        ("chscale_per_channel", ctypes.c_int), ("group_shift", ctypes.c_int),
    ]


# Scratch of the split-K reduction per (device, stream): FP32 partial sums and arrival counters.
# The kernels leave every counter at zero, so the buffers are reused by every call on that
# stream (calls on one stream never overlap). A buffer that grows is replaced, and the old one is
# kept alive: a CUDA graph captured earlier may still point at it.
_sm80_scratch: dict = {}
_sm80_retired: list = []


def _sm80_buffers(device, stream: int, n_floats: int, n_ints: int):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, stream)
    cur = _sm80_scratch.get(key)
    if cur is None or cur[0].numel() < n_floats or cur[1].numel() < n_ints:
        if cur is not None:
            _sm80_retired.append(cur)
        nf = max(n_floats, cur[0].numel() if cur else 0, 1 << 16)
        ni = max(n_ints, cur[1].numel() if cur else 0, 1 << 12)
        cur = (torch.empty(nf, dtype=torch.float32, device=device),
               torch.zeros(ni, dtype=torch.int32, device=device))
        _sm80_scratch[key] = cur
    return cur


_sm80_plans: dict = {}


def _sm80_no_smem_kernel(name: str) -> Optional[str]:
    """The register-ring kernel (jit.SM80_ROUTE_KERNELS_NO_SMEM) of the route whose shared-memory
    ring kernel is ``name``; None when no route table names ``name``."""
    fallback = {v: jit.SM80_ROUTE_KERNELS_NO_SMEM[k] for table in (jit.SM80_ROUTE_KERNELS, jit.SM80_LARGE_N_KERNELS)
                for k, v in table.items()}
    return fallback.get(name)


def _sm80_plan(mod, name: str, fmt: formats.WeightFormat, n: int, kblocks: int, chunks: int, device) -> tuple:
    """(kernel name, grid, nwarps, n_groups, partial floats per run, dynamic shared memory bytes,
    counters per weight group and chunk) for one kernel and layer shape. A shared-memory ring kernel
    whose ring does not fit a block on this GPU is replaced by the register-ring kernel of the same
    route (jit.SM80_ROUTE_KERNELS_NO_SMEM). An M-band kernel's run is a block whose 8 warps hold
    different tiles of its group: each warp has its own partial slots and counter (8 of each)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    min_items = jit.SM80_MIN_ITEMS[fmt]
    key = (idx, name, n, kblocks, chunks, min_items)
    plan = _sm80_plans.get(key)
    if plan is None:
        kernels = jit.sm80_kernels()
        cfg = kernels[name]
        if cfg.smem_bytes > _smem_optin(idx):
            fallback = _sm80_no_smem_kernel(name)
            if fallback is None:
                raise ValueError(f"kernel {name} needs {cfg.smem_bytes} bytes of shared memory per block; "
                                 f"cuda:{idx} allows {_smem_optin(idx)}")
            cfg = kernels[fallback]
        smem = cfg.smem_bytes
        if smem > 48 * 1024:
            jit.allow_dynamic_smem(mod, cfg.name, smem)
        sms = _sm_count.get(idx)
        if sms is None:
            sms = _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        resident_warps = sms * jit.occupancy(mod, cfg.name, THREADS, smem) * WARPS
        planes = WARPS if cfg.band else 1   # a band block's group: 8 warps' tiles, a partial plane each
        grid, nwarps, n_groups = sm80_partition(n, kblocks, cfg.tiles * planes, chunks, resident_warps, min_items,
                                                WARPS if cfg.coop or cfg.band else 1, warps_split_items=not cfg.band)
        plan = _sm80_plans[key] = (cfg.name, grid, nwarps, n_groups, planes * 2 * 32 * cfg.tiles * cfg.mt * 4, smem,
                                   planes)
    return plan


_smem_optin_cache: dict = {}


def _smem_optin(idx: int) -> int:
    v = _smem_optin_cache.get(idx)
    if v is None:
        v = _smem_optin_cache[idx] = jit.max_smem_optin(idx)
    return v


def sm80_partition(n: int, kblocks: int, tiles: int, chunks: int, resident_warps: int,
                   min_items: int, unit_warps: int = 1, warps_split_items: bool = True) -> tuple[int, int, int]:
    """(grid blocks, runs per chunk plane, weight groups) of an sm_80+ launch. Items = weight
    groups (of ``tiles`` 16-row tiles) x k-blocks, split into contiguous runs, one per unit of
    ``unit_warps`` warps (1: the per-warp kernels; WARPS: the block-cooperative ones, whose warps
    share their block's run, and the M-band ones, whose warps each take their own tiles of every
    item: ``warps_split_items`` False). As many units as the GPU holds at once (shared by the chunk
    planes), but never fewer than ``min_items`` items per warp that splits them, and at least one item
    per unit (the kernel relies on it). The kernels receive the run count as Qpn80Args.nwarps."""
    n_groups = -(-(-(-n // 16)) // tiles)
    items = n_groups * kblocks
    if items >= 2 ** 31:
        raise ValueError(f"layer too large for one launch: {n_groups} weight groups x {kblocks} k-blocks "
                         "exceeds 2^31 work items; split N across calls")
    per_unit = (unit_warps if warps_split_items else 1) * min_items
    runs = max(1, min(items, resident_warps // unit_warps // chunks, items // max(1, per_unit)))
    return -(-runs * unit_warps // WARPS) * chunks, runs, n_groups


def _sm80_kernel_for(route: Route, m: int, n: int = 0,
                     member: Optional[formats.WeightFormat] = None) -> tuple[str, int]:
    """(kernel name, chunks) serving a tiled route on the m16n8k16 atom for a layer of n rows. The
    *_chunked route runs an M-band kernel where jit.SM80_BAND_KERNELS lists one for the format (one
    weight pass per 8 x MT rows), else the MT = 2 kernel once per 16-row chunk. ``member``: the
    format member whose kernels run (kernel_member; default the route family's); a format not served
    yet finds its kernels in jit.SM80_UNSERVED_ROUTE_KERNELS."""
    route.check_m(m)
    key = (member or route.weight_format, route.tiles_per_pass)
    if route.chunk_rows and route.weight_format in jit.SM80_BAND_KERNELS:
        bands = jit.SM80_BAND_KERNELS[route.weight_format]
        name = next((k for k in bands if routes.TILE_ROWS * _sm80_config(k).mt >= m), bands[-1])
    elif n >= jit.SM80_LARGE_N and key in jit.SM80_LARGE_N_KERNELS:
        name = jit.SM80_LARGE_N_KERNELS[key]
    else:
        name = jit.SM80_ROUTE_KERNELS.get(key) or jit.SM80_UNSERVED_ROUTE_KERNELS[key]
    return name, _sm80_chunks(route, m, _sm80_config(name))


_sm80_configs: dict = {}


def _sm80_config(name: str) -> jit.Sm80Kernel:
    """jit.sm80_kernels()[name], parsed once per kernel: the parse reads every csrc/ file, and a
    launch path that plans on each call (the custom op's) must not pay that per call."""
    cfg = _sm80_configs.get(name)
    if cfg is None:
        cfg = _sm80_configs[name] = jit.sm80_kernels()[name]
    return cfg


def _sm80_chunks(route: Route, m: int, cfg: jit.Sm80Kernel) -> int:
    """Grid planes of a launch: a chunked route cuts M into chunks of the kernel's 8 x MT rows (the
    M-band kernel: 64; an MT = 2 kernel: 16, how the route ran before the band kernel); else 1."""
    return -(-m // (routes.TILE_ROWS * cfg.mt)) if route.chunk_rows else 1


# Programmatic dependent launch (sm_90+): a route kernel's *_pdl form, launched with the PDL
# attribute, fills its weight ring while the stream's previous kernel finishes, and waits for that
# kernel before it reads x or touches y and the split-K scratch. Which route kernels take it, and
# the measurements behind the choice: jit.SM80_PDL_KERNELS. QPN_PDL=0 turns it off.
PDL_ENV = "QPN_PDL"
_pdl_capable: dict = {}   # device index -> sm_90+ and a driver with cuLaunchKernelEx
_pdl_names: dict = {}     # route kernel -> its *_pdl form where SM80_PDL_KERNELS lists it, else None


def pdl_enabled() -> bool:
    return env_switch(PDL_ENV, True, "launch the sm_90+ route kernels with programmatic dependent launch",
                      "plain launches")


def _pdl_form(name: str, idx: int) -> Optional[str]:
    """The *_pdl form of route kernel ``name`` when launches on cuda:``idx`` should use it."""
    if not pdl_enabled():
        return None
    ok = _pdl_capable.get(idx)
    if ok is None:
        ok = _pdl_capable[idx] = (torch.cuda.get_device_capability(idx) >= (9, 0)
                                  and jit.driver().has_launch_ex)
    if not ok:
        return None
    if name not in _pdl_names:   # parsing the kernel source is far dearer than a launch: once per kernel
        cfg = jit.sm80_kernels().get(name + "_pdl")
        _pdl_names[name] = cfg.name if name in jit.SM80_PDL_KERNELS and cfg is not None and cfg.variant == 7 else None
    return _pdl_names[name]


class _Launch:
    """One tiled-route launch with everything but the activations, the output and the bias
    resolved: kernel function, grid, shared memory, stream and the argument block (weight, scale
    and split-K scratch pointers, shape). ``run`` writes x, y and bias into the block and calls
    cuLaunchKernel (cuLaunchKernelEx for a *_pdl kernel), which copies the block: the same
    _Launch serves call after call."""
    __slots__ = ("func", "grid", "smem", "stream", "args", "params", "keep", "pdl")

    def __init__(self, func, grid: int, smem: int, stream: int, args: ctypes.Structure, keep: tuple,
                 pdl: bool = False):
        self.func, self.grid, self.smem, self.stream, self.args = func, grid, smem, stream, args
        self.params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self.keep = keep  # tensors whose pointers the block holds (scale copy, split-K scratch)
        self.pdl = jit.pdl_config(grid, THREADS, smem, stream) if pdl else None

    def run(self, x_ptr: int, y_ptr: int, bias_ptr: int) -> None:
        a = self.args
        a.x, a.y, a.bias = x_ptr, y_ptr, bias_ptr
        if self.pdl is not None:
            jit.launch_raw_pdl(self.func, self.pdl, self.params)
        else:
            jit.launch_raw(self.func, self.grid, THREADS, self.smem, self.stream, self.params)


def _sm80_launch(route: Route, m: int, w: WeightOperands, device, stream: int,
                 kernel: Optional[str] = None, pdl: bool = False) -> _Launch:
    """The _Launch of a tiled route on the m16n8k16 atom for a batch of ``m`` (>= 1) rows on
    ``stream``; ``w.chscale`` must already be the flat FP32 scale (``_fp32_scale``). ``pdl``: the
    caller vouches that no kernel of this call wrote the weight's tensors (a *_pdl kernel reads
    them before it waits for the previous kernel), so the route's *_pdl form may serve it."""
    member, group_shift = kernel_member(w)
    name, chunks = _sm80_kernel_for(route, m, w.n, member)
    if kernel is not None:  # another kernel of the same token tiling (benchmarks only)
        cfg = jit.sm80_kernels().get(kernel)
        # a chunked route takes any kernel of two or more token tiles (chunks follow its MT)
        fits = cfg is not None and (cfg.mt >= 2 if route.chunk_rows else cfg.mt == _sm80_config(name).mt)
        if not fits or cfg.weight_format != member:
            raise ValueError(f"kernel {kernel!r} cannot serve route {route} ({w.fmt}, M={m})")
        name, chunks = kernel, _sm80_chunks(route, m, cfg)
    mod = jit.module_for(device, "m16n8k16")
    kblocks = w.k_pad // 64
    name, grid, nwarps, n_groups, per_run, smem, planes = _sm80_plan(mod, name, w.format, w.n, kblocks, chunks,
                                                                     device)
    pdl_name = _pdl_form(name, device.index if device.index is not None else torch.cuda.current_device()) \
        if pdl and kernel is None else None
    if pdl_name is not None:
        name, grid, nwarps, n_groups, per_run, smem, planes = _sm80_plan(mod, pdl_name, w.format, w.n, kblocks,
                                                                         chunks, device)
    partials, counters = _sm80_buffers(device, stream, chunks * nwarps * per_run, chunks * planes * n_groups)
    a = Qpn80Args(w.codes.data_ptr(), w.scales.data_ptr() if w.scales is not None else 0, w.chscale.data_ptr(),
                  0, 0, 0, partials.data_ptr(), counters.data_ptr(),
                  m, w.n, kblocks, w.k_pad, n_groups, nwarps, chunks, int(w.chscale.numel() != 1), group_shift)
    return _Launch(mod.function(name), grid, smem, stream, a, (w.codes, w.scales, w.chscale, partials, counters),
                   pdl=pdl_name is not None)


def _launch_sm80(route: Route, xh: torch.Tensor, w: WeightOperands, bias,
                 kernel: Optional[str] = None, pdl: bool = False) -> torch.Tensor:
    m = xh.shape[0]
    y = torch.empty((m, w.n), dtype=torch.float16, device=xh.device)
    if m == 0:
        return y
    stream = torch.cuda.current_stream(xh.device).cuda_stream
    _sm80_launch(route, m, w, xh.device, stream, kernel, pdl).run(
        xh.data_ptr(), y.data_ptr(), bias.data_ptr() if bias is not None else 0)
    return y


def run_sm80_kernel(x: torch.Tensor, packed, kernel: str, route: Route | str | None = None) -> torch.Tensor:
    """Benchmarks only: run a named kernel of the sm_80+ source (a configuration or a variant
    that drops a stage) on a packed weight, bypassing the custom op. Variants return garbage."""
    if packed.atom != "m16n8k16":
        raise ValueError("run_sm80_kernel needs a weight prepacked with atom='m16n8k16'")
    w = _fp32_scale(operands(packed))
    x2 = x.reshape(-1, packed.k)
    route = routes.as_route(route) if route is not None else routes.route_for(
        w.fmt, x2.shape[0], packed.n, packed.k, arch="sm80")
    return _launch_sm80(route, fp16_activations(x2, w.k, w.k_pad), w, None, kernel)


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


def _bias16(bias: Optional[torch.Tensor], n: int, device) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    if bias.numel() != n:
        raise ValueError(f"bias has {bias.numel()} elements, the layer has N={n} outputs")
    return bias.reshape(n).to(device=device, dtype=torch.float16).contiguous()


# ---------------------------------------------------------------------------- custom op
def _fp32_scale(w: WeightOperands) -> WeightOperands:
    """The operands with the result scale as the flat FP32 tensor the kernels read."""
    return w._replace(chscale=w.chscale.to(torch.float32).reshape(-1))


def _linear(x: torch.Tensor, w: WeightOperands, route: Route, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] -> fp16 [M, N] through ``route`` (CUDA) or the reference (CPU)."""
    if x.device.type != "cuda":
        return families.numerics(w.format).reference_linear(x, w.packed(), bias)
    # a *_pdl kernel reads the scale before it waits: only the weight's own FP32 tensor, never a
    # copy this call just made
    own_scale = w.chscale.dtype == torch.float32 and w.chscale.is_contiguous()
    w = _fp32_scale(w)
    xh = fp16_activations(x, w.k, w.k_pad)
    b = _bias16(bias, w.n, x.device)
    if route.kernel == routes.RECONSTRUCT:
        return _launch_reconstruct(route, xh, w, b)
    return _launch_packed(route, xh, w, b, pdl=own_scale)


@torch.library.custom_op("qpn::linear", mutates_args=())
def linear_op(x: torch.Tensor, codes: torch.Tensor, scales: Optional[torch.Tensor], chscale: torch.Tensor,
              n: int, k: int, fmt: str, atom: str, route: str, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The traced form of qpn_linear: the weight arguments are WeightOperands' fields in order."""
    return _linear(x, WeightOperands(codes, scales, chscale, n, k, fmt, atom), routes.as_route(route), bias)


@linear_op.register_fake
def _(x, codes, scales, chscale, n, k, fmt, atom, route, bias):
    return x.new_empty((x.shape[0], n), dtype=torch.float16)


def qpn_linear(x: torch.Tensor, packed, route: Route | str | None = None,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a packed NVFP4 / FP8 / INT4 weight; x [..., K] -> fp16 [..., N]."""
    if x.is_cuda and x.dtype == torch.float16 and x.dim() == 2 and not torch.compiler.is_compiling():
        y = _eager_tiled(x, packed, route, bias)
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
        y = _linear(x2, w, route, bias)
    return y.reshape(*lead, w.n)


# ------------------------------------------------------------------- eager launch cache (sm_80+)
# The eager call's host time is the Python launch path, not the kernel (issue 14: 42 us per
# qpn_linear call against 15.6 us for torch's x @ w.t() on the H200's host). For the common case
# -- a tiled route on the m16n8k16 atom, FP16 contiguous 16-byte-aligned activations, K already a
# whole number of k-blocks, an FP32 result scale -- everything but x, y and bias is resolved once
# per (weight, M, route, device, stream) into a _Launch and reused. Any other call takes the
# general path, which is also how a _Launch is first built, so both run the same code.
_eager_weights: dict = {}   # id(packed) -> _EagerWeight (dropped when the packed weight is freed)
_eager_lock = threading.Lock()
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _EagerWeight:
    """A packed weight's cached launches, with the tensors they point at (checked by identity on
    every call, so a weight whose tensors are replaced is re-planned)."""
    __slots__ = ("ref", "source", "format", "device", "w", "plans")

    def __init__(self, packed, source: WeightOperands, w: WeightOperands, device: int):
        self.ref = weakref.ref(packed, lambda _, key=id(packed), table=_eager_weights: table.pop(key, None))
        self.source = (source.codes, source.scales, source.chscale)
        self.format = source.format
        self.device, self.w, self.plans = device, w, {}


def _eager_weight(packed) -> Optional[_EagerWeight]:
    try:
        w = operands(packed)
    except TypeError:
        return None
    # Only where the kernels read the weight's own tensors: an FP32 scale (no converted copy that an
    # in-place update of the weight would bypass) and K = K_pad (x needs no padding).
    if (w.atom != "m16n8k16" or w.atom not in w.format.kernel_atoms or not w.codes.is_cuda
            or w.chscale.dtype != torch.float32
            or not w.chscale.is_contiguous() or w.chscale.device != w.codes.device or w.k != w.k_pad
            or (w.scales is not None and w.scales.device != w.codes.device)):
        return None
    return _EagerWeight(packed, w, _fp32_scale(w), w.codes.get_device())


def _same_tensor(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """The same bytes as the tensor a plan was built on. Not identity alone: a family may hand out
    its tensors as a fresh view per call (INT4's records, viewed as one integer per record), and
    an identity test would then re-plan every call. The plan's entry holds the tensor it was built
    on, so no other live tensor can have its address, shape and dtype unless it views the same bytes."""
    if a is b:
        return True
    return (a is not None and b is not None and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride())


def _eager_tiled(x: torch.Tensor, packed, route, bias) -> Optional[torch.Tensor]:
    """qpn_linear for an FP16 2-D CUDA x through a cached _Launch, or None when the general path
    must serve the call (another atom or route kind, a weight whose tensors were replaced,
    activations that need conversion or padding, M = 0)."""
    ent = _eager_weights.get(id(packed))
    if ent is None or ent.ref() is not packed:
        ent = _eager_weight(packed)
        if ent is None:
            return None
        _eager_weights[id(packed)] = ent
    w = ent.w
    codes, scales, chscale = ent.source
    now_codes, now_scales, now_chscale = families.numerics(ent.format).packed_tensors(packed)
    if not (_same_tensor(now_codes, codes) and _same_tensor(now_scales, scales)
            and _same_tensor(now_chscale, chscale)):
        _eager_weights.pop(id(packed), None)   # the weight's tensors were replaced: plan again next call
        return None
    m, k = x.shape
    if m == 0 or k != w.k or x.get_device() != ent.device or not x.is_contiguous() or x.data_ptr() % 16:
        return None
    stream = _raw_stream(ent.device) if _raw_stream is not None else torch.cuda.current_stream(ent.device).cuda_stream
    key = (m, route, stream)
    plan = ent.plans.get(key)
    if plan is None:
        r = (routes.route_for(w.fmt, m, w.n, w.k, arch=arch_for_atom(w.atom), served_only=False) if route is None
             else routes.as_route(route))
        if r.kernel != routes.TILED or r.format != w.fmt:
            ent.plans[key] = False
            return None
        plan = ent.plans[key] = _sm80_launch(r, m, w, x.device, stream, pdl=True)   # FP32 scale: _eager_weight
    elif plan is False:
        return None
    if bias is None:
        bias_ptr = 0
    else:
        b = (bias if bias.dtype == torch.float16 and bias.is_contiguous() and bias.numel() == w.n
             and bias.get_device() == ent.device else _bias16(bias, w.n, x.device))
        bias_ptr = b.data_ptr()
    y = x.new_empty((m, w.n))
    with _eager_lock:   # the argument block is shared by the calls of one plan
        plan.run(x.data_ptr(), y.data_ptr(), bias_ptr)
    return y
