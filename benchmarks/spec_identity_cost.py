# SPDX-License-Identifier: MIT
"""What greedy identity with speculation costs on the cpu engine, op by op (issue 12).

The cpu engine gives a verified token the bits the server without speculation gives it only
with three hooks (fork_patches/spec/spec_identity.py) and our QPN CPU linear computing the rows of
decode-sized batches one at a time (kernels/reference.py). This times, on this host's CPU, each
changed op both ways, in the engine's own functions:

- CPU attention, one-token decode, split-KV plan (engine default) against the unsplit plan
  (hook ``cpu-attention-unsplit-kv``): the only change on the path of a server without
  speculation serving one request at a time;
- the QPN CPU linear at M rows, batched against row by row (M > 1: concurrent requests, or a
  verify batch);
- the GDN multi-slot SSM update over K+1 tokens, the engine's op against the hook's one-token
  steps (speculating servers only).

Usage (the cpu engine's interpreter):
    python -m qpn.benchmarks.spec_identity_cost [--results-dir DIR] [--threads 2]
It prints a table and writes ``spec_identity_cost_cpu_<UTC>.md`` with its provenance.
"""
from __future__ import annotations
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.nvfp4 import layout as nvfp4_layout
from qpn.kernels.families.fp8 import codec as fp8_codec
from qpn.kernels.families.fp8 import layout as fp8_layout
from qpn.kernels import families

import argparse
import os
import statistics
import sys
import time


def _time_us(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def attention_rows(repeats: int) -> list[tuple]:
    import torch
    import vllm._custom_ops as ops

    rows = []
    # (label, q heads, kv heads, head dim): the test checkpoint's full-attention layer, and a
    # Qwen3.x-27B-like layer split 4 ways
    for label, heads, kv_heads, d in (("ckpt 4/2x64", 4, 2, 64), ("27B-like TP4 rank 6/1x256", 6, 1, 256)):
        for ctx in (256, 1024, 4096, 16384):
            block = 128
            blocks = -(-ctx // block) + 1
            cache = torch.zeros(blocks, kv_heads, block * 2, d, dtype=torch.uint8)
            key_cache, value_cache = cache.chunk(2, dim=2)
            gen = torch.Generator().manual_seed(ctx)
            kk = torch.randn(ctx, kv_heads, d, generator=gen).to(torch.bfloat16)
            ops.cpu_attn_reshape_and_cache(kk, kk, key_cache, value_cache, torch.arange(ctx), "vec",
                                           k_scale=0.02, v_scale=0.02, kv_cache_dtype="fp8_e4m3")
            q = torch.randn(1, heads, d, generator=gen).to(torch.bfloat16)
            table = torch.arange(blocks, dtype=torch.int32)[None]
            qsl, sl = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
            out = torch.zeros(1, heads, d, dtype=torch.bfloat16)
            times = {}
            for split in (True, False):
                def step(split=split):
                    plan = ops.cpu_attn_get_scheduler_metadata(
                        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, seq_lens=sl,
                        dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=-1,
                        isa="vec", enable_kv_split=split, kv_cache_dtype="fp8_e4m3")
                    ops.cpu_attention_with_kv_cache(
                        query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                        query_start_loc=qsl, seq_lens=sl, scale=d ** -0.5, causal=True,
                        alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                        scheduler_metadata=plan, s_aux=None, k_scale=0.02, v_scale=0.02,
                        kv_cache_dtype="fp8_e4m3")
                times[split] = _time_us(step, repeats)
            rows.append(("attention decode", f"{label}, context {ctx}", times[True], times[False]))
    return rows


def linear_rows(repeats: int) -> list[tuple]:
    import torch

    from qpn.kernels import reference

    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt, n, k in (("nvfp4", 512, 128), ("fp8", 512, 128), ("nvfp4", 4096, 1024), ("fp8", 4096, 1024)):
        w = torch.randn(n, k, generator=gen) * 0.05
        packed = (nvfp4_layout.prepack(*nvfp4_codec.quantize(w)) if fmt == "nvfp4"
                  else fp8_layout.prepack(*fp8_codec.quantize(w)))
        for m in (1, 4, 8):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            saved = reference.ROW_INVARIANT_MAX_M
            try:
                reference.ROW_INVARIANT_MAX_M = 0
                batched = _time_us(lambda: families.reference_linear(x, packed), repeats)
            finally:
                reference.ROW_INVARIANT_MAX_M = saved
            rows_apart = _time_us(lambda: families.reference_linear(x, packed), repeats)
            rows.append(("QPN CPU linear", f"{fmt} N={n} K={k}, M={m}", batched, rows_apart))
    return rows


def ssm_rows(repeats: int) -> list[tuple]:
    import torch
    import vllm._custom_ops as ops

    from qpn.fork_patches.spec import spec_identity

    engine_op = ops.fused_sigmoid_gating_delta_rule_update_spec_cpu
    engine_op = getattr(engine_op, "__wrapped__", engine_op)
    hooked = spec_identity.wrap_spec_ssm_op(engine_op)
    rows = []
    for label, hk, hv, d in (("ckpt 2/4x64", 2, 4, 64), ("16/48x128 (27B-like, TP1)", 16, 48, 128)):
        for k_draft in (1, 3, 7):
            t = k_draft + 1
            gen = torch.Generator().manual_seed(t)
            q = torch.randn(t, hk, d, generator=gen).to(torch.bfloat16)
            v = torch.randn(t, hv, d, generator=gen).to(torch.bfloat16)
            a = torch.randn(t, hv, generator=gen).to(torch.bfloat16)
            state = torch.randn(t, hv, d, d, generator=gen) * 0.1
            args = dict(A_log=torch.zeros(hv, dtype=torch.bfloat16), dt_bias=torch.zeros(hv, dtype=torch.bfloat16),
                        q=q, k=q, v=v, a=a, b=a, initial_state_source=state,
                        spec_state_indices=torch.arange(t, dtype=torch.int32)[None],
                        num_accepted_tokens=torch.tensor([t], dtype=torch.int32),
                        cu_seqlens=torch.tensor([0, t], dtype=torch.int32), use_qk_l2norm_in_kernel=True)
            rows.append(("GDN spec SSM update", f"{label}, K={k_draft}",
                         _time_us(lambda: engine_op(**args), repeats), _time_us(lambda: hooked(**args), repeats)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default=".", help="where the Markdown report goes (default: .)")
    parser.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads (default 2, as CI)")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per cell; the median is kept")
    args = parser.parse_args(argv)

    import torch

    from qpn.benchmarks import provenance

    torch.set_num_threads(args.threads)
    rows = attention_rows(args.repeats) + linear_rows(args.repeats) + ssm_rows(args.repeats)
    header = "| op | case | engine / batched (us) | with identity (us) | change |"
    lines = [header, "|---|---|---|---|---|"]
    for op, case, before, after in rows:
        lines.append(f"| {op} | {case} | {before:.1f} | {after:.1f} | {100 * (after / before - 1):+.0f}% |")
    print("\n".join(lines))
    rec = provenance.run_record(threads=args.threads, repeats=args.repeats,
                                load_average=" ".join(f"{x:.2f}" for x in os.getloadavg()))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, f"spec_identity_cost_cpu_{stamp}.md")
    with open(path, "w") as f:
        f.write("# Cost of greedy identity with speculation on the cpu engine, op by op\n\n")
        f.write("\n".join(provenance.markdown_block(rec)) + "\n")
        f.write("Median of the timed calls; 'with identity' = the hook / row-by-row path.\n\n")
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
