"""The sm_80+ (m16n8k16) kernel tables, gathered from the families: which configured kernel of
csrc/qpn_kernels_sm80.cu serves each packed route, the kernels that replace them where a GPU cannot
give a block their shared memory, the M-band kernels, which route kernels launch with programmatic
dependent launch, the fewest work items per warp, the fragment decoder each format's kernels are
configured with, and every configured kernel's entry line.

Each family states its own in kernels/families/<family>/kernels_sm80.py (data, keyed by its
WeightFormat members, with the measurements behind each choice); this module merges them, in the
families' order, so that the build (jit.ENTRY_POINTS, jit.sm80_entry_lines) can require every kernel
named here and the launch planning (sm80_plan) can pick among them. Nothing on the SM70 path reads
it. A family without sm_80+ kernels has no kernels_sm80.py.
"""
from __future__ import annotations

from . import families
from .weight_format import KernelEntry

_TABLES = families.family_modules("kernels_sm80")


def _merged(name: str) -> dict:
    return {k: v for t in _TABLES for k, v in getattr(t, name, {}).items()}


# (the format family's WeightFormat, or for a family whose members have kernels of their own each
# member; token tiles per weight pass) -> the route kernel
SM80_ROUTE_KERNELS: dict = _merged("ROUTE_KERNELS")
# Layers with at least SM80_LARGE_N[format] output rows use SM80_LARGE_N_KERNELS instead, where listed.
SM80_LARGE_N: dict = _merged("LARGE_N")
SM80_LARGE_N_KERNELS: dict = _merged("LARGE_N_KERNELS")
# The *_chunked route (M 17-96): the M-band kernels of a format family, by token tiles (MT) ascending;
# sm80_plan.sm80_kernel_for takes the first whose 8 x MT rows hold M, else the last: one weight pass
# per chunk of its 8 x MT rows. A family not listed runs its (family, 2) kernel once per 16-row chunk.
SM80_BAND_KERNELS: dict = _merged("BAND_KERNELS")
# Route kernels whose *_pdl form (VAR 7) sm80_plan launches with programmatic dependent launch on
# sm_90+ (sm80_plan.pdl_form). In a model's MLP block, torch kernels between, no measurable change
# (docs/architecture.md).
SM80_PDL_KERNELS = frozenset(k for t in _TABLES for k in getattr(t, "PDL_KERNELS", ()))
# The register-ring kernels (no shared memory) serve a route when the GPU cannot give a block the
# ring kernel's shared memory (sm_86 / sm_89 allow about 99 KB per block).
SM80_ROUTE_KERNELS_NO_SMEM: dict = _merged("ROUTE_KERNELS_NO_SMEM")
# The route kernels of a staged format (kernels, no served route yet: formats.py, "Staging"), keyed
# as SM80_ROUTE_KERNELS; kept out of it, which the served tools (benchmarks, route checks) read as
# the served set. No format is staged today.
SM80_UNSERVED_ROUTE_KERNELS: dict = _merged("UNSERVED_ROUTE_KERNELS")
# Fewest work items (k-blocks of one weight group) per warp, per format (family member): below about
# the ring depth a warp spends its time filling the ring and reducing, so small layers get fewer,
# longer runs (sm80_plan.sm80_partition).
SM80_MIN_ITEMS: dict = _merged("MIN_ITEMS")
# The fragment decoder each format's kernels are configured with (an entry's decoder starts with
# it; no key is the start of another).
SM80_FRAGMENTS: dict = _merged("FRAGMENTS")
# Every configured kernel of csrc/qpn_kernels_sm80.cu, family by family (jit.sm80_entry_lines).
SM80_ENTRIES: tuple[KernelEntry, ...] = tuple(e for t in _TABLES for e in t.ENTRIES)
# Every grouped MoE kernel of csrc/qpn_moe_sm80.cu (jit.moe_entry_lines).
SM80_MOE_ENTRIES: tuple[KernelEntry, ...] = tuple(e for t in _TABLES for e in getattr(t, "MOE_ENTRIES", ()))
