"""Run-time build of the QPN kernels: NVRTC -> cubin (cached on disk), loaded and launched through
the CUDA driver API on torch's current stream.

* Sources: the files in csrc/, as ``kernel_sources()`` hands them to NVRTC: the entry points of
  both atoms' dense sources are not listed in the files but written from data, the m8n8k4 ones
  from the formats' registered data (``sm70_entry_lines``), the m16n8k16 ones from the families'
  configured kernels (``sm80_entry_lines``), so a new weight family adds none by hand.
* Cache: ``$QPN_CACHE_DIR`` or ``~/.cache/qpn``; one cubin per (hash of every source as NVRTC
  compiles it, architecture, compile flags, NVRTC version). A changed source, entry line or flag is
  a new file; nothing stale is ever loaded.
* Driver API through ctypes on ``libcuda.so.1`` (cuModuleLoadData, cuModuleGetFunction,
  cuLaunchKernel): the same symbols cuda-python's ``cuda.bindings.driver`` wraps, without tying
  this package to one binding version per CUDA major. Launches go to the stream torch is using,
  so they order with torch's own work and are captured by CUDA graphs.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import threading

from . import formats, nvrtc, sm80_tables

COMPILE_FLAGS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=true")
# Every kernel entry point the family must export, per atom (each served format's dense entry
# points, from kernels/formats.py; on m16n8k16 also the configured kernels sm80_tables names).
# ops.build() fails naming any that is missing. Per member, not per family: INT4's two members have
# kernels of their own (kernel_tag), FP8's share theirs (dict.fromkeys keeps one of each name).
ENTRY_POINTS = {atom: tuple(dict.fromkeys(e for f in formats.WEIGHT_FORMATS for e in f.dense_entry_points(atom)))
                for atom in ("m8n8k4", "m16n8k16")}
# The kernels of formats that have them but are not served yet (formats.py, "Staging"): built,
# loaded and checked with the rest (check_entry_points, sm70_check), run by ops, but kept out of
# ENTRY_POINTS, which the served tools (benchmarks/perf_model.py) read as what they model.
UNSERVED_ENTRY_POINTS = {atom: tuple(dict.fromkeys(e for f in formats.KERNEL_FORMATS if not f.served
                                                   for e in f.dense_entry_points(atom)))
                         for atom in ("m8n8k4", "m16n8k16")}
MAIN_SOURCE = "qpn_kernels.cu"
# The grouped mixture-of-experts kernels, one source per atom (the sm_80+ file includes qpn_moe.cu
# for the routing and combine kernels and adds its own GEMM entries).
MOE_SOURCES = {"m8n8k4": "qpn_moe.cu", "m16n8k16": "qpn_moe_sm80.cu"}
# The dense QPN family, one source per tensor-core atom (the m16n8k16 source needs sm_80+).
ATOM_SOURCES = {"m8n8k4": MAIN_SOURCE, "m16n8k16": "qpn_kernels_sm80.cu"}
ATOM_MIN_ARCH = {"m8n8k4": 70, "m16n8k16": 80}

ENTRY_POINTS["m16n8k16"] = tuple(dict.fromkeys(list(sm80_tables.SM80_ROUTE_KERNELS.values())
                                               + list(sm80_tables.SM80_LARGE_N_KERNELS.values())
                                               + list(sm80_tables.SM80_ROUTE_KERNELS_NO_SMEM.values())
                                               + [k for ks in sm80_tables.SM80_BAND_KERNELS.values() for k in ks])
                                 ) + ENTRY_POINTS["m16n8k16"]
UNSERVED_ENTRY_POINTS["m16n8k16"] = tuple(dict.fromkeys(list(sm80_tables.SM80_UNSERVED_ROUTE_KERNELS.values())
                                                        + list(UNSERVED_ENTRY_POINTS["m16n8k16"])))


class QpnBuildError(RuntimeError):
    """The kernels could not be built or lack an expected entry point."""


def cache_dir() -> str:
    d = os.environ.get("QPN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qpn")
    os.makedirs(d, exist_ok=True)
    return d


# The CUDA struct of the m8n8k4 atom (csrc/qpn_family.cuh), which every generated entry line names.
SM70_ATOM_STRUCT = "AtomM8N8K4"


def sm70_entry_lines() -> str:
    """The entry-point lines of csrc/qpn_kernels.cu, one per dense m8n8k4 kernel the build requires
    (ENTRY_POINTS, then UNSERVED_ENTRY_POINTS), each with the decoder and token tiles its format
    registers (formats.WeightFormat.m8n8k4_kernels): QPN_LINEAR_ENTRY for the tiled kernels, then
    QPN_RECONSTRUCT_ENTRY for the reconstruction passes."""
    registered = {k.name: k for f in formats.KERNEL_FORMATS for k in f.m8n8k4_kernels()}
    lines = []
    # The order of the lines is the order of the kernels in the cubin; this one (served formats
    # first, GEMMs before the reconstruct passes) is the order of the list the file held by hand, so
    # the cubin stayed byte for byte what it was when the list became data.
    for names in (ENTRY_POINTS["m8n8k4"], UNSERVED_ENTRY_POINTS["m8n8k4"]):
        kernels = [registered[n] for n in names]
        lines += [f"QPN_LINEAR_ENTRY({k.name}, {SM70_ATOM_STRUCT}, {k.decoder}, {k.tiles})"
                  for k in kernels if k.tiles]
        lines += [f"QPN_RECONSTRUCT_ENTRY({k.name}, {SM70_ATOM_STRUCT}, {k.decoder})"
                  for k in kernels if not k.tiles]
    return "\n// Entry points written by kernels/jit.py (sm70_entry_lines) from kernels/formats.py:\n" + \
        "".join(line + "\n" for line in lines)


def sm80_entry_lines() -> str:
    """The entry-point lines of csrc/qpn_kernels_sm80.cu: every configured kernel the families list
    (kernels/families/<family>/kernels_sm80.py ENTRIES, gathered by sm80_tables.SM80_ENTRIES), in
    the families' order."""
    return ("\n// Entry points written by kernels/jit.py (sm80_entry_lines) from kernels/families/*/kernels_sm80.py:\n"
            + "".join(e.line + "\n" for e in sm80_tables.SM80_ENTRIES))


