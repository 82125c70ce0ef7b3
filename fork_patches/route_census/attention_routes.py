"""Attention routes on 1Cat-vLLM's FlashAttention-V100 backend: the census hook, and the
engine's own rule for when decode and MTP verification take the tensor-core (XQA) kernel.

1Cat records every attention decision through one module function,
``vllm/v1/attention/backends/flash_attn_v100.py:_record_route(route)``, which counts only when
``VLLM_FLASH_V100_ROUTE_SUMMARY=1``. The backend calls it by its global name, so replacing the
module attribute reaches every call. Our wrapper counts each route in the census (captures of a
CUDA graph apart from eager calls, as the QPN routes are counted) and then calls the engine's own
function, so its summary keeps working.

The XQA rule below is the engine's, read from ``flash_attn_v100.py`` of 1.2.2 and 1.3.0
(``FlashAttnV100Impl._flash_v100_decode``, ``_smallq_decode_xqa_allowed``,
``_decode_xqa_allowed_for_q_per_kv``, ``_decode_fp8_xqa_allowed``; identical in both tags but for
the FP8 threshold): decode (one query row per sequence) takes ``decode_xqa_paged`` when the head
size is 256, there is no sliding window, the KV cache is ``auto``/``bfloat16`` with FP16 tensors
or ``fp8_e5m2`` (uint8 tensors), and the query heads per KV head are 6 or 8 (4 only from a
sequence-length hint of 32768 on); FP8 E5M2 further needs a sequence hint of 8192 (1.2.2) or
16384 (1.3.0). MTP verification (2..16 query rows) takes ``prefill_smallq_decode_xqa`` under the
same shape and KV conditions with q-per-KV 6 or 8 only, and only from a sequence hint of 4096
(``VLLM_FLASH_V100_SMALLQ_DECODE_XQA_MIN_SEQ_LEN``): verification over a short context is scalar
by the engine's design.
"""
from __future__ import annotations

from dataclasses import dataclass

ANCHOR = "vllm.v1.attention.backends.flash_attn_v100:_record_route"

# Route names the engine records (both tags).
DECODE_XQA = "decode_xqa_paged"
DECODE_SCALAR = "decode_scalar_paged"
VERIFY_XQA = "prefill_smallq_decode_xqa"
VERIFY_SCALAR = "prefill_smallq_decode_scalar"
CAPTURE_SMALLQ = "prefill_capture_smallq"
FP8_KV_PREFIX = "fp8_kv_"  # fp8_kv_decode, fp8_kv_decode_xqa_paged, fp8_kv_decode_scalar_paged ...

XQA_HEAD_SIZE = 256
XQA_Q_PER_KV = (6, 8)
Q4_MIN_SEQ = 32768  # _DEFAULT_Q4_XQA_MIN_SEQ_LEN, both tags
SMALLQ_MIN_SEQ = 4096  # VLLM_FLASH_V100_SMALLQ_DECODE_XQA_MIN_SEQ_LEN default, both tags
FP8_MIN_SEQ = {"1.2.2": 8192, "1.3.0": 16384}  # _DEFAULT_FP8_XQA_MIN_SEQ_LEN per tag
FP16_KV_STRINGS = ("auto", "bfloat16")  # the strings the XQA branch and the scalar kernel accept


def _capturing_cuda_graph() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def wrap_record_route(original):
    """Wrapper of 1Cat's ``flash_attn_v100._record_route``: census first, then the engine's."""
    from qpn.fork_patches.route_census.census import CENSUS

    def _record_route(route: str) -> None:
        CENSUS.count_attention_route(str(route), graph=_capturing_cuda_graph())
        return original(route)

    _record_route.__wrapped__ = original
    return _record_route


# ------------------------------------------------------------------------------ the XQA rule
@dataclass(frozen=True)
class XqaVerdict:
    """Whether the engine's own rule sends a phase to XQA for this layer shape and KV."""

    phase: str  # "decode" | "verify"
    required: bool  # XQA whatever the context length: a scalar call is a fault
    context_min: int | None  # XQA only from this sequence hint on (None: never / always)
    why: str


def _env_int(env: dict, name: str, default: int) -> int:
    try:
        return max(1, int(env[name])) if name in env else default
    except ValueError:
        return default


