"""sm_80+ (m16n8k16) launch planning, apart from the SM70 serving path (ops): the configured kernels
parsed from csrc/qpn_kernels_sm80.cu, the split-K partition of a layer's work into runs, the
shared-memory fallback, programmatic dependent launch (sm_90+), one launch with everything but x,
y and bias resolved (``Launch``), and the eager launch cache that reuses those launches call
after call. Which kernel serves which route is data, in sm80_tables.
"""
from __future__ import annotations

import ctypes
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from . import families, formats, jit, routes, sm80_tables
from .atoms import arch_for_atom
from .kernel_inputs import THREADS, WARPS, WeightOperands, bias16, fp16_activations, fp32_scale, kernel_member, operands
from .routes import Route
from .weight_format import KernelEntry


@dataclass(frozen=True)
class Sm80Kernel:
    """One configured kernel of csrc/qpn_kernels_sm80.cu (its family's entry, SM80_ENTRY_MACROS)."""
    name: str
    frag: str      # fragment decoder struct
    mt: int        # 8-token tiles per weight pass
    tiles: int     # 16-row weight tiles per warp (T)
    depth: int     # weight-load ring depth in k-blocks (D)
    prefetch: int  # L2 prefetch distance in k-blocks beyond the ring (PF)
    variant: int   # Qpn80's VAR (qpn_kernels_sm80.cu): 0 the kernel, 7 its PDL form, others measured variants
    stages: int = 0     # shared-memory ring slots per warp (QPN80R_ENTRY); 0: the register ring
    min_blocks: int = 2  # blocks of SM80_THREADS per SM its register cap is sized for
    x_global: bool = False  # ring kernel reading the activations from global memory (QPN80RX_ENTRY)
    coop: bool = False  # block-cooperative (QPN80C_ENTRY): the split-K partition counts blocks, not warps
    band: bool = False  # M-band (QPN80B_ENTRY): blocks of 8 warps on 8 x T tiles, activations shared per block

    @property
    def weight_format(self) -> formats.WeightFormat:
        """The format family the kernel decodes (from its fragment decoder, sm80_tables.SM80_FRAGMENTS)."""
        for prefix, f in sm80_tables.SM80_FRAGMENTS.items():
            if self.frag.startswith(prefix):
                return f
        raise ValueError(f"kernel {self.name}: unknown fragment decoder {self.frag!r}; "
                         f"known: {', '.join(sm80_tables.SM80_FRAGMENTS)} (sm80_tables.SM80_FRAGMENTS)")

    @property
    def fmt(self) -> str:
        """The kernel family's name (its WeightFormat.family)."""
        return self.weight_format.family

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block of 256 threads (Qpn80Band: S slots of MT x 1 KB of
        activations, and of the 8 warps' weight tiles when its register ring depth is 0; Qpn80Ring:
        8 warps x S slots x STAGE;
        a slot holds the codes and group scales of a 16-row x 64-input block per weight tile, and
        1 KB of activations per token tile unless the kernel reads them from global memory)."""
        if not self.stages:
            return 0
        f = self.weight_format
        tile_block = 16 * f.code_cols(64) + 16 * (f.group_scale_cols(64) or 0)
        if self.band:   # one ring per block: S slots of MT x 1 KB, plus 8 warps' tiles when depth = 0
            return self.stages * (self.mt * 1024 + (8 * self.tiles * tile_block if self.depth == 0 else 0))
        stage = self.tiles * tile_block + (0 if self.x_global else self.mt * 1024)
        return 8 * self.stages * stage


# The numeric fields of each kernel-defining macro of the sm_80+ source, in order (the first two
# arguments are always the name and the fragment decoder), and the fields the macro fixes.
SM80_ENTRY_MACROS = {
    "QPN80_ENTRY": (("mt", "tiles", "depth", "prefetch", "variant"), {}),
    "QPN80M_ENTRY": (("mt", "tiles", "depth", "prefetch", "min_blocks", "variant"), {}),
    "QPN80C_ENTRY": (("mt", "tiles", "depth", "min_blocks", "variant"), {"coop": True}),
    "QPN80R_ENTRY": (("mt", "tiles", "stages", "min_blocks", "variant"), {}),
    "QPN80RX_ENTRY": (("mt", "tiles", "stages", "min_blocks", "variant"), {"x_global": True}),
    "QPN80B_ENTRY": (("mt", "tiles", "depth", "stages", "min_blocks", "variant"), {"band": True}),
}


def sm80_kernel_of(entry: KernelEntry) -> Optional[Sm80Kernel]:
    """The configured GEMM kernel an entry of the sm_80+ source defines (None for a macro not in
    SM80_ENTRY_MACROS: the reconstruct passes); QpnBuildError for a wrong argument count."""
    if entry.macro not in SM80_ENTRY_MACROS:
        return None
    fields, fixed = SM80_ENTRY_MACROS[entry.macro]
    if len(entry.args) != len(fields):
        raise jit.QpnBuildError(f"{entry.macro}({entry.name}, ...) has {len(entry.args)} numeric arguments; "
                                f"sm80_plan.SM80_ENTRY_MACROS expects {len(fields)} ({', '.join(fields)})")
    return Sm80Kernel(entry.name, entry.decoder, **{"depth": 0, "prefetch": 0, **dict(zip(fields, entry.args)), **fixed})


def sm80_kernels() -> dict[str, Sm80Kernel]:
    """Every configured GEMM kernel of the sm_80+ source: the families' entries
    (sm80_tables.SM80_ENTRIES, the lines jit.sm80_entry_lines writes) with one of SM80_ENTRY_MACROS."""
    return {e.name: k for e in sm80_tables.SM80_ENTRIES if (k := sm80_kernel_of(e)) is not None}


# cuLaunchKernelEx's launch description (cuda.h CUlaunchConfig / CUlaunchAttribute; the attribute's
# value is a 64-byte union, of which PDL uses the first int).
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int)]


class LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttrValue)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttr)), ("nattrs", ctypes.c_uint)]


PDL_ATTR = LaunchAttr()
PDL_ATTR.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
PDL_ATTR.value.i = 1


def pdl_config(grid: int, block: int, smem: int, stream: int) -> LaunchConfig:
    """A launch with programmatic dependent launch: the kernel may start while the stream's previous
    kernel finishes. Only for kernels that wait (griddepcontrol.wait) before touching anything
    another kernel may write -- the *_pdl forms of the sm_80+ route kernels."""
    return LaunchConfig(grid, 1, 1, block, 1, 1, smem, stream, ctypes.pointer(PDL_ATTR), 1)


def launch_raw_pdl(func, config: LaunchConfig, params, name: str = "") -> None:
    """cuLaunchKernelEx of a resolved function with a prebuilt ``pdl_config`` and parameter array."""
    lib = jit.driver().lib
    rc = lib.cuLaunchKernelEx(ctypes.byref(config), func, params, None)
    if rc:
        jit.driver().check(rc, f"cuLaunchKernelEx({name or 'prebuilt QPN launch'}, programmatic dependent launch)")


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


def sm80_no_smem_kernel(name: str) -> Optional[str]:
    """The register-ring kernel (sm80_tables.SM80_ROUTE_KERNELS_NO_SMEM) of the route whose
    shared-memory ring kernel is ``name``; None when no route table names ``name``."""
    fallback = {v: sm80_tables.SM80_ROUTE_KERNELS_NO_SMEM[k]
                for table in (sm80_tables.SM80_ROUTE_KERNELS, sm80_tables.SM80_LARGE_N_KERNELS)
                for k, v in table.items()}
    return fallback.get(name)


def _sm80_plan(mod, name: str, fmt: formats.WeightFormat, n: int, kblocks: int, chunks: int, device) -> tuple:
    """(kernel name, grid, nwarps, n_groups, partial floats per run, dynamic shared memory bytes,
    counters per weight group and chunk) for one kernel and layer shape. A shared-memory ring kernel
    whose ring does not fit a block on this GPU is replaced by the register-ring kernel of the same
    route (sm80_tables.SM80_ROUTE_KERNELS_NO_SMEM). An M-band kernel's run is a block whose 8 warps
    hold different tiles of its group: each warp has its own partial slots and counter (8 of each)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    min_items = sm80_tables.SM80_MIN_ITEMS[fmt]
    key = (idx, name, n, kblocks, chunks, min_items)
    plan = _sm80_plans.get(key)
    if plan is None:
        kernels = sm80_kernels()
        cfg = kernels[name]
        if cfg.smem_bytes > _smem_optin(idx):
            fallback = sm80_no_smem_kernel(name)
            if fallback is None:
                raise ValueError(f"kernel {name} needs {cfg.smem_bytes} bytes of shared memory per block; "
                                 f"cuda:{idx} allows {_smem_optin(idx)}")
            cfg = kernels[fallback]
        smem = cfg.smem_bytes
        if smem > 48 * 1024:
            jit.allow_dynamic_smem(mod, cfg.name, smem)
        resident_warps = jit.sm_count(idx) * jit.occupancy(mod, cfg.name, THREADS, smem) * WARPS
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