def moe_entry_lines(atom: str) -> str:
    """The grouped MoE GEMM entry lines of the atom's MoE source: on m8n8k4 from each served
    format's data (its MoE entry points, gate/up then down, and its decoder), on m16n8k16 the
    families' MOE_ENTRIES (sm80_tables.SM80_MOE_ENTRIES)."""
    if atom == "m8n8k4":
        lines = [f"QPN_MOE_GEMM_ENTRY({name}, {SM70_ATOM_STRUCT}, {f.decoder}, {gate_up})"
                 for f in formats.FAMILIES.values()
                 for name, gate_up in zip(f.moe_entry_points(atom), ("true", "false"))]
    else:
        lines = [e.line for e in sm80_tables.SM80_MOE_ENTRIES]
    return (f"\n// Entry points written by kernels/jit.py (moe_entry_lines, {atom}):\n"
            + "".join(line + "\n" for line in lines))


# Each family's decoders for an atom: kernels/families/<family>/<atom>.cuh (the m8n8k4 Dec* structs,
# the m16n8k16 Frag16* ones), over the atom's shared header.
ATOM_HEADERS = {"m8n8k4": "qpn_family.cuh", "m16n8k16": "qpn_atom_m16n8k16.cuh"}


def family_headers(atom: str) -> list[str]:
    """The families' decoder headers for ``atom``, as include paths relative to kernels/
    ("families/nvfp4/m8n8k4.cuh"), in the families' order; a family without kernels on the atom has
    none."""
    return [f"families/{family}/{atom}.cuh" for family in formats.ALL_FAMILIES
            if os.path.isfile(os.path.join(nvrtc.KERNELS_DIR, "families", family, f"{atom}.cuh"))]


def decoder_includes(atom: str) -> str:
    """The include lines of the families' decoders for ``atom``, ahead of a source's entry lines."""
    return (f"\n// The families' decoders, included by kernels/jit.py (decoder_includes, {atom}):\n"
            + "".join(f'#include "{header}"\n' for header in family_headers(atom)))


def decoder_source(atom: str) -> str:
    """The atom's shared header and every family's decoders for it, as one text: what the readers of
    the decoders (the replay, the performance model) parse."""
    sources = kernel_sources()
    return sources[ATOM_HEADERS[atom]] + "".join(sources[h] for h in family_headers(atom))


def kernel_sources() -> dict[str, str]:
    """Every source as NVRTC compiles it, by name: the files of csrc/ as they are, each atom's dense
    source with the families' decoder includes and its entry lines appended (decoder_includes,
    sm70_entry_lines, sm80_entry_lines), each MoE source with its own (moe_entry_lines), and the
    families' decoder headers by their include paths (their text is part of the cubin cache key).
    Whatever reads the kernels a source defines (sm70_check, benchmarks/perf_model.py, the tests)
    reads this."""
    sources = nvrtc.read_sources()
    for atom in ATOM_HEADERS:
        for header in family_headers(atom):
            with open(os.path.join(nvrtc.KERNELS_DIR, header), encoding="utf-8") as f:
                sources[header] = f.read()
    sources[MAIN_SOURCE] += decoder_includes("m8n8k4") + sm70_entry_lines()
    sources[ATOM_SOURCES["m16n8k16"]] += decoder_includes("m16n8k16") + sm80_entry_lines()
    for atom, source in MOE_SOURCES.items():
        sources[source] += decoder_includes(atom) + moe_entry_lines(atom)
    return sources


def source_hash() -> str:
    h = hashlib.sha256()
    for name, text in kernel_sources().items():
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
    src = kernel_sources()[source]
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


_sm_count: dict = {}


def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of cuda:``device_index`` (asked of torch once per device: the
    launch paths size their grids by it on every call)."""
    import torch

    sms = _sm_count.get(device_index)
    if sms is None:
        sms = _sm_count[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return sms


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


def launch_raw(func, grid: int, block: int, smem: int, stream: int, params, name: str = "") -> None:
    """cuLaunchKernel of a resolved function with a prebuilt parameter array (a ctypes array of
    pointers to the arguments); the driver copies the arguments before it returns."""
    lib = driver().lib
    rc = lib.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, smem, stream, params, None)
    if rc:
        driver().check(rc, f"cuLaunchKernel({name or 'prebuilt QPN launch'})")