def xqa_verdicts(group: dict, engine_version: str | None, env: dict | None = None
                 ) -> list[XqaVerdict]:
    """The engine's decode and verification XQA conditions for one census attention-layer group
    (keys: head_size, num_heads, num_kv_heads, sliding_window, kv_cache_dtype,
    cache_tensor_dtype) on 1Cat ``engine_version`` with server environment ``env``."""
    env = env or {}
    version = str(engine_version or "").split("+")[0]
    fp8_min = _env_int(env, "VLLM_FLASH_V100_DECODE_FP8_XQA_MIN_SEQ_LEN",
                       FP8_MIN_SEQ.get(version, FP8_MIN_SEQ["1.3.0"]))
    q4_min = _env_int(env, "VLLM_FLASH_V100_DECODE_XQA_Q4_MIN_SEQ_LEN", Q4_MIN_SEQ)
    smallq_min = _env_int(env, "VLLM_FLASH_V100_SMALLQ_DECODE_XQA_MIN_SEQ_LEN", SMALLQ_MIN_SEQ)
    head, heads, kv_heads = int(group["head_size"]), int(group["num_heads"]), int(group["num_kv_heads"])
    q_per_kv = heads // kv_heads if kv_heads and heads % kv_heads == 0 else 0
    kv, tensor = str(group["kv_cache_dtype"]), group.get("cache_tensor_dtype")
    fp16_kv = kv in FP16_KV_STRINGS and tensor in ("float16", None)
    e5m2_kv = kv == "fp8_e5m2" and tensor in ("uint8", "float8_e5m2", None)

    static = []
    if env.get("VLLM_FLASH_V100_DECODE_USE_XQA", "1") != "1":
        static.append("VLLM_FLASH_V100_DECODE_USE_XQA is not 1")
    if head != XQA_HEAD_SIZE:
        static.append(f"head size {head} (XQA needs {XQA_HEAD_SIZE})")
    if group.get("sliding_window") is not None:
        static.append(f"sliding window {group['sliding_window']} (XQA needs none)")
    if not (fp16_kv or e5m2_kv):
        static.append(f"KV cache {kv!r} with {tensor} tensors (XQA needs auto/bfloat16 with float16 "
                      "tensors, or fp8_e5m2)")
    if q_per_kv not in XQA_Q_PER_KV + (4,):
        static.append(f"{heads} query heads per {kv_heads} KV heads = {q_per_kv or 'uneven'} "
                      "(XQA needs 6 or 8, or 4 at long context)")
    shape = f"head {head}, q-per-KV {q_per_kv}, KV {kv}/{tensor}"
    if static:
        why = "engine sends it to the scalar kernel: " + "; ".join(static)
        return [XqaVerdict("decode", False, None, why), XqaVerdict("verify", False, None, why)]

    # decode
    thresholds = ([q4_min] if q_per_kv == 4 else []) + ([fp8_min] if e5m2_kv else [])
    if e5m2_kv and q_per_kv == 4:
        decode = XqaVerdict("decode", False, None,
                            f"{shape}: the engine keeps FP8 KV with q-per-KV 4 on the scalar kernel")
    elif thresholds:
        decode = XqaVerdict("decode", False, max(thresholds),
                            f"{shape}: XQA from a sequence hint of {max(thresholds)} on")
    else:
        decode = XqaVerdict("decode", True, None, f"{shape}: XQA at every context length")

    # verification (smallq): q-per-KV 6/8 only, from the smallq threshold on
    if env.get("VLLM_FLASH_V100_SMALLQ_DECODE_USE_XQA", "1") != "1":
        verify = XqaVerdict("verify", False, None, "VLLM_FLASH_V100_SMALLQ_DECODE_USE_XQA is not 1")
    elif q_per_kv not in XQA_Q_PER_KV:
        verify = XqaVerdict("verify", False, None,
                            f"{shape}: verification XQA needs q-per-KV 6 or 8")
    else:
        need = max(smallq_min, fp8_min) if e5m2_kv else smallq_min
        verify = XqaVerdict("verify", False, need,
                            f"{shape}: verification XQA from a sequence hint of {need} on; "
                            "below it the engine verifies on the scalar kernel")
    return [decode, verify]
