"""``python -m qpn.kernels build --arch sm70``: the bootstrap's JIT build step.

Compiles every QPN kernel for the architecture with NVRTC (cached by source hash, architecture and
flags), checks that every expected entry point is in the module, and prints where it is cached.
Exit 2 with the reason and the fix when NVRTC is missing or an entry point is absent.
"""
from __future__ import annotations

import argparse
import sys
import time

from . import jit, nvrtc, ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qpn.kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="JIT-build the QPN kernels and check their entry points")
    build.add_argument("--arch", default="sm70", help="target architecture, e.g. sm70 (V100)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        path = ops.build(args.arch)
        from . import moe  # the grouped MoE kernels, one module per atom the architecture runs

        moe_paths = [moe.build(args.arch, atom=a) for a in jit.atoms_for_arch(args.arch)]
    except (nvrtc.NvrtcUnavailable, jit.QpnBuildError, ValueError) as exc:
        print(f"[kernels] ERROR: {exc}", file=sys.stderr)
        return 2
    print(f"[kernels] built and checked QPN kernels for {args.arch} in "
          f"{time.monotonic() - t0:.1f} s: {path}")
    print(f"[kernels] built and checked QPN MoE kernels for {args.arch}: {', '.join(moe_paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
