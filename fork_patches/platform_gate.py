"""Where the QPN path serves: which platforms get our linear methods, and with which backend.

* CPU platform: always, with the reference implementation (pure torch, reading the same packed
  buffers the kernels read). This is how CI proves the loader, dispatch and census end to end.
* CUDA, compute capability 7.0 (V100): only when the QPN kernels are present and build for
  sm_70 (``qpn.kernels.ops.build``); then backend ``cuda``.
* Anything else: never. vLLM's own behaviour stands, untouched.

The answer is computed once per process and cached.
"""
from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm.qpn.platform_gate")

SM70 = (7, 0)


@functools.lru_cache(maxsize=1)
def qpn_backend() -> str | None:
    """'reference' (CPU), 'cuda' (SM70 with built kernels) or None (leave vLLM alone)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "reference"
    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    if cap is None or (cap.major, cap.minor) != SM70:
        return None
    ready, why = kernels_ready("sm70")
    if not ready:
        logger.warning("volta-qpn: SM70 detected but the QPN kernels are not usable (%s); "
                       "leaving vLLM's quantization gates as they are", why)
        return None
    return "cuda"


@functools.lru_cache(maxsize=4)
def kernels_ready(arch: str) -> tuple[bool, str]:
    """(True, '') when qpn.kernels.ops imports and builds for ``arch``; else (False, reason)."""
    try:
        from qpn.kernels import ops
    except Exception as e:  # noqa: BLE001 - any import failure means "not present"
        return False, f"qpn.kernels.ops does not import: {type(e).__name__}: {e}"
    build = getattr(ops, "build", None)
    if build is None:
        return False, "qpn.kernels.ops has no build()"
    try:
        build(arch)
    except Exception as e:  # noqa: BLE001
        return False, f"qpn.kernels.ops.build({arch!r}) failed: {type(e).__name__}: {e}"
    return True, ""


def is_sm70_cuda() -> bool:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False
    cap = current_platform.get_device_capability()
    return cap is not None and (cap.major, cap.minor) == SM70
