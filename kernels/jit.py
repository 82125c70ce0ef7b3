"""Run-time build of the QPN kernels: NVRTC -> cubin (cached on disk), loaded and launched through
the CUDA driver API on torch's current stream.

* Cache: ``$QPN_CACHE_DIR`` or ``~/.cache/qpn``; one cubin per (hash of every file in csrc/,
  architecture, compile flags, NVRTC version). A changed source or flag is a new file; nothing
  stale is ever loaded.
* Driver API through ctypes on ``libcuda.so.1`` (cuModuleLoadData, cuModuleGetFunction,
  cuLaunchKernel): the same symbols cuda-python's ``cuda.bindings.driver`` wraps, without tying
  this package to one binding version per CUDA major. Launches go to the stream torch is using,
  so they order with torch's own work and are captured by CUDA graphs.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import threading
from dataclasses import dataclass

from . import formats, nvrtc

COMPILE_FLAGS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=true")
# Every kernel entry point the family must export, per atom (each format family's dense entry
# points, from kernels/formats.py; on m16n8k16 also the configured kernels the tables below name).
# ops.build() fails naming any that is missing.
ENTRY_POINTS = {atom: tuple(e for f in formats.FAMILIES.values() for e in f.dense_entry_points(atom))
                for atom in ("m8n8k4", "m16n8k16")}
# The kernels of formats that have them but are not served yet (formats.INT4 / INT4_SYM): built,
# loaded and checked with the rest (check_entry_points, sm70_check), run by ops, but kept out of
# ENTRY_POINTS, which the served tools (benchmarks/perf_model.py) read as what they model.
UNSERVED_ENTRY_POINTS = {atom: tuple(dict.fromkeys(e for f in formats.KERNEL_FORMATS if not f.served
                                                   for e in f.dense_entry_points(atom)))
                         for atom in ("m8n8k4", "m16n8k16")}
MAIN_SOURCE = "qpn_kernels.cu"
# The dense QPN family, one source per tensor-core atom (the m16n8k16 source needs sm_80+).
ATOM_SOURCES = {"m8n8k4": MAIN_SOURCE, "m16n8k16": "qpn_kernels_sm80.cu"}
ATOM_MIN_ARCH = {"m8n8k4": 70, "m16n8k16": 80}

# sm_80+ (m16n8k16): which configured kernel of csrc/qpn_kernels_sm80.cu serves each packed route,
# by (the format family's WeightFormat, formats.FAMILIES; token tiles per weight pass). Chosen on
# the H200 among the spill-free configurations (benchmarks/kernel_matched_bench.py --sweep); a
# change here needs no recompilation.
# (H200 sweeps 2026-11-30, results/kernel_sm80_ring_sweep_h200_20261130.csv (TP1 shapes) and
# results/kernel_sm80_ring3_sweep_h200_20261130.csv (FP8, down, TP4 down, after the batched split-K
# finish): the register ring t2d4p0 is best for NVFP4 M <= 8 on every measured shape except the
# largest, lm_head (248320 rows), where the shared-memory ring t4s4 reads at 63% of the ceiling
# against 58% (SM80_LARGE_N_KERNELS); NVFP4 M 9-16 goes to the ring t2s4x; FP8 stays on the
# register ring, which the FP8 ring kernels do not beat -- results/kernel_sm80_ring_notes_h200_20261130.md.
# Run 6 (results/kernel_sm80_fp8swizzle_sweep_h200_20261130.csv): once the FP8 ring's copies were
# coalesced (chunk_pos in the .cu), the ring t2s3x has the best mean for FP8 M 9-16: in_proj 57.8%
# vs 53.0% for the register t1d4p0, out_proj 36.8% vs 37.5%; FP8 M <= 8 stays on the register ring.)
_NVFP4, _FP8 = formats.FAMILIES["nvfp4"], formats.FAMILIES["fp8"]
SM80_ROUTE_KERNELS = {
    (_NVFP4, 1): "qpn2_mt1_m16n8k16_t2d4p0",
    (_NVFP4, 2): "qpn2_mt2_m16n8k16_t2s4x",
    (_FP8, 1): "qpn8_mt1_m16n8k16_t2d2c",
    (_FP8, 2): "qpn8_mt2_m16n8k16_t2s3x",
}
# (2026-12-01: FP8 M <= 8 moved from the per-warp register ring t2d2p0 to its block-cooperative
# form t2d2c, 3 points of the read ceiling faster on average over the TP1 FP8 shapes at M 1 and 8,
# results/kernel_sm80_coop2_sweep_h200_20261201.csv; see QPN80C_ENTRY in the .cu.)
# Layers with at least SM80_LARGE_N output rows (lm_head) use these instead, where listed.
# (2026-12-01, session 3: the NVFP4 operands lost their * 2^7 everywhere except in t4s4, where the
# unit-scale form t4s4_u measured 2% slower; see Frag16NVFP4Scaled in qpn_atom_m16n8k16.cuh.
# The threshold was 100,000 (TP1 lm_head only); two H200 sweeps of the same lease
# (results/kernel_sm80_depth{1,2}_sweep_h200_20261201.csv) put t4s4 7-10% ahead of t2d4p0 on TP4
# lm_head (62,080 rows: 64.5 / 66.0 against 69.3 / 73.0 us at M = 1 / 8), even with it on TP1
# gate_up (34,816 rows, its x 2^7 form t4s4_s7 in the 4a6d26c sweeps: 41.5 / 42.9 against 42.0 / 43.4
# us) and behind it on the smaller layers; hence 50,000.)
SM80_LARGE_N = 50_000
SM80_LARGE_N_KERNELS = {(_NVFP4, 1): "qpn2_mt1_m16n8k16_t4s4"}
# The *_chunked route (M 17-96) on sm_80+: the M-band kernels of a format family, by token tiles (MT)
# ascending; ops._sm80_kernel_for takes the first whose 8 x MT rows hold M, else the last: one weight
# pass per chunk of its 8 x MT rows. A family not listed (FP8) runs its (family, 2) kernel above once
# per 16-row chunk, as the route did before. H200 sweeps 2026-12-01
# (results/kernel_sm80_band_sweep_h200_20261201.csv, _sweep2_): NVFP4 1.3-1.7x faster than the
# 16-row chunks at M 17-64 on gate_up and down; the FP8 band forms tie on in_proj and lose on out_proj
# (QPN80B_ENTRY in the .cu).
SM80_BAND_KERNELS = {
    _NVFP4: ("qpn2_mt4_m16n8k16_t1d4s4_b2", "qpn2_mt8_m16n8k16_t1d2s4_b2"),
}
# Route kernels whose *_pdl form (VAR 7) ops launches with programmatic dependent launch on sm_90+
# (ops._pdl_form): every mt1 kernel and the FP8 mt2 ring. Called back to back, they are 1.5-4.5 us
# faster per call (graph replay) on every H200 shape at M 1-8 and on all four FP8 shapes at M 16,
# against the same kernels launched plainly in the same run
# (results/kernel_matched_sm80_pdlfp8_h200_20261201.csv, qpn vs qpn_plain; the block-cooperative
# FP8 M <= 8 kernel since: 1.6-2.8 us, results/kernel_matched_sm80_readlimit_h200_20261201.csv); in
# a model's MLP block, torch kernels between, no measurable change (docs/architecture.md). The NVFP4 mt2 ring
# stays on plain launches (slower with PDL on the small layers: down 33.8 -> 34.2 us, TP4 down
# 17.9 -> 19.0 us; results/kernel_sm80_pdl_notes_h200_20261201.md).
SM80_PDL_KERNELS = frozenset({SM80_ROUTE_KERNELS[_NVFP4, 1], SM80_LARGE_N_KERNELS[_NVFP4, 1],
                              SM80_ROUTE_KERNELS[_FP8, 1], SM80_ROUTE_KERNELS[_FP8, 2]})
# The register-ring kernels (no shared memory) serve a route when the GPU cannot give a block the
# ring kernel's shared memory (sm_86 / sm_89 allow about 99 KB per block).
SM80_ROUTE_KERNELS_NO_SMEM = {
    (_NVFP4, 1): "qpn2_mt1_m16n8k16_t2d4p0",
    (_NVFP4, 2): "qpn2_mt2_m16n8k16_t1d4p8",
    (_FP8, 1): "qpn8_mt1_m16n8k16_t2d2c",   # 16 KB of static shared memory: fits every sm_80+ GPU
    (_FP8, 2): "qpn8_mt2_m16n8k16_t1d4p0",
}
# The route kernels of the formats with kernels but no served route yet (formats.INT4 / INT4_SYM),
# by (format MEMBER, token tiles per weight pass): the two members of the INT4 family have different
# kernels (formats.WeightFormat.kernel_tag), so ops looks them up by the member kernel_member names.
# Kept out of SM80_ROUTE_KERNELS, which the served tools (benchmarks, route checks) read as the
# served set. The register ring in the NVFP4 routes' configurations (M <= 8: t2d4p0; M 9-16 and,
# once per 16-row chunk, the chunked route: t1d4p0, the NVFP4 register-ring M 9-16 form); no H200
# sweep has chosen them yet.
_INT4, _INT4_SYM = formats.INT4, formats.INT4_SYM
SM80_UNSERVED_ROUTE_KERNELS = {
    (_INT4, 1): "qpn4_mt1_m16n8k16_t2d4p0",
    (_INT4, 2): "qpn4_mt2_m16n8k16_t1d4p0",
    (_INT4_SYM, 1): "qpn4_sym_mt1_m16n8k16_t2d4p0",
    (_INT4_SYM, 2): "qpn4_sym_mt2_m16n8k16_t1d4p0",
}
# Fewest work items (k-blocks of one weight group) per warp, per format (family member): below about
# the ring depth a warp spends its time filling the ring and reducing, so small layers get fewer,
# longer runs (ops.sm80_partition). INT4 as NVFP4, whose ring depth its kernels share.
SM80_MIN_ITEMS = {_NVFP4: 4, _FP8: 2, _INT4: 4, _INT4_SYM: 4}
# The fragment decoder each format's kernels are configured with (QPN80*_ENTRY's second field starts
# with it; no key is the start of another).
SM80_FRAGMENTS = {"Frag16NVFP4": _NVFP4, "Frag16FP8": _FP8, "Frag16INT4Asym": _INT4, "Frag16INT4Sym": _INT4_SYM}
ENTRY_POINTS["m16n8k16"] = tuple(dict.fromkeys(list(SM80_ROUTE_KERNELS.values())
                                               + list(SM80_LARGE_N_KERNELS.values())
                                               + list(SM80_ROUTE_KERNELS_NO_SMEM.values())
                                               + [k for ks in SM80_BAND_KERNELS.values() for k in ks])
                                 ) + ENTRY_POINTS["m16n8k16"]
UNSERVED_ENTRY_POINTS["m16n8k16"] = tuple(dict.fromkeys(list(SM80_UNSERVED_ROUTE_KERNELS.values())
                                                        + list(UNSERVED_ENTRY_POINTS["m16n8k16"])))


@dataclass(frozen=True)
class Sm80Kernel:
    """One configured kernel of csrc/qpn_kernels_sm80.cu (its entry line, SM80_ENTRY_MACROS)."""
    name: str
    frag: str      # fragment decoder struct
    mt: int        # 8-token tiles per weight pass
    tiles: int     # 16-row weight tiles per warp (T)
    depth: int     # weight-load ring depth in k-blocks (D)
    prefetch: int  # L2 prefetch distance in k-blocks beyond the ring (PF)
    variant: int   # 0: the kernel; 1-3: a measured variant with one stage dropped
    stages: int = 0     # shared-memory ring slots per warp (QPN80R_ENTRY); 0: the register ring
    min_blocks: int = 2  # blocks of SM80_THREADS per SM its register cap is sized for
    x_global: bool = False  # ring kernel reading the activations from global memory (QPN80RX_ENTRY)
    coop: bool = False  # block-cooperative (QPN80C_ENTRY): the split-K partition counts blocks, not warps
    band: bool = False  # M-band (QPN80B_ENTRY): blocks of 8 warps on 8 x T tiles, activations shared per block

    @property
    def weight_format(self) -> formats.WeightFormat:
        """The format family the kernel decodes (from its fragment decoder, SM80_FRAGMENTS)."""
        for prefix, f in SM80_FRAGMENTS.items():
            if self.frag.startswith(prefix):
                return f
        raise ValueError(f"kernel {self.name}: unknown fragment decoder {self.frag!r}; "
                         f"known: {', '.join(SM80_FRAGMENTS)} (jit.SM80_FRAGMENTS)")

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


def sm80_kernels() -> dict[str, Sm80Kernel]:
    """Every kernel the sm_80+ source defines with one of SM80_ENTRY_MACROS, parsed from the source
    itself."""
    src = nvrtc.read_sources()[ATOM_SOURCES["m16n8k16"]]
    out = {}
    for m in re.finditer(r"^(QPN80\w*_ENTRY)\((\w+),\s*(\w+),\s*([\d,\s]+)\)", src, re.M):
        macro, name, frag, nums = m.groups()
        if macro not in SM80_ENTRY_MACROS:
            continue   # QPN80_RECONSTRUCT_ENTRY: not a configured GEMM kernel
        fields, fixed = SM80_ENTRY_MACROS[macro]
        values = [int(v) for v in nums.split(",")]
        if len(values) != len(fields):
            raise QpnBuildError(f"{macro}({name}, ...) has {len(values)} numeric arguments; "
                                f"jit.SM80_ENTRY_MACROS expects {len(fields)} ({', '.join(fields)})")
        out[name] = Sm80Kernel(name, frag, **{"depth": 0, "prefetch": 0, **dict(zip(fields, values)), **fixed})
    return out


class QpnBuildError(RuntimeError):
    """The kernels could not be built or lack an expected entry point."""


def cache_dir() -> str:
    d = os.environ.get("QPN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qpn")
    os.makedirs(d, exist_ok=True)
    return d


def source_hash() -> str:
    h = hashlib.sha256()
    for name, text in nvrtc.read_sources().items():
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def arch_number(arch) -> int:
    """'sm70' / 'sm_70' / 70 -> 70."""
    if isinstance(arch, int):
        return arch
    s = str(arch).lower().replace("sm_", "").replace("sm", "").replace("compute_", "")
    if not s.isdigit():
        raise ValueError(f"architecture must look like 'sm70', 'sm_90' or 70; got {arch!r}")
    return int(s)


def nvrtc_for_arch(arch: int) -> nvrtc.Nvrtc:
    # CUDA 13 cannot target sm_70/72; prefer NVRTC 12 there, any NVRTC that lists the arch otherwise.
    if arch < 75:
        return nvrtc.load_nvrtc(12, arch)
    try:
        return nvrtc.load_nvrtc(None, arch)
    except nvrtc.NvrtcUnavailable:
        return nvrtc.load_nvrtc(12, arch)


def compile_cubin(arch, use_cache: bool = True, source: str = MAIN_SOURCE) -> tuple[bytes, str]:
    """Compile csrc/<source> (default qpn_kernels.cu) for sm_<arch>; returns (cubin, path of the
    cached file)."""
    a = arch_number(arch)
    for atom, src_name in ATOM_SOURCES.items():
        if source == src_name and a < ATOM_MIN_ARCH[atom]:
            raise QpnBuildError(f"{source} holds the {atom} kernels, which need sm_{ATOM_MIN_ARCH[atom]} "
                                f"or later; asked for sm_{a}")
    nv = nvrtc_for_arch(a)
    tag = "" if source == MAIN_SOURCE else "|" + source  # the dense SM70 family keeps its old keys
    key = hashlib.sha256(
        f"{source_hash()}{tag}|sm_{a}|{' '.join(COMPILE_FLAGS)}|nvrtc{nv.version}".encode()).hexdigest()[:32]
    stem = "qpn" if source == MAIN_SOURCE else "qpn_" + os.path.splitext(source)[0].replace("qpn_kernels_", "")
    path = os.path.join(cache_dir(), f"{stem}_sm{a}_{key}.cubin")
    if use_cache and os.path.exists(path):
        with open(path, "rb") as f:
            return f.read(), path
    src = nvrtc.read_sources()[source]
    res = nv.compile(src, source, a, list(COMPILE_FLAGS), want_cubin=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(res.cubin)
    os.replace(tmp, path)
    return res.cubin, path


def check_entry_points(cubin: bytes, atom: str = "m8n8k4") -> None:
    """Raise QpnBuildError naming the first expected kernel symbol absent from the cubin."""
    for name in ENTRY_POINTS[atom] + UNSERVED_ENTRY_POINTS[atom]:
        if name.encode() + b"\0" not in cubin:
            raise QpnBuildError(f"built QPN module lacks the entry point {name!r} (atom {atom}); "
                                "the csrc/ sources and jit.ENTRY_POINTS disagree")


# ------------------------------------------------------------------------------ driver API
class _Driver:
    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise QpnBuildError(f"cannot load the CUDA driver (libcuda.so.1): {e}; "
                                "a QPN kernel needs an NVIDIA driver (on CPU, qpn_linear uses the reference)") from e
        L = self.lib
        L.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        L.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        L.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        L.cuLaunchKernel.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                     ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                     ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        L.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        # CUDA 12.0+ drivers; older ones lack it, and the library then never asks for PDL
        self.has_launch_ex = hasattr(L, "cuLaunchKernelEx")
        if self.has_launch_ex:
            L.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            L.cuLaunchKernelEx.restype = ctypes.c_int

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(s))
            raise QpnBuildError(f"{what} failed: CUDA driver error {rc} ({(s.value or b'?').decode()})")


_driver: _Driver | None = None
_modules: dict = {}
_lock = threading.Lock()


def driver() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


class LoadedModule:
    def __init__(self, cubin: bytes, path: str, arch: int):
        d = driver()
        self.arch, self.path = arch, path
        self._cubin = cubin  # keep the image alive for the driver
        self.handle = ctypes.c_void_p()
        d.check(d.lib.cuModuleLoadData(ctypes.byref(self.handle), cubin), f"cuModuleLoadData({path})")
        self.functions: dict[str, ctypes.c_void_p] = {}

    def function(self, name: str) -> ctypes.c_void_p:
        f = self.functions.get(name)
        if f is None:
            d = driver()
            f = ctypes.c_void_p()
            d.check(d.lib.cuModuleGetFunction(ctypes.byref(f), self.handle, name.encode()),
                    f"cuModuleGetFunction({name})")
            self.functions[name] = f
        return f


def module_for(device, atom: str = "m8n8k4") -> LoadedModule:
    """The QPN module of ``atom``'s kernels loaded into torch's context on ``device`` (compiled for
    its architecture)."""
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = idx if atom == "m8n8k4" else (idx, atom)
    m = _modules.get(key)
    if m is not None:
        return m
    if atom not in ATOM_SOURCES:
        raise ValueError(f"unknown MMA atom {atom!r}; known atoms: {', '.join(ATOM_SOURCES)}")
    with _lock:
        m = _modules.get(key)
        if m is None:
            major, minor = torch.cuda.get_device_capability(idx)
            arch = major * 10 + minor
            if arch < ATOM_MIN_ARCH[atom]:
                raise QpnBuildError(
                    f"the {atom} kernels need sm_{ATOM_MIN_ARCH[atom]} or later, but cuda:{idx} is sm_{arch}; "
                    f"prepack this GPU's weights with atom={atoms_for_arch(arch)[-1]!r}")
            cubin, path = compile_cubin(arch, source=ATOM_SOURCES[atom])
            check_entry_points(cubin, atom)
            with torch.cuda.device(idx):
                torch.cuda.current_stream(idx).synchronize()  # makes torch's primary context current
                m = LoadedModule(cubin, path, arch)
                for name in ENTRY_POINTS[atom] + UNSERVED_ENTRY_POINTS[atom]:
                    m.function(name)
            _modules[key] = m
    return m


def atoms_for_arch(arch) -> tuple[str, ...]:
    """Atoms whose kernels build for ``arch``, the native one last (m8n8k4 builds everywhere,
    emulated on sm_80+)."""
    a = arch_number(arch)
    return tuple(atom for atom, lo in ATOM_MIN_ARCH.items() if a >= lo)


def occupancy(module: LoadedModule, name: str, block: int, smem: int = 0) -> int:
    """Blocks of ``block`` threads of kernel ``name`` one SM holds at once (the driver's answer)."""
    cache = module.__dict__.setdefault("_occupancy", {})
    key = (name, block, smem)
    v = cache.get(key)
    if v is None:
        d = driver()
        n = ctypes.c_int()
        L = d.lib
        L.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [
            ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        d.check(L.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), module.function(name), block, smem),
                f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})")
        v = cache[key] = max(1, n.value)
    return v


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