def sm80_kernel_for(route: Route, m: int, n: int = 0,
                     member: Optional[formats.WeightFormat] = None) -> tuple[str, int]:
    """(kernel name, chunks) serving a tiled route on the m16n8k16 atom for a layer of n rows. The
    *_chunked route runs an M-band kernel where sm80_tables.SM80_BAND_KERNELS lists one for the
    format (one weight pass per 8 x MT rows), else the MT = 2 kernel once per 16-row chunk. ``member``:
    the format member whose kernels run (kernel_member; default the route family's); a format not
    served yet finds its kernels in sm80_tables.SM80_UNSERVED_ROUTE_KERNELS."""
    route.check_m(m)
    key = (member or route.weight_format, route.tiles_per_pass)
    if route.chunk_rows and route.weight_format in sm80_tables.SM80_BAND_KERNELS:
        bands = sm80_tables.SM80_BAND_KERNELS[route.weight_format]
        name = next((k for k in bands if routes.TILE_ROWS * sm80_config(k).mt >= m), bands[-1])
    elif key in sm80_tables.SM80_LARGE_N_KERNELS and n >= sm80_tables.SM80_LARGE_N[key[0]]:
        name = sm80_tables.SM80_LARGE_N_KERNELS[key]
    else:
        name = sm80_tables.SM80_ROUTE_KERNELS.get(key) or sm80_tables.SM80_UNSERVED_ROUTE_KERNELS[key]
    return name, sm80_chunks(route, m, sm80_config(name))


