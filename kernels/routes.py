"""THE route table: which QPN route serves a (format, M, N, K) call. One place, used by the
loader's dispatch, the custom ops and the benchmarks alike. A route is never a silent fallback:
every M has exactly one named route, and every route below is a real kernel path.

| M      | NVFP4 (MLP trunk, lm_head)  | FP8 (attention projections) |
|--------|-----------------------------|-----------------------------|
| 1-8    | qpn2                        | qpn8                        |
| 9-16   | qpn2_mt2                    | qpn8_mt2                    |
| 17-96  | qpn2_chunked                | qpn8_chunked                |
| > 96   | qpn2_reconstruct            | qpn8_reconstruct            |

* qpn2 / qpn8: one 8-row tile, four quadpairs on N sharing one activation fragment.
* *_mt2: two 8-row tiles against a single pass over the weights.
* *_chunked: the M rows cut into 16-row chunks, each chunk an MT2 pass; the chunks of one weight
  tile are scheduled as adjacent blocks so that they stream the same weight bytes at the same
  time (the second and later reads come from L2). Why MT2 chunks and not a wider tile: each 8-row tile
  holds 8 FP32 accumulators per thread beside its decode registers, and a four-tile variant
  spilled 36-40 bytes under the 64-register cap (ptxas, sm_70) that keeps two blocks resident
  per SM on SM70.
  The choice of 16-row chunks over 8-row chunks is by that design reasoning; the H200 benchmark
  also times the 8-row variant, but m8n8k4 is emulated there, so it cannot settle the V100 question.
* *_reconstruct: the packed weights are expanded into a transient FP16 workspace holding
  e2m1 x e4m3-group-scale (NVFP4) or e4m3 (FP8), values that FP16 represents exactly; a GEMM with
  FP32 accumulation and FP32 output runs on it, the per-tensor / per-channel scale is applied in
  FP32 and the workspace is freed when the call returns. Nothing is persisted.
"""
from __future__ import annotations

FORMATS = ("nvfp4", "fp8")
ROUTE_PREFIX = {"nvfp4": "qpn2", "fp8": "qpn8"}

QPN_ROUTES = frozenset(
    f"{ROUTE_PREFIX[f]}{suffix}" for f in FORMATS for suffix in ("", "_mt2", "_chunked", "_reconstruct")
)

# Upper M bound of each packed band; above the last, reconstruction.
M_SINGLE_TILE_MAX = 8
M_MT2_MAX = 16
M_CHUNKED_MAX = 96
CHUNK_ROWS = 16

KNOWN_ARCHS = ("sm70", "sm75", "sm80", "sm86", "sm89", "sm90")


def route_for(fmt: str, m: int, n: int, k: int, arch: str = "sm70") -> str:
    """Route name for one linear call: fmt is "nvfp4" or "fp8", m = rows in the batch."""
    if fmt not in ROUTE_PREFIX:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"M (rows in the batch) must be a positive int, got {m!r}")
    if n < 1 or k < 1:
        raise ValueError(f"N and K must be positive, got N={n} K={k}")
    if fmt == "nvfp4" and k % 16:
        raise ValueError(f"NVFP4 needs K to be a multiple of 16, got K={k}")
    if arch not in KNOWN_ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {KNOWN_ARCHS}")
    p = ROUTE_PREFIX[fmt]
    if m <= M_SINGLE_TILE_MAX:
        return p
    if m <= M_MT2_MAX:
        return p + "_mt2"
    if m <= M_CHUNKED_MAX:
        return p + "_chunked"
    return p + "_reconstruct"


# Mixture-of-experts layers (kernels/moe.py): one grouped route per format of the gate/up
# stack, for every batch size (pairs are grouped by expert on the device; 8 pairs per MMA tile).
QPN_MOE_ROUTES = frozenset(f"{ROUTE_PREFIX[f]}_moe" for f in FORMATS)


def moe_route_for(fmt: str) -> str:
    """Route name of a MoE layer whose gate/up experts are stored in ``fmt``."""
    if fmt not in ROUTE_PREFIX:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
    return ROUTE_PREFIX[fmt] + "_moe"


def route_format(route: str) -> str:
    """Format ("nvfp4" / "fp8") a route name serves."""
    if route not in QPN_ROUTES:
        raise ValueError(f"unknown QPN route {route!r}; known routes: {sorted(QPN_ROUTES)}")
    return "nvfp4" if route.startswith("qpn2") else "fp8"


def route_max_m(route: str) -> int | None:
    """Largest M a route's kernel accepts when asked for explicitly (None: any M). The table
    above sends M 17-96 to *_chunked; the kernel itself handles any M (benchmarks use that)."""
    route_format(route)
    if route.endswith("_reconstruct") or route.endswith("_chunked"):
        return None
    if route.endswith("_mt2"):
        return M_MT2_MAX
    return M_SINGLE_TILE_MAX
