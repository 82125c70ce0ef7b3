"""The NVFP4 family's sm_80+ (m16n8k16) kernels, as data: every configured kernel of
csrc/qpn_kernels_sm80.cu it instantiates (``ENTRIES``: kernels/jit.py writes their entry lines into
the source as NVRTC compiles it), which one serves each route, and the family's launch settings.
kernels/sm80_tables.py gathers these from every family; no torch here.

Kernel names: <format>_mt<MT>_m16n8k16_t<T>d<D>p<PF>[_variant] (register ring), ..._t<T>s<S>[x]
(shared-memory ring; x: activations from global memory), ..._b<MINB> (M-band); what the fields
mean is the macros' comment in csrc/qpn_kernels_sm80.cu. Route choices were measured on the H200
among the spill-free configurations (benchmarks/kernel_matched_bench.py --sweep); a change to a
route table needs no recompilation.
"""
from __future__ import annotations

from ...weight_format import KernelEntry
from .members import NVFP4

# (H200 sweeps 2026-11-30, results/kernel_sm80_ring_sweep_h200_20261130.csv (TP1 shapes) and
# results/kernel_sm80_ring3_sweep_h200_20261130.csv: the register ring t2d4p0 is best for M <= 8
# on every measured shape except the largest, lm_head (248320 rows), where the shared-memory ring
# t4s4 reads at 63% of the ceiling against 58% (LARGE_N_KERNELS); M 9-16 goes to the ring t2s4x --
# results/kernel_sm80_ring_notes_h200_20261130.md.)
ROUTE_KERNELS = {
    (NVFP4, 1): "qpn2_mt1_m16n8k16_t2d4p0",
    (NVFP4, 2): "qpn2_mt2_m16n8k16_t2s4x",
}
# Layers with at least LARGE_N output rows (lm_head) use these instead.
# (2026-12-01, session 3: the operands lost their * 2^7 everywhere except in t4s4, where the
# unit-scale form t4s4_u measured 2% slower; see Frag16NVFP4Scaled in qpn_atom_m16n8k16.cuh. The
# threshold was 100,000 (TP1 lm_head only); two H200 sweeps of the same lease
# (results/kernel_sm80_depth{1,2}_sweep_h200_20261201.csv) put t4s4 7-10% ahead of t2d4p0 on TP4
# lm_head (62,080 rows: 64.5 / 66.0 against 69.3 / 73.0 us at M = 1 / 8), even with it on TP1
# gate_up (34,816 rows, its x 2^7 form t4s4_s7 in the 4a6d26c sweeps: 41.5 / 42.9 against 42.0 / 43.4
# us) and behind it on the smaller layers; hence 50,000.)
LARGE_N = {NVFP4: 50_000}
LARGE_N_KERNELS = {(NVFP4, 1): "qpn2_mt1_m16n8k16_t4s4"}
# The *_chunked route (M 17-96): the M-band kernels by token tiles (MT) ascending. H200 sweeps
# 2026-12-01 (results/kernel_sm80_band_sweep_h200_20261201.csv, _sweep2_): 1.3-1.7x faster than the
# 16-row chunks at M 17-64 on gate_up and down.
BAND_KERNELS = {NVFP4: ("qpn2_mt4_m16n8k16_t1d4s4_b2", "qpn2_mt8_m16n8k16_t1d2s4_b2")}
# Launched in their *_pdl form on sm_90+ (sm80_plan.pdl_form): the mt1 kernels. The mt2 ring stays on
# plain launches (slower with PDL on the small layers: down 33.8 -> 34.2 us, TP4 down 17.9 -> 19.0
# us; results/kernel_sm80_pdl_notes_h200_20261201.md).
PDL_KERNELS = frozenset({ROUTE_KERNELS[NVFP4, 1], LARGE_N_KERNELS[NVFP4, 1]})
# Where a GPU cannot give a block the ring kernel's shared memory (sm_86 / sm_89: about 99 KB).
ROUTE_KERNELS_NO_SMEM = {
    (NVFP4, 1): "qpn2_mt1_m16n8k16_t2d4p0",
    (NVFP4, 2): "qpn2_mt2_m16n8k16_t1d4p8",
}
# Fewest work items (k-blocks of one weight group) per warp (sm80_plan.sm80_partition).
MIN_ITEMS = {NVFP4: 4}
# The fragment decoders the family's kernels are configured with (an entry's decoder starts with one).
FRAGMENTS = {"Frag16NVFP4": NVFP4}

