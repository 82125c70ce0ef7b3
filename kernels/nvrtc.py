"""NVRTC through ctypes: compile the CUDA sources in csrc/ to PTX or a cubin at run time.

NVRTC ships as a PyPI wheel (``nvidia-cuda-nvrtc-cu12``; CUDA builds of torch depend on it), so
neither a CUDA toolkit nor a host compiler is needed on the serving machine. ctypes keeps this
free of any binding package's version coupling: the same code drives NVRTC 12.x (sm_70) and
13.x (sm_75+).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from dataclasses import dataclass

CSRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# kernels/: the weight families' decoder headers are included as families/<family>/<atom>.cuh
KERNELS_DIR = os.path.dirname(CSRC_DIR)


class NvrtcUnavailable(RuntimeError):
    """No usable NVRTC library was found."""


class NvrtcCompileError(RuntimeError):
    """NVRTC rejected a source; the message carries its log."""


def candidate_paths(major: int | None = None) -> list[str]:
    out: list[str] = []
    env = os.environ.get("QPN_NVRTC_LIB")
    if env:
        out.append(env)
    pats = []
    if major in (None, 12):
        pats.append(os.path.join("nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12"))
    if major in (None, 13):
        pats += [os.path.join("nvidia", "cu13", "lib", "libnvrtc.so.13"),
                 os.path.join("nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.13")]
    for base in sys.path:
        if not base or not os.path.isdir(base):
            continue
        for p in pats:
            out += glob.glob(os.path.join(base, p))
    if major is None:
        found = ctypes.util.find_library("nvrtc")
        if found:
            out.append(found)
        for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
            out += sorted(glob.glob(os.path.join(d, "libnvrtc.so*")), reverse=True)
    seen, uniq = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    return uniq


@dataclass
class CompileResult:
    ptx: str
    cubin: bytes | None
    log: str
    nvrtc_version: tuple[int, int]


class Nvrtc:
    def __init__(self, path: str):
        self.path = path
        d = os.path.dirname(path)
        # NVRTC dlopens its builtins by soname; load them first from the same folder so that a
        # wheel install works without LD_LIBRARY_PATH.
        for b in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so*"))):
            if ".alt." in b:
                continue
            try:
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
        self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        lib = self.lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        maj, mnr = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(maj), ctypes.byref(mnr)), "nvrtcVersion")
        self.version = (maj.value, mnr.value)

    def _check(self, rc: int, what: str, log: str = "") -> None:
        if rc != 0:
            msg = self.lib.nvrtcGetErrorString(rc).decode()
            raise NvrtcCompileError(f"{what} failed: {msg}\n{log}")

    def supported_archs(self) -> list[int]:
        n = ctypes.c_int()
        if not hasattr(self.lib, "nvrtcGetNumSupportedArchs"):
            return []
        self._check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
        arr = (ctypes.c_int * n.value)()
        self._check(self.lib.nvrtcGetSupportedArchs(arr), "nvrtcGetSupportedArchs")
        return list(arr)

    def compile(self, source: str, name: str, arch: int, options: list[str] | None = None,
                want_cubin: bool = True) -> CompileResult:
        """Compile ``source``; arch is e.g. 70. With want_cubin, -arch=sm_XX (PTX and cubin);
        otherwise -arch=compute_XX (PTX only)."""
        lib = self.lib
        prog = ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                           0, None, None), "nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture={'sm' if want_cubin else 'compute'}_{arch}",
                    f"--include-path={CSRC_DIR}", f"--include-path={KERNELS_DIR}", "--std=c++17"] + list(options or [])
            copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            self._check(rc, f"NVRTC {self.version[0]}.{self.version[1]} compile of {name} for sm_{arch}", log)
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            pbuf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetPTX(prog, pbuf), "nvrtcGetPTX")
            cubin = None
            if want_cubin:
                self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
                cbuf = ctypes.create_string_buffer(size.value)
                self._check(lib.nvrtcGetCUBIN(prog, cbuf), "nvrtcGetCUBIN")
                cubin = cbuf.raw[: size.value]
            return CompileResult(pbuf.value.decode(), cubin, log, self.version)
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


cache: dict = {}


def load_nvrtc(major: int | None = None, arch: int | None = None) -> Nvrtc:
    """First NVRTC found (optionally of a given major version, or able to target sm_<arch>)."""
    key = (major, arch)
    if key in cache:
        return cache[key]
    errors = []
    for p in candidate_paths(major):
        try:
            nv = Nvrtc(p)
        except (OSError, NvrtcCompileError) as e:
            errors.append(f"{p}: {e}")
            continue
        if major is not None and nv.version[0] != major:
            continue
        if arch is not None:
            archs = nv.supported_archs()
            if archs and arch not in archs:
                errors.append(f"{p}: NVRTC {nv.version} cannot target sm_{arch} (supports {archs})")
                continue
        cache[key] = nv
        return nv
    hint = ("install NVRTC 12.x for sm_70 (pip install nvidia-cuda-nvrtc-cu12==12.9.86; CUDA 13 dropped sm_70), "
            "or point QPN_NVRTC_LIB at a libnvrtc.so")
    raise NvrtcUnavailable(
        f"no usable NVRTC library found (major={major}, arch=sm_{arch}); {hint}."
        + ("\ntried:\n  " + "\n  ".join(errors) if errors else ""))


def read_sources() -> dict[str, str]:
    """Every file in csrc/ (the kernel source and its headers), by name."""
    out = {}
    for fn in sorted(os.listdir(CSRC_DIR)):
        if fn.endswith((".cu", ".cuh", ".h")):
            with open(os.path.join(CSRC_DIR, fn), encoding="utf-8") as f:
                out[fn] = f.read()
    return out
