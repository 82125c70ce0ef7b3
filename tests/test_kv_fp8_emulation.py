"""The reference's model of the cpu engine's FP8 KV cache, checked against the engine's own op.

The end-to-end agreement test compares the served log-probabilities with a float32 reference.
Where the cpu engine keeps the checkpoint's FP8 KV cache (x86 with AVX-512 or AMX), that
reference must store K and V the way the engine does, or the bound measures our modelling error
instead of the loader's. vLLM 0.32's ``cpu_attn_reshape_and_cache`` divides by the layer's
scale, saturates at +-448 and rounds toward zero (it does not round to nearest). This test
writes values from every interval between adjacent finite e4m3 codes, both signs, subnormals,
the saturation edge and beyond it, through the engine's op, and requires the bytes it stores to
equal ``checkpoint_reference.e4m3_toward_zero``; then it requires the engine's attention over
that cache to match attention over the reference's dequantized K and V.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _engine_ops():
    try:
        import vllm._custom_ops as ops
        from qpn.fork_patches.engine.kv_policy import cpu_lacks_fp8_kv
    except ImportError as exc:  # the suite runs inside the cpu engine's venv (scripts/test.sh)
        pytest.fail(f"the cpu engine is not importable here ({exc}); run the suite through scripts/test.sh")
    if cpu_lacks_fp8_kv():
        pytest.skip("this CPU has neither AVX-512 nor AMX: the cpu engine keeps no FP8 KV cache "
                    "here, so the e2e test runs the bf16 KV path and needs no FP8 model")
    return ops


def _every_e4m3_interval() -> torch.Tensor:
    """Each finite positive e4m3 value, the midpoint to the next one, a point just above and just
    below that midpoint, and points past 448; then the same negated; plus zero."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    values = codes.view(torch.float8_e4m3fn).float()
    nxt = torch.cat([values[1:], torch.tensor([480.0])])
    mid = (values + nxt) / 2
    gap = nxt - values
    pos = torch.cat([values, mid, mid - gap / 8, mid + gap / 8, nxt - gap / 64,
                     torch.tensor([449.0, 464.0, 1000.0, 1e6])])
    return torch.cat([pos, -pos, torch.zeros(1)])


BLOCK, HEAD, KV_HEADS, HEADS = 32, 64, 2, 4


def _store(ops, key: torch.Tensor, value: torch.Tensor, k_scale: float, v_scale: float):
    tokens = key.shape[0]
    blocks = -(-tokens // BLOCK)
    cache = torch.zeros(blocks, KV_HEADS, BLOCK, 2 * HEAD, dtype=torch.uint8)
    key_cache, value_cache = cache.view(blocks, KV_HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    slots = torch.arange(tokens, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec", k_scale, v_scale,
                                   "fp8_e4m3")
    return blocks, key_cache, value_cache


def _stored_keys(key_cache: torch.Tensor, blocks: int, tokens: int) -> torch.Tensor:
    """The engine's key layout for the 'vec' ISA is dimension-major inside a block."""
    k = key_cache.reshape(blocks, KV_HEADS, HEAD, BLOCK).permute(0, 3, 1, 2)
    return k.reshape(blocks * BLOCK, KV_HEADS, HEAD)[:tokens]


def test_engine_fp8_kv_bytes_equal_reference_rounding():
    from qpn.scripts.checkpoints.checkpoint_reference import e4m3_toward_zero

    ops = _engine_ops()
    k_scale = 0.0625  # a power of two: x/scale is exact in bfloat16, so the test isolates rounding
    x = _every_e4m3_interval()
    # bfloat16 inputs (the engine's dtype) that are exactly representable: keep those only.
    x = x[(x.bfloat16().float() == x)]
    per_token = KV_HEADS * HEAD
    tokens = -(-x.numel() // per_token)
    flat = torch.zeros(tokens * per_token)
    flat[: x.numel()] = x
    key = (flat * k_scale).bfloat16().reshape(tokens, KV_HEADS, HEAD)
    blocks, key_cache, _ = _store(ops, key, key.clone(), k_scale, k_scale)
    stored = _stored_keys(key_cache, blocks, tokens).reshape(-1)[: x.numel()]
    expected = e4m3_toward_zero(x).view(torch.uint8)
    nearest = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert (nearest != expected).sum() > 100, "test data must separate the two rounding modes"
    # Compared as values: the engine stores -0.0 as +0, which is the same number.
    bad = (stored.view(torch.float8_e4m3fn).float() != expected.view(torch.float8_e4m3fn).float()).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {x.numel()} values stored differently from round-toward-zero, e.g. "
        f"x={x[bad[:4]].tolist()} engine={stored[bad[:4]].tolist()} reference={expected[bad[:4]].tolist()}; "
        "update checkpoint_reference.e4m3_toward_zero to the engine's rounding")


def test_engine_attention_over_fp8_cache_matches_reference_dequantization():
    from qpn.scripts.checkpoints.checkpoint_reference import e4m3_toward_zero

    ops = _engine_ops()
    gen = torch.Generator().manual_seed(7)
    tokens = 100
    q = (torch.randn(tokens, HEADS, HEAD, generator=gen) * 2).bfloat16()
    k = (torch.randn(tokens, KV_HEADS, HEAD, generator=gen) * 3).bfloat16()
    v = (torch.randn(tokens, KV_HEADS, HEAD, generator=gen) * 0.5).bfloat16()
    k_scale, v_scale = 0.02, 0.005
    blocks, key_cache, value_cache = _store(ops, k, v, k_scale, v_scale)
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(1, HEADS, KV_HEADS, HEAD, lens, torch.bfloat16, starts,
                                               True, -1, "vec", False, None, "fp8_e4m3")
    out = torch.zeros(tokens, HEADS, HEAD, dtype=torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32).reshape(1, blocks)
    ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, starts, lens, HEAD ** -0.5, True, None,
                                    -1, table, 0.0, meta, None, None, k_scale, v_scale, "fp8_e4m3")

    def attend(kk, vv):
        rep = HEADS // KV_HEADS
        qq = q.float().transpose(0, 1)
        kk = kk.float().repeat_interleave(rep, 1).transpose(0, 1)
        vv = vv.float().repeat_interleave(rep, 1).transpose(0, 1)
        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                                scale=HEAD ** -0.5).transpose(0, 1)

    def rel(a, b):
        return float((a.float() - b).abs().max() / b.abs().max())

    toward_zero = attend(e4m3_toward_zero(k.float() / k_scale).float() * k_scale,
                         e4m3_toward_zero(v.float() / v_scale).float() * v_scale)
    nearest = attend((k.float() / k_scale).to(torch.float8_e4m3fn).float() * k_scale,
                     (v.float() / v_scale).to(torch.float8_e4m3fn).float() * v_scale)
    # The engine's output is bfloat16 (8 significant bits): 2**-8 relative is its rounding floor.
    assert rel(out, toward_zero) < 2 ** -7, rel(out, toward_zero)
    assert rel(out, nearest) > 4 * rel(out, toward_zero), "the check cannot tell the rounding modes apart"
