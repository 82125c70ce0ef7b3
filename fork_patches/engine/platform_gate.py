"""Where the QPN path serves: which platforms get our linear methods, and with which backend.

* CPU platform: always, with the reference implementation (pure torch, reading the same packed
  buffers the kernels read). This is how CI proves the loader, dispatch and census end to end.
* CUDA, compute capability 7.0 (V100): only when the QPN kernels are present and build for
  sm_70 (``qpn.kernels.ops.build``); then backend ``cuda``.
* CUDA, compute capability 8.0 and later: only when the user opts in (``QPN_SM80_OPT_IN=1``,
  off by default until measured against the engine's own NVFP4 path on the same GPU) and the
  kernels build for that architecture; the weights are then prepacked for the chip's own atom
  (m16n8k16). ``qpn.kernels.ops.serving_target`` holds that policy.
* Anything else: never. vLLM's own behaviour stands, untouched.

The answer is computed once per process and cached.
"""
from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm.qpn.platform_gate")

SM70 = (7, 0)


CPU_TARGET = {"backend": "reference", "arch": "sm70", "atom": "m8n8k4"}


@functools.lru_cache(maxsize=1)
def serving_target() -> dict | None:
    """{"backend", "arch", "atom"} of the QPN path on this process's device, or None (leave
    vLLM alone). CPU: the reference (it reads any atom's layout; m8n8k4 is prepacked)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return dict(CPU_TARGET)
    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    if cap is None:
        return None
    try:
        from qpn.kernels import ops
    except Exception as e:  # noqa: BLE001 - any import failure means "not present"
        logger.warning("volta-qpn: qpn.kernels.ops does not import (%s); leaving vLLM alone", e)
        return None
    target = ops.serving_target((cap.major, cap.minor))
    if target is None:
        return None
    ready, why = kernels_ready(target["arch"])
    if not ready:
        logger.warning("volta-qpn: the QPN kernels are not usable on %s (%s); "
                       "leaving vLLM's quantization gates as they are", target["arch"], why)
        return None
    if (cap.major, cap.minor) != SM70:
        logger.warning("volta-qpn: QPN_SM80_OPT_IN: serving ModelOpt NVFP4/FP8 layers on %s with "
                       "the QPN kernels (%s atom)", target["arch"], target["atom"])
    return {"backend": "cuda", **target}


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
