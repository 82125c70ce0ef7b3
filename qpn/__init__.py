"""volta-qpn: packed NVFP4/FP8 inference on SM70 GPUs through a vLLM overlay.

The modules live in the project's top-level folders (``fork_patches/``, ``kernels/``,
``scripts/``, ``benchmarks/``) and are importable as ``qpn.<folder>``. Installed, the
wheel maps each folder into this package (see pyproject.toml). Run from a source checkout
with the repository root on ``sys.path``, this file points the package at the repository
root so that the very same names resolve without an install.
"""
import os as _os

__version__ = "0.1.0"

_repo_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_repo_root, "fork_patches")) and _os.path.isdir(
    _os.path.join(_repo_root, "kernels")
):
    __path__.append(_repo_root)  # noqa: F821 - __path__ exists for packages
