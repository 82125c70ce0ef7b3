"""THE route table: which QPN route serves a (format, M, N, K) call. One place, used by the
loader's dispatch, the custom ops, the census and the benchmarks alike. A route is never a silent
fallback: every M has exactly one named route, and every route below is a real kernel path.

| M      | NVFP4 (MLP trunk, lm_head)  | FP8 (attention projections) | INT4 W4A16 (AWQ, GPTQ, CT) |
|--------|-----------------------------|-----------------------------|----------------------------|
| 1-8    | qpn2                        | qpn8                        | qpn4                       |
| 9-16   | qpn2_mt2                    | qpn8_mt2                    | qpn4_mt2                   |
| 17-96  | qpn2_chunked                | qpn8_chunked                | qpn4_chunked               |
| > 96   | qpn2_reconstruct            | qpn8_reconstruct            | qpn4_reconstruct           |

* qpn2 / qpn8 / qpn4: one 8-row tile, four quadpairs on N sharing one activation fragment.
* *_mt2: two 8-row tiles against a single pass over the weights.
* *_chunked: on sm_80+ for NVFP4, ONE pass over the weights per 32 or 64 rows (the M-band kernels,
  kernels/sm80_tables.py SM80_BAND_KERNELS; sm80_plan.sm80_kernel_for picks the kernel and the chunk count). On
  sm_70, and for FP8 and INT4 on sm_80+, the M rows cut into 16-row chunks, each chunk an MT2 pass; the chunks of one weight
  tile are scheduled as adjacent blocks so that they stream the same weight bytes at the same
  time (the second and later reads come from L2). Why MT2 chunks and not a wider tile: each 8-row tile
  holds 8 FP32 accumulators per thread beside its decode registers, and a four-tile variant
  spilled 36-40 bytes under the 64-register cap (ptxas, sm_70) that keeps two blocks resident
  per SM on SM70.
  The choice of 16-row chunks over 8-row chunks is by that design reasoning; the H200 benchmark
  also times the 8-row variant, but m8n8k4 is emulated there, so it cannot settle the V100 question.
* *_reconstruct: the packed weights are expanded into a transient FP16 workspace holding
  e2m1 x e4m3-group-scale (NVFP4), e4m3 (FP8), values that FP16 represents exactly, or
  fp16((code - zero) x scale) (INT4, the operand its tiled kernels use too); a GEMM with
  FP32 accumulation and FP32 output runs on it, the per-tensor / per-channel scale is applied in
  FP32 and the workspace is freed when the call returns. Nothing is persisted.
* *_moe (kernels/moe.py): the grouped kernels of a mixture-of-experts layer, one route per format
  of its gate/up stack for every batch size (pairs are grouped by expert on the device). Only the
  families with MoE kernels (formats.MOE_FAMILIES: NVFP4, FP8) have one; INT4 has none.
* INT4's two members (with zero points, symmetric) share the family's routes; each runs its own
  kernels (qpn4_* and qpn4_sym_*, formats.WeightFormat.kernel_tag).
* A family registered but not served yet (formats.py, "Staging") gets the same dense bands as
  UNSERVED_ROUTES: ops runs them (``route_for(..., served_only=False)``), while QPN_ROUTES,
  parse_route and route_for's default do not name them. No family is staged today.

A route travels as a ``Route`` value: its name is parsed once, here, into what the kernels need
(format, kernel kind, token tiles per weight pass, chunk rows) and the M band the table gives it;
``str(route)`` is the name again, which is what the census files, results and gates carry.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import formats

# Route families, one per kernel family of kernels/formats.py (FP8 per tensor and per channel
# share the FP8 family's routes and kernels).
FORMATS = tuple(formats.FAMILIES)
ROUTE_PREFIX = {family: f.route_prefix for family, f in formats.FAMILIES.items()}
# Every family with kernels, served or not (formats.KERNEL_FAMILIES): a family that is not served
# yet (staged) has the same dense bands, as UNSERVED_ROUTES, which ops runs when asked with
# served_only=False and which no served list (QPN_ROUTES, the census, the gates) holds.
_KERNEL_PREFIX = {family: f.route_prefix for family, f in formats.KERNEL_FAMILIES.items()}

# Rows of one token tile (the 8 columns of an m8n8k4 / m16n8k16 MMA that hold tokens).
TILE_ROWS = 8
# Upper M bound of each packed band; above the last, reconstruction.
M_SINGLE_TILE_MAX = 8
M_MT2_MAX = 16
M_CHUNKED_MAX = 96
CHUNK_ROWS = 16

KNOWN_ARCHS = ("sm70", "sm75", "sm80", "sm86", "sm89", "sm90")

# Kernel kinds a route runs.
TILED = "tiled"              # the QPN kernel: packed weights decoded in registers into the MMA
RECONSTRUCT = "reconstruct"  # transient FP16 workspace + an FP32-accumulating GEMM
MOE = "moe"                  # the grouped mixture-of-experts kernels (kernels/moe.py)


@dataclass(frozen=True)
class Route:
    """One QPN route. ``str(route)`` is its name (``qpn2_mt2``); compare routes as values."""

    format: str          # kernel family it serves, a formats.FAMILIES key (nvfp4, fp8, int4)
    kernel: str          # TILED | RECONSTRUCT | MOE
    tiles_per_pass: int  # 8-row token tiles against one weight pass (TILED; 0 otherwise)
    chunk_rows: int      # rows per chunk when M is cut into chunks, each chunk one pass; 0: no chunks
    m_min: int           # the M band route_for gives this route: m_min <= M <= m_max
    m_max: int | None    # None: no upper bound
    name: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "name", _route_name(self))

    def __str__(self) -> str:
        return self.name

    @property
    def weight_format(self) -> formats.WeightFormat:
        """The family's description in kernels/formats.py (FP8: its per-tensor member)."""
        return formats.KERNEL_FAMILIES[self.format]

    @property
    def prefix(self) -> str:
        """The format's route family (``qpn2`` / ``qpn8`` / ``qpn4``), also the kernels' name prefix."""
        return _KERNEL_PREFIX[self.format]

    @property
    def kernel_max_m(self) -> int | None:
        """Largest M the route's kernel accepts when asked for explicitly (None: any M). The table
        sends M 17-96 to *_chunked; the chunked kernel itself handles any M (benchmarks use that)."""
        if self.kernel == TILED and not self.chunk_rows:
            return self.tiles_per_pass * TILE_ROWS
        return None

    def check_m(self, m: int) -> None:
        """Raise ValueError when this route's kernel cannot serve a batch of ``m`` rows."""
        top = self.kernel_max_m
        if top is not None and m > top:
            raise ValueError(f"route {self} serves M <= {top}, got M={m}; use routes.route_for() to pick one")

    def chunks(self, m: int) -> int:
        """How many chunk launches (grid planes) a batch of ``m`` rows takes on this route."""
        return -(-m // self.chunk_rows) if self.chunk_rows else 1

    def band(self) -> dict:
        """The route's M band as the census records it."""
        return {"m_min": self.m_min, "m_max": self.m_max}


# Name suffix of each (kernel, tiles per pass, chunk rows) shape, and back: the only place route
# names are taken apart or put together.
_SUFFIX = {
    (TILED, 1, 0): "",
    (TILED, 2, 0): "_mt2",
    (TILED, 2, CHUNK_ROWS): "_chunked",
    (RECONSTRUCT, 0, 0): "_reconstruct",
    (MOE, 0, 0): "_moe",
}
_SHAPE_OF_SUFFIX = {s: shape for shape, s in _SUFFIX.items()}
# M band of each shape in the route table (MoE: every M).
_BAND = {
    (TILED, 1, 0): (1, M_SINGLE_TILE_MAX),
    (TILED, 2, 0): (M_SINGLE_TILE_MAX + 1, M_MT2_MAX),
    (TILED, 2, CHUNK_ROWS): (M_MT2_MAX + 1, M_CHUNKED_MAX),
    (RECONSTRUCT, 0, 0): (M_CHUNKED_MAX + 1, None),
    (MOE, 0, 0): (1, None),
}
_FORMAT_OF_PREFIX = {p: f for f, p in ROUTE_PREFIX.items()}


def _route_name(r: Route) -> str:
    shape = (r.kernel, r.tiles_per_pass, r.chunk_rows)
    if r.format not in _KERNEL_PREFIX or shape not in _SUFFIX:
        raise ValueError(f"no QPN route is a {r.kernel} kernel with {r.tiles_per_pass} tile(s) per pass and "
                         f"{r.chunk_rows}-row chunks for format {r.format!r}")
    return _KERNEL_PREFIX[r.format] + _SUFFIX[shape]


def _has_shape(fmt: str, shape: tuple) -> bool:
    """Whether family ``fmt`` has kernels of this route shape: every family its dense bands, only
    the families with grouped MoE kernels (formats.MOE_FAMILIES) a MoE route."""
    return shape[0] != MOE or fmt in formats.MOE_FAMILIES


def parse_route(name: str) -> Route:
    """The Route a route name stands for. ValueError names the known routes."""
    prefix, sep, suffix = str(name).partition("_")
    fmt = _FORMAT_OF_PREFIX.get(prefix)
    shape = _SHAPE_OF_SUFFIX.get(sep + suffix)
    if fmt is None or shape is None or not _has_shape(fmt, shape):
        raise ValueError(f"unknown QPN route {name!r}; known routes: {sorted(_NAMES)}")
    m_min, m_max = _BAND[shape]
    return Route(fmt, *shape, m_min, m_max)


_NAMES = tuple(p + s for p, f in _FORMAT_OF_PREFIX.items() for s, shape in _SHAPE_OF_SUFFIX.items()
               if _has_shape(f, shape))
# Every route, by name.
ALL_ROUTES: dict[str, Route] = {n: parse_route(n) for n in _NAMES}

QPN_ROUTES = frozenset(n for n, r in ALL_ROUTES.items() if r.kernel != MOE)
# Mixture-of-experts layers (kernels/moe.py): one grouped route per format of the gate/up stack.
QPN_MOE_ROUTES = frozenset(n for n, r in ALL_ROUTES.items() if r.kernel == MOE)

# The dense routes of the families with kernels that are not served yet (no MoE route: no MoE
# kernels), by name; routes.as_route knows them, parse_route and the served lists do not.
UNSERVED_ROUTES: dict[str, Route] = {
    p + s: Route(f, *shape, *_BAND[shape]) for f, p in _KERNEL_PREFIX.items() if f not in ROUTE_PREFIX
    for s, shape in _SHAPE_OF_SUFFIX.items() if shape[0] != MOE}

# Dense routes of each format in band order (route_for walks them).
_DENSE_BANDS = {f: tuple(sorted((r for r in (*ALL_ROUTES.values(), *UNSERVED_ROUTES.values())
                                 if r.format == f and r.kernel != MOE), key=lambda r: r.m_min))
                for f in _KERNEL_PREFIX}


def as_route(route: Route | str) -> Route:
    """A Route, given a Route or a route name (a table lookup: names were parsed at import)."""
    if isinstance(route, Route):
        return route
    r = ALL_ROUTES.get(route) or UNSERVED_ROUTES.get(route)
    return r if r is not None else parse_route(route)  # parse_route raises naming the known routes


def _check_format(fmt: str, served_only: bool = True) -> None:
    if fmt not in (ROUTE_PREFIX if served_only else _KERNEL_PREFIX):
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


def route_for(fmt: str, m: int, n: int, k: int, arch: str = "sm70", served_only: bool = True) -> Route:
    """Route of one linear call: fmt is a served family (formats.FAMILIES), m = rows in the batch;
    with ``served_only`` False also a family whose kernels exist but that is not served yet
    (formats.KERNEL_FAMILIES: its UNSERVED_ROUTES)."""
    _check_format(fmt, served_only)
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"M (rows in the batch) must be a positive int, got {m!r}")
    if n < 1 or k < 1:
        raise ValueError(f"N and K must be positive, got N={n} K={k}")
    # FormatError (a ValueError): NVFP4 needs K % 16 == 0; a format whose weights choose their group
    # size needs K to be a multiple of its smallest (the weight's own is checked at prepack)
    f = formats.KERNEL_FAMILIES[fmt]
    f.check_k(k, min(f.group_sizes) if f.group_sizes else None)
    if arch not in KNOWN_ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {KNOWN_ARCHS}")
    for r in _DENSE_BANDS[fmt]:
        if r.m_max is None or m <= r.m_max:
            return r
    raise AssertionError("the last band of the route table is unbounded")


