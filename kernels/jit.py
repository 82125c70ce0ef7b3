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
import threading

from . import nvrtc

COMPILE_FLAGS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=true")
# Every kernel entry point the family must export, per atom. ops.build() fails naming any that
# is missing.
ENTRY_POINTS = {
    "m8n8k4": (
        "qpn2_mt1_m8n8k4", "qpn2_mt2_m8n8k4", "qpn8_mt1_m8n8k4", "qpn8_mt2_m8n8k4",
        "qpn2_reconstruct_ws_m8n8k4", "qpn8_reconstruct_ws_m8n8k4",
    ),
}
MAIN_SOURCE = "qpn_kernels.cu"


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


def compile_cubin(arch, use_cache: bool = True) -> tuple[bytes, str]:
    """Compile csrc/qpn_kernels.cu for sm_<arch>; returns (cubin, path of the cached file)."""
    a = arch_number(arch)
    nv = nvrtc_for_arch(a)
    key = hashlib.sha256(
        f"{source_hash()}|sm_{a}|{' '.join(COMPILE_FLAGS)}|nvrtc{nv.version}".encode()).hexdigest()[:32]
    path = os.path.join(cache_dir(), f"qpn_sm{a}_{key}.cubin")
    if use_cache and os.path.exists(path):
        with open(path, "rb") as f:
            return f.read(), path
    src = nvrtc.read_sources()[MAIN_SOURCE]
    res = nv.compile(src, MAIN_SOURCE, a, list(COMPILE_FLAGS), want_cubin=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(res.cubin)
    os.replace(tmp, path)
    return res.cubin, path


def check_entry_points(cubin: bytes, atom: str = "m8n8k4") -> None:
    """Raise QpnBuildError naming the first expected kernel symbol absent from the cubin."""
    for name in ENTRY_POINTS[atom]:
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


def module_for(device) -> LoadedModule:
    """The QPN module loaded into torch's context on ``device`` (compiled for its architecture)."""
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    m = _modules.get(idx)
    if m is not None:
        return m
    with _lock:
        m = _modules.get(idx)
        if m is None:
            major, minor = torch.cuda.get_device_capability(idx)
            arch = major * 10 + minor
            cubin, path = compile_cubin(arch)
            check_entry_points(cubin)
            with torch.cuda.device(idx):
                torch.cuda.current_stream(idx).synchronize()  # makes torch's primary context current
                m = LoadedModule(cubin, path, arch)
                for name in ENTRY_POINTS["m8n8k4"]:
                    m.function(name)
            _modules[idx] = m
    return m


def launch(module: LoadedModule, name: str, grid: int, block: int, smem: int, stream: int,
           args: list) -> None:
    """cuLaunchKernel with args given as ctypes objects (kept alive for the call)."""
    d = driver()
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    d.check(d.lib.cuLaunchKernel(module.function(name), grid, 1, 1, block, 1, 1, smem,
                                 ctypes.c_void_p(stream), params, None), f"cuLaunchKernel({name})")