def max_smem_optin(device_index: int) -> int:
    """Largest dynamic shared memory one block may ask for on the device (after opting in)."""
    d = driver()
    v = ctypes.c_int()
    dev = ctypes.c_int()
    d.check(d.lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
    d.check(d.lib.cuDeviceGetAttribute(ctypes.byref(v), CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev),
            "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)")
    return v.value


def allow_dynamic_smem(module: LoadedModule, name: str, nbytes: int) -> None:
    """Opt kernel ``name`` in to ``nbytes`` of dynamic shared memory (needed above 48 KB); once per
    (kernel, size)."""
    done = module.__dict__.setdefault("_smem_optin", {})
    if done.get(name, -1) >= nbytes:
        return
    d = driver()
    d.check(d.lib.cuFuncSetAttribute(module.function(name), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     int(nbytes)), f"cuFuncSetAttribute({name}, dynamic shared memory {nbytes})")
    done[name] = nbytes


def launch(module: LoadedModule, name: str, grid: int, block: int, smem: int, stream: int,
           args: list) -> None:
    """cuLaunchKernel with args given as ctypes objects (kept alive for the call)."""
    # ctypes.addressof, not ctypes.cast(ctypes.pointer(a)): the cast was the largest single cost
    # of the eager call's host path (cProfile on the 2-core CPU host, 2026-11-30).
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    launch_raw(module.function(name), grid, block, smem, stream, params, name)


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
    lib = driver().lib
    rc = lib.cuLaunchKernelEx(ctypes.byref(config), func, params, None)
    if rc:
        driver().check(rc, f"cuLaunchKernelEx({name or 'prebuilt QPN launch'}, programmatic dependent launch)")


def launch_raw(func, grid: int, block: int, smem: int, stream: int, params, name: str = "") -> None:
    """cuLaunchKernel of a resolved function with a prebuilt parameter array (a ctypes array of
    pointers to the arguments); the driver copies the arguments before it returns."""
    lib = driver().lib
    rc = lib.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, smem, stream, params, None)
    if rc:
        driver().check(rc, f"cuLaunchKernel({name or 'prebuilt QPN launch'})")
