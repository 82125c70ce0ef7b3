"""KV-cache dtype policy: FP16 KV on SM70 even when the checkpoint asks for FP8.

The published mixed checkpoint declares an FP8 KV cache (``kv_cache_quant_algo: FP8``). That is
a good choice where attention has an FP8 path; on Volta it sends decode attention to a scalar
paged kernel instead of the tensor-core one (seed 000 measured +4.82 ms per round for honouring
it, against the 1Cat-vLLM engine). So on SM70, when the user left ``--kv-cache-dtype`` at
``auto`` and the checkpoint's directive resolved to an FP8 cache, we serve FP16 KV and say so in
the log and in the census. An explicit ``--kv-cache-dtype`` always wins; on every other platform
vLLM's own resolution stands and the census records what it resolved, with one exception: an
x86 CPU without AVX-512 and AMX, where vLLM 0.32 resolves the directive to an FP8 cache and then
refuses to allocate it; there the cache stays in the model dtype (logged, and in the census).

The decision is made where vLLM resolves ``auto`` (``EngineArgs.create_engine_config`` calling
``resolve_kv_cache_dtype_string``, in the API process); each worker re-derives the same
description for its census from the config it received. The census also records what every
attention layer actually uses (the string its implementation hands the kernels and the dtype of
the bound cache tensor), read from the live layers (``census.attention_layer_groups``).

How the KV dtype string travels on 1Cat-vLLM (both locked tags, read in their sources):
``engine/arg_utils.py`` ``create_engine_config`` resolves ``--kv-cache-dtype`` through
``resolve_kv_cache_dtype_string`` (our wrapper above; 1.3.0 then maps a bare ``fp8`` to
``fp8_e5m2`` on SM70 in ``_resolve_sm70_flash_v100_kv_cache_dtype_alias``) into
``CacheConfig.cache_dtype``; ``model_executor/layers/attention/attention.py`` ``Attention.__init__``
takes ``cache_config.cache_dtype``, sizes the cache tensor with ``kv_cache_dtype_str_to_dtype``
(``float16`` and ``auto`` on a float16 model both give torch.float16) and passes the string to
``FlashAttnV100Impl``. There the decode XQA branch accepts only ``auto``/``bfloat16`` with FP16
tensors or ``fp8_e5m2`` (``_flash_v100_decode``, ``_smallq_decode_xqa_allowed``), and the scalar
kernel's ``kv_cache_dtype_code_from_string`` (``flash-attention-v100/kernel/flash_decode_paged.cu``)
accepts ``auto``, ``bfloat16``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2`` and refuses anything else.
So ``float16`` (our SM70 choice, and what the sm70 profile passes) reaches neither kernel on
1.2.2. 1.3.0 normalises it in ``FlashAttnV100Impl.__init__``
(``_normalize_flash_v100_kv_cache_dtype``: ``float16`` -> ``auto``, the same unquantized FP16
layout); ``wrap_flash_v100_impl_init`` does exactly that on 1.2.2.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("vllm.qpn.kv_policy")

SM70_KV_DTYPE = "float16"
POLICY_SM70 = ("sm70: the checkpoint's FP8 KV directive is overridden on purpose; FP16 KV keeps "
               "Volta's tensor-core attention path (FP8 KV forces scalar paged attention there)")
POLICY_CPU_NO_FP8 = ("cpu without AVX-512/AMX: vLLM's CPU attention cannot hold an FP8 KV cache "
                     "there, so the cache is kept in the model dtype")
POLICY_USER = "explicit --kv-cache-dtype from the user; served as given"
POLICY_ENGINE = "engine's own resolution stands on this platform ({platform})"


def is_sm70() -> bool:
    from qpn.fork_patches.engine.platform_gate import is_sm70_cuda

    return is_sm70_cuda()


def checkpoint_kv_request(model_config) -> str | None:
    """The cache dtype the checkpoint itself asks for (vLLM's reading of it), or None."""
    from vllm.utils.torch_utils import get_kv_cache_quant_algo_string

    quant_cfg = getattr(getattr(model_config, "hf_config", None), "quantization_config", None)
    if not quant_cfg:
        return None
    return get_kv_cache_quant_algo_string(quant_cfg)


def cpu_lacks_fp8_kv() -> bool:
    """True on an x86 CPU without AVX-512 and AMX, where vLLM 0.32's CPU attention refuses an
    FP8 KV cache at the first allocation (cpu_attn._get_attn_isa: 'FP8 KV cache on CPU requires
    x86 with AVX-512 or AMX')."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu() or current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return False
    return not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def _model_dtype_name(model_config) -> str:
    import torch

    return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(model_config.dtype, "auto")


def wrap_resolve_kv_cache_dtype_string(original):
    """Wrapper of vllm.engine.arg_utils.resolve_kv_cache_dtype_string (see module doc)."""

    def resolve_kv_cache_dtype_string(kv_cache_dtype: str, model_config) -> str:
        resolved = original(kv_cache_dtype, model_config)
        if kv_cache_dtype != "auto" or not str(resolved).startswith("fp8"):
            return resolved
        if is_sm70():
            logger.warning(
                "volta-qpn: checkpoint asks for an FP8 KV cache (%s); serving FP16 KV on SM70 "
                "on purpose: %s. Pass --kv-cache-dtype %s explicitly to override.",
                resolved, POLICY_SM70, resolved)
            return SM70_KV_DTYPE
        if cpu_lacks_fp8_kv():
            chosen = _model_dtype_name(model_config)
            logger.warning(
                "volta-qpn: checkpoint asks for an FP8 KV cache (%s) but this CPU has neither "
                "AVX-512 nor AMX, which vLLM's CPU attention needs for FP8 KV; serving the KV "
                "cache in %s instead.", resolved, chosen)
            return chosen
        return resolved

    resolve_kv_cache_dtype_string.__wrapped__ = original
    return resolve_kv_cache_dtype_string


def describe(vllm_config) -> tuple[str | None, str, str]:
    """(checkpoint_requested, resolved, policy) for the census, from a worker's config."""
    from vllm.platforms import current_platform

    requested = checkpoint_kv_request(vllm_config.model_config)
    resolved = str(vllm_config.cache_config.cache_dtype)
    if is_sm70() and requested and requested.startswith("fp8") and resolved == SM70_KV_DTYPE:
        policy = POLICY_SM70
    elif requested and requested.startswith("fp8") and not resolved.startswith("fp8") and cpu_lacks_fp8_kv():
        policy = POLICY_CPU_NO_FP8
    elif requested and resolved != requested and resolved != "auto":
        policy = POLICY_USER
    else:
        platform = "cpu" if current_platform.is_cpu() else str(current_platform.device_name)
        policy = POLICY_ENGINE.format(platform=platform)
    return requested, resolved, policy


# ------------------------------------------------------------------ 1Cat 1.2.2: float16 -> auto
FLASH_V100_FP16_ALIAS = "float16"
FLASH_V100_FP16_NAME = "auto"  # the name 1Cat's kernels and XQA allow-lists use for FP16 KV


def normalize_flash_v100_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """1Cat 1.3.0's rule (flash_attn_v100._normalize_flash_v100_kv_cache_dtype): an explicit
    FP16 cache is the kernels' ``auto`` layout; every other string unchanged."""
    return FLASH_V100_FP16_NAME if kv_cache_dtype == FLASH_V100_FP16_ALIAS else kv_cache_dtype


def wrap_flash_v100_impl_init(original):
    """Wrapper of ``FlashAttnV100Impl.__init__`` on 1Cat 1.2.2: after the engine's own
    constructor, map the KV dtype string ``float16`` to ``auto`` as 1.3.0 does, so FP16 KV
    reaches the XQA decode branch and the scalar kernel accepts the string."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        before = getattr(self, "kv_cache_dtype", None)
        after = normalize_flash_v100_kv_cache_dtype(before)
        if after != before:
            self.kv_cache_dtype = after
            logger.info("volta-qpn: FLASH_ATTN_V100 KV cache dtype %r served as %r (the FP16 "
                        "layout's name in 1Cat's kernels; 1.3.0 does the same)", before, after)

    __init__.__wrapped__ = original
    return __init__
