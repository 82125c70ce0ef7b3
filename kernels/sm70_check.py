"""V100 readiness without a V100: compile every QPN kernel for sm_70 and read the machine code.

* NVRTC 12.9 (``nvidia-cuda-nvrtc-cu12``) compiles csrc/qpn_kernels.cu, with the entry lines the
  JIT writes from the formats (jit.kernel_sources), to PTX and to the sm_70 cubin the JIT would
  load on a V100;
* ptxas 12.9 (``nvidia-cuda-nvcc-cu12``) assembles the same PTX with ``-v``: registers, spill
  bytes, stack frame per kernel;
* cuobjdump + nvdisasm from the ``triton==3.4.0`` wheel (a CUDA 12.8 build; the CUDA 13 tools
  refuse SM70) disassemble the NVRTC cubin: HMMA.884 count, local-memory instructions, and the
  resource usage of that cubin. The two binaries are extracted once into the qpn cache folder
  (``pip download triton==3.4.0 --no-deps``); nothing is installed.

``python -m qpn.kernels.sm70_check`` prints the table and exits non-zero on any violation:
a spill, a stack frame or local memory, a GEMM kernel without HMMA.884, more than 64 registers.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field

from . import jit, nvrtc

MAX_REGISTERS = 64
TRITON_FOR_TOOLS = "3.4.0"
# Kernels that issue no MMA: the reconstruct pass (decode to FP16), the MoE routing (grouping
# pairs by expert) and the MoE combine (weighted sum of the experts' results).
NON_GEMM_MARKERS = ("_reconstruct_ws_", "_moe_align", "_moe_combine")


class ToolMissing(RuntimeError):
    """A PyPI-provided tool of the sm_70 check is not available on this machine."""


def find_ptxas() -> str:
    env = os.environ.get("QPN_PTXAS")
    if env and os.path.exists(env):
        return env
    for base in sys.path:
        p = os.path.join(base, "nvidia", "cuda_nvcc", "bin", "ptxas")
        if base and os.path.exists(p):
            return p
    raise ToolMissing("ptxas 12.9 not found: pip install nvidia-cuda-nvcc-cu12==12.9.86 "
                      "(or set QPN_PTXAS to a CUDA 12.x ptxas)")


def find_disassembler(download: bool = True) -> str:
    """Path of a cuobjdump that can read SM70 cubins (nvdisasm beside it)."""
    env = os.environ.get("QPN_CUOBJDUMP")
    if env and os.path.exists(env):
        return env
    tools = os.path.join(jit.cache_dir(), "tools", f"triton-{TRITON_FOR_TOOLS}")
    cuobjdump = os.path.join(tools, "cuobjdump")
    if os.path.exists(cuobjdump) and os.path.exists(os.path.join(tools, "nvdisasm")):
        return cuobjdump
    if not download:
        raise ToolMissing(f"{cuobjdump} not present")
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            f"triton=={TRITON_FOR_TOOLS}", "-d", tmp], capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "triton-*.whl"))
        if r.returncode != 0 or not wheels:
            raise ToolMissing(f"could not download triton=={TRITON_FOR_TOOLS} for its cuobjdump/nvdisasm "
                              f"(pip said: {r.stderr.strip()[-400:]}); set QPN_CUOBJDUMP to a CUDA 12.x cuobjdump")
        os.makedirs(tools, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as z:
            for name in ("cuobjdump", "nvdisasm"):
                data = z.read(f"triton/backends/nvidia/bin/{name}")
                dst = os.path.join(tools, name)
                with open(dst + ".tmp", "wb") as f:
                    f.write(data)
                os.chmod(dst + ".tmp", 0o755)
                os.replace(dst + ".tmp", dst)
    return cuobjdump


@dataclass
class KernelReport:
    name: str
    registers: int = -1           # ptxas -v
    spill_stores: int = -1
    spill_loads: int = -1
    stack_frame: int = -1
    cubin_registers: int = -1     # NVRTC cubin, cuobjdump --dump-resource-usage
    cubin_stack: int = -1
    cubin_local: int = -1
    hmma884: int = 0              # HMMA.884 instructions in the NVRTC cubin's SASS
    local_insts: int = 0          # LDL / STL in that SASS
    problems: list = field(default_factory=list)

    @property
    def is_gemm(self) -> bool:
        return not any(m in self.name for m in NON_GEMM_MARKERS)


@dataclass
class CheckResult:
    nvrtc_version: tuple
    ptxas_version: str
    kernels: list

    @property
    def ok(self) -> bool:
        return all(not k.problems for k in self.kernels)

    def table(self) -> str:
        hdr = ("kernel", "regs", "spill st", "spill ld", "stack", "cubin regs", "cubin stack",
               "cubin local", "HMMA.884", "LDL/STL", "status")
        rows = [hdr]
        for k in self.kernels:
            rows.append((k.name, k.registers, k.spill_stores, k.spill_loads, k.stack_frame, k.cubin_registers,
                         k.cubin_stack, k.cubin_local, k.hmma884, k.local_insts,
                         "ok" if not k.problems else "; ".join(k.problems)))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(hdr))]
        lines = [f"sm_70 check: NVRTC {self.nvrtc_version[0]}.{self.nvrtc_version[1]}, ptxas {self.ptxas_version}"]
        for j, r in enumerate(rows):
            lines.append("  ".join(str(v).ljust(widths[i]) for i, v in enumerate(r)))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def parse_ptxas(text: str) -> dict[str, KernelReport]:
    out: dict[str, KernelReport] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = out.setdefault(m.group(1), KernelReport(m.group(1)))
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.stack_frame, cur.spill_stores, cur.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur.registers = int(m.group(1))
    return out


def parse_sass(text: str, reports: dict[str, KernelReport]) -> None:
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            cur = reports.setdefault(m.group(1), KernelReport(m.group(1)))
            continue
        if cur is None:
            continue
        if "HMMA.884" in line:
            cur.hmma884 += 1
        if re.search(r"\b(LDL|STL)\b", line):
            cur.local_insts += 1


def _parse_resource(text: str, reports: dict[str, KernelReport]) -> None:
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function (\w+):", line)
        if m:
            cur = reports.setdefault(m.group(1), KernelReport(m.group(1)))
            continue
        if cur is None:
            continue
        for key, attr in (("REG", "cubin_registers"), ("STACK", "cubin_stack"), ("LOCAL", "cubin_local")):
            m = re.search(rf"\b{key}:(\d+)", line)
            if m:
                setattr(cur, attr, int(m.group(1)))


def run_check(arch: int = 70, download: bool = True, source: str = jit.MAIN_SOURCE,
              expected=None) -> CheckResult:
    """Check the kernels of one csrc/ source (the dense family by default; moe_check() for
    qpn_moe.cu); ``expected`` are the entry points that must be there."""
    nv = nvrtc.load_nvrtc(12, arch)
    ptxas = find_ptxas()
    cuobjdump = find_disassembler(download)
    src = jit.kernel_sources()[source]
    res = nv.compile(src, source, arch, list(jit.COMPILE_FLAGS), want_cubin=True)
    env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "qpn.ptx")
        cubin_path = os.path.join(tmp, "qpn_nvrtc.cubin")
        with open(ptx_path, "w") as f:
            f.write(res.ptx)
        with open(cubin_path, "wb") as f:
            f.write(res.cubin)
        ver = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
        ptxas_version = (re.search(r"release ([\d.]+)", ver) or re.search(r"(V[\d.]+)", ver) or [None, "?"])[1]
        r = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", ptx_path, "-o", os.path.join(tmp, "ptxas.cubin")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ptxas failed:\n{r.stderr}")
        reports = parse_ptxas(r.stdout + r.stderr)
        sass = subprocess.run([cuobjdump, "-sass", cubin_path], capture_output=True, text=True, env=env)
        if sass.returncode != 0:
            raise RuntimeError(f"cuobjdump -sass failed:\n{sass.stderr}")
        parse_sass(sass.stdout, reports)
        resu = subprocess.run([cuobjdump, "--dump-resource-usage", cubin_path], capture_output=True, text=True, env=env)
        _parse_resource(resu.stdout, reports)
    expected = (tuple(expected) if expected is not None
                else jit.ENTRY_POINTS["m8n8k4"] + jit.UNSERVED_ENTRY_POINTS["m8n8k4"])
    for name in expected:
        if name not in reports:
            reports[name] = KernelReport(name, problems=["missing from the sm_70 build"])
    for k in reports.values():
        if k.spill_stores or k.spill_loads:
            k.problems.append(f"spills {k.spill_stores}/{k.spill_loads} bytes")
        if k.stack_frame or k.cubin_stack > 0:
            k.problems.append(f"stack frame {max(k.stack_frame, k.cubin_stack)} bytes")
        if k.cubin_local > 0 or k.local_insts:
            k.problems.append("local memory")
        if max(k.registers, k.cubin_registers) > MAX_REGISTERS:
            k.problems.append(f"{max(k.registers, k.cubin_registers)} registers > {MAX_REGISTERS}")
        if k.is_gemm and k.hmma884 == 0:
            k.problems.append("no HMMA.884 in the GEMM kernel")
        if k.registers < 0:
            k.problems.append("no ptxas report")
    ordered = [reports[n] for n in expected] + [v for n, v in sorted(reports.items()) if n not in expected]
    return CheckResult(res.nvrtc_version, ptxas_version, ordered)


def moe_check(arch: int = 70, download: bool = True) -> CheckResult:
    """The grouped MoE kernels (csrc/qpn_moe.cu, qpn.kernels.moe)."""
    from . import moe

    return run_check(arch, download, source=moe.MOE_SOURCE, expected=moe.entry_points("m8n8k4"))


def main(argv=None) -> int:
    try:
        results = [run_check(), moe_check()]
    except (ToolMissing, nvrtc.NvrtcUnavailable) as e:
        print(f"sm_70 check cannot run: {e}", file=sys.stderr)
        return 2
    for result in results:
        print(result.table())
    ok = all(r.ok for r in results)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