ENTRIES = (
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d4p0", "Frag16NVFP4", (1, 2, 4, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d4p8", "Frag16NVFP4", (1, 2, 4, 8, 0)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d4p16", "Frag16NVFP4", (1, 2, 4, 16, 0)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d2p8", "Frag16NVFP4", (1, 2, 2, 8, 0)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt2_m16n8k16_t1d4p0", "Frag16NVFP4", (2, 1, 4, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt2_m16n8k16_t1d4p8", "Frag16NVFP4", (2, 1, 4, 8, 0)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt2_m16n8k16_t1d4p16", "Frag16NVFP4", (2, 1, 4, 16, 0)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt2_m16n8k16_t1d2p8", "Frag16NVFP4", (2, 1, 2, 8, 0)),
    KernelEntry("QPN80R_ENTRY", "qpn2_mt1_m16n8k16_t2s4", "Frag16NVFP4", (1, 2, 4, 3, 0)),
    KernelEntry("QPN80R_ENTRY", "qpn2_mt1_m16n8k16_t4s4", "Frag16NVFP4S7", (1, 4, 4, 2, 0)),
    KernelEntry("QPN80R_ENTRY", "qpn2_mt2_m16n8k16_t2s4", "Frag16NVFP4", (2, 2, 4, 2, 0)),
    KernelEntry("QPN80RX_ENTRY", "qpn2_mt1_m16n8k16_t2s6x", "Frag16NVFP4", (1, 2, 6, 3, 0)),
    KernelEntry("QPN80RX_ENTRY", "qpn2_mt1_m16n8k16_t4s4x", "Frag16NVFP4", (1, 4, 4, 2, 0)),
    KernelEntry("QPN80RX_ENTRY", "qpn2_mt1_m16n8k16_t4s6x", "Frag16NVFP4", (1, 4, 6, 2, 0)),
    KernelEntry("QPN80RX_ENTRY", "qpn2_mt2_m16n8k16_t2s4x", "Frag16NVFP4", (2, 2, 4, 2, 0)),
    KernelEntry("QPN80_RECONSTRUCT_ENTRY", "qpn2_reconstruct_ws_m16n8k16", "Frag16NVFP4Exact"),
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d4p8_exact", "Frag16NVFP4Exact", (1, 2, 4, 8, 0)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d4p8_nodecode", "Frag16NVFP4", (1, 2, 4, 8, 1)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d4p8_nomma", "Frag16NVFP4", (1, 2, 4, 8, 2)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d4p8_loadonly", "Frag16NVFP4", (1, 2, 4, 8, 3)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d4p0_loadonly", "Frag16NVFP4", (1, 2, 4, 0, 3)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt2_m16n8k16_t1d4p8_nomma", "Frag16NVFP4", (2, 1, 4, 8, 2)),
    KernelEntry("QPN80R_ENTRY", "qpn2_mt1_m16n8k16_t2s4_nodecode", "Frag16NVFP4", (1, 2, 4, 3, 1)),
    KernelEntry("QPN80R_ENTRY", "qpn2_mt1_m16n8k16_t2s4_loadonly", "Frag16NVFP4", (1, 2, 4, 3, 3)),
    KernelEntry("QPN80RX_ENTRY", "qpn2_mt1_m16n8k16_t4s4x_loadonly", "Frag16NVFP4", (1, 4, 4, 2, 3)),
    KernelEntry("QPN80_ENTRY", "qpn2_mt1_m16n8k16_t2d4p0_pdl", "Frag16NVFP4", (1, 2, 4, 0, 7)),
    KernelEntry("QPN80RX_ENTRY", "qpn2_mt2_m16n8k16_t2s4x_pdl", "Frag16NVFP4", (2, 2, 4, 2, 7)),
    KernelEntry("QPN80R_ENTRY", "qpn2_mt1_m16n8k16_t4s4_pdl", "Frag16NVFP4S7", (1, 4, 4, 2, 7)),
    # Issue 14, 2026-12-01: more warps per SM for the register ring. A pure-read kernel of the register
    # ring's access pattern reads gate_up at 80% of the ceiling with 16 warps per SM and 93% with 32
    # (results/read_probe_h200_20261201.csv). With one tile per warp the ring fits 80 registers without
    # spills (24 warps per SM): its loads alone, without the split-K finish, reach 72% on gate_up at
    # M = 1 (the two-tile route kernel's loads with their finish: 67%), but the kernel is slower (47.1
    # vs 43.2 us; down 27.7 vs 27.2;
    # kernel_sm80_occupancy_sweep_h200_20261201.csv, in results/ before c058460): the decode and MMA, which the second
    # tile's shared activation loads made cheaper, take back what the loads gain. Measured only; the
    # two-tile D = 2 and 64-register forms spill.
    KernelEntry("QPN80M_ENTRY", "qpn2_mt1_m16n8k16_t1d4p0_b3", "Frag16NVFP4", (1, 1, 4, 0, 3, 0)),
    KernelEntry("QPN80M_ENTRY", "qpn2_mt1_m16n8k16_t1d4p0_b3_loadonly", "Frag16NVFP4", (1, 1, 4, 0, 3, 4)),
    KernelEntry("QPN80B_ENTRY", "qpn2_mt8_m16n8k16_t1d8s4_b1", "Frag16NVFP4", (8, 1, 8, 4, 1, 0)),
    KernelEntry("QPN80B_ENTRY", "qpn2_mt4_m16n8k16_t1d4s4_b2", "Frag16NVFP4", (4, 1, 4, 4, 2, 0)),
    KernelEntry("QPN80B_ENTRY", "qpn2_mt8_m16n8k16_t1d4s4_b1_loadonly", "Frag16NVFP4", (8, 1, 4, 4, 1, 3)),
    KernelEntry("QPN80B_ENTRY", "qpn2_mt8_m16n8k16_t1d2s4_b2", "Frag16NVFP4", (8, 1, 2, 4, 2, 0)),
    KernelEntry("QPN80B_ENTRY", "qpn2_mt4_m16n8k16_t1d0s12_b2", "Frag16NVFP4", (4, 1, 0, 12, 2, 0)),
    # The large-N kernel with the unit-scale NVFP4 form of the other routes (measured variant; the route
    # form t4s4 keeps the scales * 2^7, Frag16NVFP4S7, 2% faster there).
    KernelEntry("QPN80R_ENTRY", "qpn2_mt1_m16n8k16_t4s4_u", "Frag16NVFP4", (1, 4, 4, 2, 0)),
    # Session 3, measured and dropped (commit 23f9732 holds them): ring depths around the large-N kernel in
    # the x 2^7 form (t4s3, t4s4x, t4s6x) and the NVFP4 M 9-16 ring (t2s3x, t2s6x, t2s8x); none beats
    # t4s4 / t2s4x beyond the run-to-run spread (results/kernel_sm80_depth{1,2}_sweep_h200_20261201.csv).
)

# The grouped mixture-of-experts kernels of csrc/qpn_moe_sm80.cu (gate/up with the fused SiLU, down),
# written into the source by jit.moe_entry_lines.
MOE_ENTRIES = (
    KernelEntry("QPN_MOE80_GEMM_ENTRY", "qpn2_moe_gate_up_m16n8k16", "Frag16NVFP4", ("true",)),
    KernelEntry("QPN_MOE80_GEMM_ENTRY", "qpn2_moe_down_m16n8k16", "Frag16NVFP4", ("false",)),
)
