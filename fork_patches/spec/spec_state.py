# SPDX-License-Identifier: MIT
# Wraps functions of vLLM (Apache-2.0, Copyright contributors to the vLLM project); see NOTICE.
"""Speculative decoding on hybrid (gated-delta-net) models: keep the recurrent state's contract.

The contract every GDN speculative kernel assumes (vLLM 0.32's CPU torch loop and its native
AMX conv, the GPU Triton ``causal_conv1d_update``, 1Cat's SM70 kernels): each speculating row
verifies exactly ``K+1`` tokens, and ``num_accepted_tokens`` of the previous round is in
``[1, K+1]``. The conv buffer is a rolling window ``width-1+K`` wide; a round reads its history at
``num_accepted-1`` and rolls the buffer by ``num_accepted``, which lands the accepted tokens where
the next round reads them only when the previous round wrote ``K+1`` tokens.

vLLM's asynchronous scheduler keeps the width: grammar-invalid drafts are replaced by ``-1``
placeholders, which the rejection sampler always rejects. The CPU platform turns asynchronous
scheduling off (``platforms/cpu.py``), and the synchronous scheduler *trims* grammar-invalid
drafts instead (``Scheduler.update_draft_token_ids`` -> ``validate_tokens``). A forced tool call or
a JSON schema therefore produces rows of ``1+d`` tokens with ``d < K``. Two failures follow:

- a row shorter than the previous round's acceptance (previous ``a=2``, this round ``q=1``, every
  draft trimmed) rolls past the buffer's end: the torch loop dies with ``The size of tensor a (6)
  must match the size of tensor b (5)``, the native AMX conv with ``causal_conv1d_update_cpu:
  num_accepted_tokens must be in [1, seqlen]``; the engine core exits;
- any row shorter than ``K+1`` leaves the accepted tokens ``K+1-q`` columns right of where the
  next round reads them: the conv history is silently wrong and greedy output drifts from
  the output without speculation.

``wrap_cpu_spec_forward`` pads every short row to ``K+1`` tokens (zeros) before the engine's own
``_spec_forward`` runs and returns only the real tokens' outputs. Padding tokens come after the
real ones, so (causal conv, causal recurrence) they change no real output; they write only SSM
slots ``>= q`` and conv columns right of the last real token, which the next round never reads
because its ``num_accepted <= q``. The buffer keeps the layout a full-width round leaves.

``wrap_gdn_build`` floors ``num_accepted_tokens`` (and 1Cat's ``spec_state_slot_selectors``) at
1 where the metadata is built, on every engine: a row whose previous round committed nothing
(upstream #50021: on the GPU async path a discarded row counts 0) would otherwise index slot
``-1``, i.e. read and roll from before the row's own state. A round always verifies its first
token (the token sampled last round, already committed), so 1 is the least the state can hold.
"""
from __future__ import annotations

import copy
import functools
import inspect
import logging

logger = logging.getLogger("vllm.qpn.spec_state")

# Rows padded and counts floored since start (read by tests through the wrapper's attributes).
STATS = {"rows_padded": 0, "rounds_padded": 0, "counts_floored": 0}


def _full_width(width: int, state_len: int) -> int:
    """K+1: the conv buffer is ``width-1+K`` columns wide when speculation is configured."""
    return state_len - (width - 1) + 1


def pad_rows(lens, full: int):
    """(new query_start_loc, destination index of every real token) for rows padded to ``full``.

    Rows of length 0 stay empty (the engine skips them); every other row becomes ``full`` long
    with its real tokens first."""
    import torch

    new_lens = torch.where(lens > 0, torch.full_like(lens, full), torch.zeros_like(lens))
    new_qsl = torch.zeros(lens.numel() + 1, dtype=lens.dtype)
    new_qsl[1:] = torch.cumsum(new_lens, 0)
    dest = torch.cat([new_qsl[i] + torch.arange(int(lens[i]), dtype=torch.long)
                      for i in range(lens.numel())]) if lens.numel() else torch.zeros(0, dtype=torch.long)
    return new_qsl, dest


def wrap_cpu_spec_forward(original):
    """``vllm...ops.cpu.gdn_attention:_spec_forward``: run every speculating row at K+1 tokens."""

    @functools.wraps(original)
    def _spec_forward(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                      ssm_state, width, state_len):
        import torch

        n = int(attn_metadata_i.num_spec_decodes)
        full = _full_width(width, state_len)
        if n == 0:
            return original(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                            ssm_state, width, state_len)
        qsl = attn_metadata_i.spec_query_start_loc[: n + 1].to("cpu", torch.long)
        lens = qsl[1:] - qsl[:-1]
        acc = attn_metadata_i.num_accepted_tokens
        acc_n = acc[:n].to("cpu", torch.long)
        short = (lens > 0) & (lens < full)
        bad_count = (acc_n < 1) | (acc_n > full)
        if not bool(short.any()) and not bool(bad_count.any()):
            return original(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                            ssm_state, width, state_len)

        md = copy.copy(attn_metadata_i)
        if bool(bad_count.any()):
            STATS["counts_floored"] += int(bad_count.sum())
            md.num_accepted_tokens = acc.clamp(min=1, max=full)
        if not bool(short.any()):
            return original(layer, md, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state,
                            width, state_len)

        new_qsl, dest = pad_rows(lens, full)
        total = int(new_qsl[-1])
        src = torch.cat([qsl[i] + torch.arange(int(lens[i]), dtype=torch.long)
                         for i in range(n)])

        def padded(t):
            out = t.new_zeros((total,) + tuple(t.shape[1:]))
            out.index_copy_(0, dest, t.index_select(0, src))
            return out

        md.spec_query_start_loc = new_qsl.to(attn_metadata_i.spec_query_start_loc.dtype)
        STATS["rows_padded"] += int(short.sum())
        STATS["rounds_padded"] += 1
        out = original(layer, md, padded(mixed_qkv_spec), padded(b_spec), padded(a_spec),
                       conv_buf, ssm_state, width, state_len)
        real = out.new_zeros((mixed_qkv_spec.shape[0],) + tuple(out.shape[1:]))
        real.index_copy_(0, src, out.index_select(0, dest))
        return real

    return _spec_forward


def wrap_gdn_build(original):
    """``GDNAttentionMetadataBuilder.build``: floor the accepted counts (and 1Cat's state-slot
    selectors) at 1 before the builder turns them into state-slot indices."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def build(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        num_spec = getattr(self, "num_spec_state_tokens", None) or getattr(self, "num_spec", 0)
        for name in ("num_accepted_tokens", "spec_state_slot_selectors"):
            counts = bound.arguments.get(name)
            if counts is None or not num_spec:
                continue
            # In place, on the tensor's own device: no host sync, and the runner's persistent
            # buffer (which CUDA-graph replays read) keeps its address.
            counts.clamp_(min=1, max=num_spec + 1)
        return original(*bound.args, **bound.kwargs)

    return build