def tiled_route(fmt: str, tiles_per_pass: int) -> Route:
    """The unchunked tiled route whose kernel runs ``tiles_per_pass`` token tiles per weight pass."""
    _check_format(fmt)
    return ALL_ROUTES[ROUTE_PREFIX[fmt] + _SUFFIX[(TILED, tiles_per_pass, 0)]]


def moe_route_for(fmt: str) -> Route:
    """Route of a MoE layer whose gate/up experts are stored in ``fmt``."""
    _check_format(fmt)
    if fmt not in formats.MOE_FAMILIES:
        raise ValueError(f"{formats.FAMILIES[fmt].title} has no QPN MoE kernels; the families with MoE "
                         f"routes are {sorted(formats.MOE_FAMILIES)}")
    return ALL_ROUTES[ROUTE_PREFIX[fmt] + _SUFFIX[(MOE, 0, 0)]]


def route_format(route: Route | str) -> str:
    """Format family (a formats.FAMILIES key) a dense route serves."""
    r = as_route(route)
    if r.kernel == MOE:
        raise ValueError(f"{r} is a MoE route; known dense routes: {sorted(QPN_ROUTES)}")
    return r.format


def route_max_m(route: Route | str) -> int | None:
    """Largest M a dense route's kernel accepts when asked for explicitly (None: any M)."""
    route_format(route)
    return as_route(route).kernel_max_m
