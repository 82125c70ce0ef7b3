# SPDX-License-Identifier: MIT
# Wraps functions of vLLM (Apache-2.0, Copyright contributors to the vLLM project); see NOTICE.
"""Greedy output with MTP speculation identical to the output without it, on the cpu engine.

A speculating server computes each verified token as one row of a ``K+1``-row batch; the server
without speculation computes the same token alone. Greedy identity needs every step of the model
to give that row the same bits either way. Measured on the cpu engine (vLLM 0.32.0 CPU, AVX-512
BF16 without AMX; tests/test_spec_state.py and docs/serving.md give the figures), three steps do
not, and each has one arithmetic the engine already uses on the other path:

- GDN convolution. The plain decode path runs the engine's C++ conv (``conv.cpp``, VDPBF16PS) on
  every AVX-512-BF16 CPU, and the loader packs the conv weights for it on the same condition. The
  three speculative-aware paths (``_spec_forward``, ``_spec_aware_nonspec``,
  ``_spec_aware_nonspec_subset``) test ``_is_amx_tile_supported() or is_arm_bf16()`` instead, so
  without AMX they fall back to a torch conv that rounds the convolution to bf16 before its SiLU:
  every prompt row and decoded row differs by 0.5 to 14 bf16 ulps. ``wrap_cpp_conv_predicate``
  widens ``is_arm_bf16`` (the module's name for "the C++ conv runs here", used nowhere else) to the
  plain path's condition; the engine then takes on this CPU the branch it takes on AMX, whose
  K+1-token conv gives bitwise the plain path's one-token outputs.
- GDN recurrence. The one-token op ``fused_sigmoid_gating_delta_rule_update_cpu`` and the
  multi-slot op ``..._spec_cpu`` compute the same float32 recurrence but sum the q/k L2 norms in a
  different order (vector lanes against a scalar loop), so every token's output differs from the
  first one on. ``wrap_spec_ssm_op`` keeps the multi-slot contract (resume from slot
  ``num_accepted-1``, the state after token ``t`` in slot ``t``) and computes each token position
  with the one-token op: copy the row's previous state into the token's slot, update it there.
- CPU attention. With split-KV on (the engine's default), the scheduler metadata splits a
  request's KV across threads for some query shapes and merges the partial softmaxes in another
  order, so a one-token decode and a K+1-row verify give the same query different bits (from
  about 100 tokens of context on). ``wrap_cpu_attn_scheduler_metadata`` asks for unsplit work
  items; every query row then reduces over its KV in one order.

Steps measured bitwise row-invariant as the engine ships them (no hook): embedding, the RMS norms
(native torch), rotary embedding, SiLU-and-mul, the unquantized linear layers (oneDNN bf16
``onednn_mm``), the gated RMS norm, the FP8 KV-cache write, greedy argmax. Our own QPN linear
layers on CPU compute the rows of a decode-sized batch one at a time (``kernels/reference.py``).
"""
from __future__ import annotations

import functools

# Calls and rows, read by tests (no lock: the engine's forward runs on one thread).
STATS = {"ssm_spec_calls": 0, "attn_split_refused": 0}


def wrap_cpp_conv_predicate(original):
    """``gdn_attention:is_arm_bf16``: also true where the plain decode path runs the C++ conv
    (AVX-512 BF16), so the speculative-aware paths take the same conv."""

    @functools.wraps(original)
    def is_arm_bf16() -> bool:
        import torch

        return bool(original()) or bool(torch.cpu._is_avx512_bf16_supported())

    return is_arm_bf16


def wrap_spec_ssm_op(original):
    """``vllm._custom_ops:fused_sigmoid_gating_delta_rule_update_spec_cpu``: the multi-slot
    contract, each token computed by the engine's one-token op."""

    @functools.wraps(original)
    def fused_sigmoid_gating_delta_rule_update_spec_cpu(
            A_log, dt_bias, q, k, v, a, b, initial_state_source, spec_state_indices,
            num_accepted_tokens, cu_seqlens, use_qk_l2norm_in_kernel, softplus_beta=1.0,
            softplus_threshold=20.0):
        import torch
        import vllm._custom_ops as ops

        one_token = ops.fused_sigmoid_gating_delta_rule_update_cpu
        STATS["ssm_spec_calls"] += 1
        state = initial_state_source  # (slots, v_heads, k_dim, v_dim) float32, updated in place
        starts = cu_seqlens.tolist()
        rows_n = len(starts) - 1
        lens = [starts[r + 1] - starts[r] for r in range(rows_n)]
        out = v.new_empty((q.shape[0], v.shape[1], v.shape[2]))
        if rows_n <= 0 or max(lens) <= 0:
            return out
        slots = spec_state_indices[:rows_n].tolist()
        # the engine's op reads slot num_accepted-1 with the count floored at 1 (its own guard)
        accepted = [max(int(c), 1) for c in num_accepted_tokens[:rows_n].tolist()]
        prev = [slots[r][accepted[r] - 1] for r in range(rows_n)]
        for t in range(max(lens)):
            rows = [r for r in range(rows_n) if lens[r] > t]
            dst = [slots[r][t] for r in rows]
            for r, d in zip(rows, dst):
                if prev[r] != d:
                    state[d].copy_(state[prev[r]])
                prev[r] = d
            if len(rows) == 1:  # one request: contiguous one-token slices, no gather
                tok = starts[rows[0]] + t
                pick = slice(tok, tok + 1)
                qt, kt, vt, at, bt = (x[pick] for x in (q, k, v, a, b))
            else:
                tokens = torch.tensor([starts[r] + t for r in rows])
                qt, kt, vt, at, bt = (x.index_select(0, tokens) for x in (q, k, v, a, b))
            # shaped as the engine's plain decode calls it: (1, tokens, heads, dim), one token a row
            o = one_token(
                A_log=A_log, dt_bias=dt_bias, q=qt.unsqueeze(0).contiguous(),
                k=kt.unsqueeze(0).contiguous(), v=vt.unsqueeze(0).contiguous(),
                a=at.contiguous(), b=bt.contiguous(), initial_state_source=state,
                initial_state_indices=torch.tensor(dst, dtype=torch.int32),
                cu_seqlens=torch.arange(len(rows) + 1, dtype=torch.int32),
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, softplus_beta=softplus_beta,
                softplus_threshold=softplus_threshold)
            o = o.reshape(len(rows), v.shape[1], v.shape[2])
            if len(rows) == 1:
                out[pick] = o
            else:
                out.index_copy_(0, tokens, o.to(out.dtype))
        return out

    return fused_sigmoid_gating_delta_rule_update_spec_cpu


def wrap_cpu_attn_scheduler_metadata(original):
    """``vllm._custom_ops:cpu_attn_get_scheduler_metadata``: never split a request's KV."""

    @functools.wraps(original)
    def cpu_attn_get_scheduler_metadata(num_reqs, num_heads, num_kv_heads, head_dim, seq_lens, dtype,
                                        query_start_loc, causal, sliding_window_size, isa,
                                        enable_kv_split, dynamic_causal=None, kv_cache_dtype="auto"):
        if enable_kv_split:
            STATS["attn_split_refused"] += 1
        return original(num_reqs=num_reqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, seq_lens=seq_lens, dtype=dtype,
                        query_start_loc=query_start_loc, causal=causal,
                        sliding_window_size=sliding_window_size, isa=isa, enable_kv_split=False,
                        dynamic_causal=dynamic_causal, kv_cache_dtype=kv_cache_dtype)

    return cpu_attn_get_scheduler_metadata
