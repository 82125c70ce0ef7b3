"""CPU reference for the QPN routes, the part every family shares.

Each family's reference (``reference_linear`` / ``reference_linear_f64`` of its numerics,
kernels/families/<family>/numerics.py) reads the SAME packed buffers the kernels read: the weights
are decoded from fragment order, not from the checkpoint tensors, so a serving engine on CPU
exercises the prepacked representation end to end. Two levels: float32 with the kernels'
semantics and FP16 output, and exact float64 (not rounded) for the numerics tests.

What they share is here: the activation check, the bias-and-FP16 finish (and its float64 twin),
the row-invariant CPU batching and the relative error the numerics tests report.
"""
from __future__ import annotations

import torch


CHUNK_ELEMS = 8 * 1024 * 1024  # float32 elements of scratch per N-chunk (32 MB)


def check_x(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` unless it is not 2-D [M, K] fp16 / bf16 / fp32 / fp64 (ValueError naming the problem)."""
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D [M, K], got shape {tuple(x.shape)}; flatten the batch first")
    if x.shape[1] != k:
        raise ValueError(f"activations have K={x.shape[1]} but the weight expects K={k}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"activations must be fp16, bf16 or fp32, got {x.dtype}")
    return x


def finish(y32: torch.Tensor, bias) -> torch.Tensor:
    """float32 sums plus the bias, rounded once to FP16 (what a kernel's epilogue writes)."""
    if bias is not None:
        y32 = y32 + bias.to(torch.float32).reshape(1, -1)
    return y32.to(torch.float16)


def finish_f64(y64: torch.Tensor, bias) -> torch.Tensor:
    """float64 sums plus the bias, not rounded (the exact references)."""
    return y64 if bias is None else y64 + bias.double().reshape(1, -1)


# On CPU, batches of up to this many rows (decode and speculative verification: sequences x
# (K+1)) are computed one row at a time. float32 matmul on CPU (MKL / oneDNN) sums in an order that
# depends on the batch shape (measured: with FP8 every row of a 2-64 row batch differs from the same
# row alone in float32, about 1% after the bf16 cast), and a speculating server must give each
# verified token the bits the server without speculation gives it alone (docs/serving.md). Larger
# batches (prefill) are the same on both servers and stay batched.
ROW_INVARIANT_MAX_M = 64


def row_invariant(x: torch.Tensor, rows_fn):
    """``rows_fn(x)``, computed row by row for CPU batches of 2..ROW_INVARIANT_MAX_M rows."""
    m = x.shape[0]
    if x.device.type == "cpu" and 1 < m <= ROW_INVARIANT_MAX_M:
        return torch.cat([rows_fn(x[i:i + 1]) for i in range(m)])
    return rows_fn(x)


def relative_error(y: torch.Tensor, y_ref64: torch.Tensor) -> float:
    """||y - fp16(y_ref)|| / ||fp16(y_ref)|| in float64 over the finite elements of fp16(y_ref)."""
    ref16 = y_ref64.to(torch.float16).double()
    yd = y.double()
    finite = torch.isfinite(ref16)
    num = (yd[finite] - ref16[finite]).norm()
    den = ref16[finite].norm()
    return float(num / den) if float(den) > 0 else float(num)