_sm80_configs: dict = {}


def sm80_config(name: str) -> Sm80Kernel:
    """sm80_kernels()[name], parsed once per kernel: the parse reads every csrc/ file, and a
    launch path that plans on each call (the custom op's) must not pay that per call."""
    cfg = _sm80_configs.get(name)
    if cfg is None:
        cfg = _sm80_configs[name] = sm80_kernels()[name]
    return cfg


def sm80_chunks(route: Route, m: int, cfg: Sm80Kernel) -> int:
    """Grid planes of a launch: a chunked route cuts M into chunks of the kernel's 8 x MT rows (the
    M-band kernel: 64; an MT = 2 kernel: 16, how the route ran before the band kernel); else 1."""
    return -(-m // (routes.TILE_ROWS * cfg.mt)) if route.chunk_rows else 1


# Programmatic dependent launch (sm_90+): a route kernel's *_pdl form, launched with the PDL
# attribute, fills its weight ring while the stream's previous kernel finishes, and waits for that
# kernel before it reads x or touches y and the split-K scratch. Which route kernels take it, and
# the measurements behind the choice: sm80_tables.SM80_PDL_KERNELS. QPN_PDL=0 turns it off.
PDL_ENV = "QPN_PDL"
pdl_capable: dict = {}   # device index -> sm_90+ and a driver with cuLaunchKernelEx
pdl_names: dict = {}     # route kernel -> its *_pdl form where SM80_PDL_KERNELS lists it, else None


def pdl_enabled() -> bool:
    return env_switch(PDL_ENV, True, "launch the sm_90+ route kernels with programmatic dependent launch",
                      "plain launches")


def pdl_form(name: str, idx: int) -> Optional[str]:
    """The *_pdl form of route kernel ``name`` when launches on cuda:``idx`` should use it."""
    if not pdl_enabled():
        return None
    ok = pdl_capable.get(idx)
    if ok is None:
        ok = pdl_capable[idx] = (torch.cuda.get_device_capability(idx) >= (9, 0)
                                  and jit.driver().has_launch_ex)
    if not ok:
        return None
    if name not in pdl_names:   # parsing the kernel source is far dearer than a launch: once per kernel
        cfg = sm80_kernels().get(name + "_pdl")
        pdl_names[name] = (cfg.name if name in sm80_tables.SM80_PDL_KERNELS and cfg is not None and cfg.variant == 7
                            else None)
    return pdl_names[name]


class Launch:
    """One tiled-route launch with everything but the activations, the output and the bias
    resolved: kernel function, grid, shared memory, stream and the argument block (weight, scale
    and split-K scratch pointers, shape). ``run`` writes x, y and bias into the block and calls
    cuLaunchKernel (cuLaunchKernelEx for a *_pdl kernel), which copies the block: the same
    Launch serves call after call."""
    __slots__ = ("func", "grid", "smem", "stream", "args", "params", "keep", "pdl")

    def __init__(self, func, grid: int, smem: int, stream: int, args: ctypes.Structure, keep: tuple,
                 pdl: bool = False):
        self.func, self.grid, self.smem, self.stream, self.args = func, grid, smem, stream, args
        self.params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self.keep = keep  # tensors whose pointers the block holds (scale copy, split-K scratch)
        self.pdl = pdl_config(grid, THREADS, smem, stream) if pdl else None

    def run(self, x_ptr: int, y_ptr: int, bias_ptr: int) -> None:
        a = self.args
        a.x, a.y, a.bias = x_ptr, y_ptr, bias_ptr
        if self.pdl is not None:
            launch_raw_pdl(self.func, self.pdl, self.params)
        else:
            jit.launch_raw(self.func, self.grid, THREADS, self.smem, self.stream, self.params)


def _sm80_launch(route: Route, m: int, w: WeightOperands, device, stream: int,
                 kernel: Optional[str] = None, pdl: bool = False) -> Launch:
    """The Launch of a tiled route on the m16n8k16 atom for a batch of ``m`` (>= 1) rows on
    ``stream``; ``w.chscale`` must already be the flat FP32 scale (``fp32_scale``). ``pdl``: the
    caller vouches that no kernel of this call wrote the weight's tensors (a *_pdl kernel reads
    them before it waits for the previous kernel), so the route's *_pdl form may serve it."""
    member, group_shift = kernel_member(w)
    name, chunks = sm80_kernel_for(route, m, w.n, member)
    if kernel is not None:  # another kernel of the same token tiling (benchmarks only)
        cfg = sm80_kernels().get(kernel)
        # a chunked route takes any kernel of two or more token tiles (chunks follow its MT)
        fits = cfg is not None and (cfg.mt >= 2 if route.chunk_rows else cfg.mt == sm80_config(name).mt)
        if not fits or cfg.weight_format != member:
            raise ValueError(f"kernel {kernel!r} cannot serve route {route} ({w.fmt}, M={m})")
        name, chunks = kernel, sm80_chunks(route, m, cfg)
    mod = jit.module_for(device, "m16n8k16")
    kblocks = w.k_pad // 64
    name, grid, nwarps, n_groups, per_run, smem, planes = _sm80_plan(mod, name, w.format, w.n, kblocks, chunks,
                                                                     device)
    pdl_name = pdl_form(name, device.index if device.index is not None else torch.cuda.current_device()) \
        if pdl and kernel is None else None
    if pdl_name is not None:
        name, grid, nwarps, n_groups, per_run, smem, planes = _sm80_plan(mod, pdl_name, w.format, w.n, kblocks,
                                                                         chunks, device)
    partials, counters = _sm80_buffers(device, stream, chunks * nwarps * per_run, chunks * planes * n_groups)
    a = Qpn80Args(w.codes.data_ptr(), w.scales.data_ptr() if w.scales is not None else 0, w.chscale.data_ptr(),
                  0, 0, 0, partials.data_ptr(), counters.data_ptr(),
                  m, w.n, kblocks, w.k_pad, n_groups, nwarps, chunks, int(w.chscale.numel() != 1), group_shift)
    return Launch(mod.function(name), grid, smem, stream, a, (w.codes, w.scales, w.chscale, partials, counters),
                   pdl=pdl_name is not None)


def launch_sm80(route: Route, xh: torch.Tensor, w: WeightOperands, bias,
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
    w = fp32_scale(operands(packed))
    x2 = x.reshape(-1, packed.k)
    route = routes.as_route(route) if route is not None else routes.route_for(
        w.fmt, x2.shape[0], packed.n, packed.k, arch="sm80")
    return launch_sm80(route, fp16_activations(x2, w.k, w.k_pad), w, None, kernel)


# ------------------------------------------------------------------- eager launch cache (sm_80+)
# The eager call's host time is the Python launch path, not the kernel (issue 14: 42 us per
# qpn_linear call against 15.6 us for torch's x @ w.t() on the H200's host). For the common case
# -- a tiled route on the m16n8k16 atom, FP16 contiguous 16-byte-aligned activations, K already a
# whole number of k-blocks, an FP32 result scale -- everything but x, y and bias is resolved once
# per (weight, M, route, device, stream) into a Launch and reused. Any other call takes the
# general path, which is also how a Launch is first built, so both run the same code.
eager_weights: dict = {}   # id(packed) -> _EagerWeight (dropped when the packed weight is freed)
_eager_lock = threading.Lock()
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _EagerWeight:
    """A packed weight's cached launches, with the tensors they point at (checked by identity on
    every call, so a weight whose tensors are replaced is re-planned)."""
    __slots__ = ("ref", "source", "format", "device", "w", "plans")

    def __init__(self, packed, source: WeightOperands, w: WeightOperands, device: int):
        self.ref = weakref.ref(packed, lambda _, key=id(packed), table=eager_weights: table.pop(key, None))
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
    return _EagerWeight(packed, w, fp32_scale(w), w.codes.get_device())


def same_tensor(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """The same bytes as the tensor a plan was built on. Not identity alone: a family may hand out
    its tensors as a fresh view per call (INT4's records, viewed as one integer per record), and
    an identity test would then re-plan every call. The plan's entry holds the tensor it was built
    on, so no other live tensor can have its address, shape and dtype unless it views the same bytes."""
    if a is b:
        return True
    return (a is not None and b is not None and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride())


def eager_tiled(x: torch.Tensor, packed, route, bias) -> Optional[torch.Tensor]:
    """qpn_linear for an FP16 2-D CUDA x through a cached Launch, or None when the general path
    must serve the call (another atom or route kind, a weight whose tensors were replaced,
    activations that need conversion or padding, M = 0)."""
    ent = eager_weights.get(id(packed))
    if ent is None or ent.ref() is not packed:
        ent = _eager_weight(packed)
        if ent is None:
            return None
        eager_weights[id(packed)] = ent
    w = ent.w
    codes, scales, chscale = ent.source
    now_codes, now_scales, now_chscale = families.numerics(ent.format).packed_tensors(packed)
    if not (same_tensor(now_codes, codes) and same_tensor(now_scales, scales)
            and same_tensor(now_chscale, chscale)):
        eager_weights.pop(id(packed), None)   # the weight's tensors were replaced: plan again next call
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
             and bias.get_device() == ent.device else bias16(bias, w.n, x.device))
        bias_ptr = b.data_ptr()
    y = x.new_empty((m, w.n))
    with _eager_lock:   # the argument block is shared by the calls of one plan
        plan.run(x.data_ptr(), y.data_ptr(), bias_ptr)
    return y
