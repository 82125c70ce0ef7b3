"""The FP8 family's sm_80+ (m16n8k16) kernels, as data: every configured kernel of
csrc/qpn_kernels_sm80.cu it instantiates (``ENTRIES``: kernels/jit.py writes their entry lines into
the source as NVRTC compiles it), which one serves each route, and the family's launch settings.
kernels/sm80_tables.py gathers these from every family; no torch here.
"""
from __future__ import annotations

from ...weight_format import KernelEntry
from .members import FP8_TENSOR

# (results/kernel_sm80_ring3_sweep_h200_20261130.csv: FP8 stays on the register ring for M <= 8.
# Run 6 (results/kernel_sm80_fp8swizzle_sweep_h200_20261130.csv): once the FP8 ring's copies were
# coalesced (chunk_pos in the .cu), the ring t2s3x has the best mean for M 9-16: in_proj 57.8% vs
# 53.0% for the register t1d4p0, out_proj 36.8% vs 37.5%.
# 2026-12-01: M <= 8 moved from the per-warp register ring t2d2p0 to its block-cooperative form
# t2d2c, 3 points of the read ceiling faster on average over the TP1 FP8 shapes at M 1 and 8,
# results/kernel_sm80_coop2_sweep_h200_20261201.csv.) No M-band kernels: the FP8 band forms tie on
# in_proj and lose on out_proj, so the chunked route runs the MT = 2 kernel per 16-row chunk.
ROUTE_KERNELS = {
    (FP8_TENSOR, 1): "qpn8_mt1_m16n8k16_t2d2c",
    (FP8_TENSOR, 2): "qpn8_mt2_m16n8k16_t2s3x",
}
# Launched in their *_pdl form on sm_90+ (sm80_plan.pdl_form): both route kernels, 1.6-2.8 us
# faster per call at M 1-8 and on all four FP8 shapes at M 16
# (results/kernel_matched_sm80_pdlfp8_h200_20261201.csv, results/kernel_matched_sm80_readlimit_h200_20261201.csv).
PDL_KERNELS = frozenset({ROUTE_KERNELS[FP8_TENSOR, 1], ROUTE_KERNELS[FP8_TENSOR, 2]})
ROUTE_KERNELS_NO_SMEM = {
    (FP8_TENSOR, 1): "qpn8_mt1_m16n8k16_t2d2c",   # 16 KB of static shared memory: fits every sm_80+ GPU
    (FP8_TENSOR, 2): "qpn8_mt2_m16n8k16_t1d4p0",
}
MIN_ITEMS = {FP8_TENSOR: 2}
FRAGMENTS = {"Frag16FP8": FP8_TENSOR}

ENTRIES = (
    KernelEntry("QPN80_ENTRY", "qpn8_mt1_m16n8k16_t2d2p0", "Frag16FP8", (1, 2, 2, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8_mt1_m16n8k16_t2d2p8", "Frag16FP8", (1, 2, 2, 8, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8_mt1_m16n8k16_t2d2p16", "Frag16FP8", (1, 2, 2, 16, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8_mt1_m16n8k16_t1d4p8", "Frag16FP8", (1, 1, 4, 8, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8_mt2_m16n8k16_t1d4p0", "Frag16FP8", (2, 1, 4, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8_mt2_m16n8k16_t1d4p8", "Frag16FP8", (2, 1, 4, 8, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8_mt2_m16n8k16_t2d1p8", "Frag16FP8", (2, 2, 1, 8, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8_mt2_m16n8k16_t2d1p16", "Frag16FP8", (2, 2, 1, 16, 0)),
    KernelEntry("QPN80R_ENTRY", "qpn8_mt1_m16n8k16_t2s4", "Frag16FP8", (1, 2, 4, 2, 0)),
    KernelEntry("QPN80R_ENTRY", "qpn8_mt2_m16n8k16_t1s4", "Frag16FP8", (2, 1, 4, 2, 0)),
    KernelEntry("QPN80RX_ENTRY", "qpn8_mt1_m16n8k16_t2s4x", "Frag16FP8", (1, 2, 4, 3, 0)),
    KernelEntry("QPN80RX_ENTRY", "qpn8_mt1_m16n8k16_t4s3x", "Frag16FP8", (1, 4, 3, 2, 0)),
    KernelEntry("QPN80RX_ENTRY", "qpn8_mt2_m16n8k16_t2s3x", "Frag16FP8", (2, 2, 3, 2, 0)),
    KernelEntry("QPN80_RECONSTRUCT_ENTRY", "qpn8_reconstruct_ws_m16n8k16", "Frag16FP8"),
    KernelEntry("QPN80_ENTRY", "qpn8_mt1_m16n8k16_t2d2p8_loadonly", "Frag16FP8", (1, 2, 2, 8, 3)),
    KernelEntry("QPN80_ENTRY", "qpn8_mt1_m16n8k16_t2d2p0_loadonly", "Frag16FP8", (1, 2, 2, 0, 3)),
    KernelEntry("QPN80R_ENTRY", "qpn8_mt1_m16n8k16_t2s4_loadonly", "Frag16FP8", (1, 2, 4, 2, 3)),
    KernelEntry("QPN80RX_ENTRY", "qpn8_mt1_m16n8k16_t2s4x_loadonly", "Frag16FP8", (1, 2, 4, 3, 3)),
    KernelEntry("QPN80_ENTRY", "qpn8_mt1_m16n8k16_t2d2p0_pdl", "Frag16FP8", (1, 2, 2, 0, 7)),
    KernelEntry("QPN80RX_ENTRY", "qpn8_mt2_m16n8k16_t2s3x_pdl", "Frag16FP8", (2, 2, 3, 2, 7)),
    # Block-cooperative register ring (Qpn80Coop): <format>_mt<MT>_m16n8k16_t<T>d<D>c. FP8 M <= 8 only:
    # there it beats the per-warp ring t2d2p0 on every TP1 FP8 shape, by 3 points of the read ceiling
    # on average (in_proj M = 1 27.5 vs 28.7 us, out_proj 15.2 vs 16.3 us;
    # results/kernel_sm80_coop2_sweep_h200_20261201.csv). Measured and dropped: the NVFP4 forms
    # (t2d4c: lm_head 49.5% vs 62.3%, gate_up and down slower too: with the NVFP4 decode the kernel is
    # issue-bound and the block's meeting points cost more than the loads gain) and the M 9-16 forms
    # (t1d4c / t1d2c, slower than the shared-memory rings on the large layers) -- commit 221380d and
    # the same CSV; and one tile per warp (FP8 t1d4c / t1d2c, also at 3 blocks per SM; NVFP4 t1d4c),
    # none faster on the TP1 shapes (kernel_sm80_coop3_sweep_h200_20261201.csv, in results/ before c058460; the commit
    # before the one that dropped them).
    KernelEntry("QPN80C_ENTRY", "qpn8_mt1_m16n8k16_t2d2c", "Frag16FP8", (1, 2, 2, 2, 0)),
    KernelEntry("QPN80C_ENTRY", "qpn8_mt1_m16n8k16_t2d2c_loadonly", "Frag16FP8", (1, 2, 2, 2, 3)),
    KernelEntry("QPN80C_ENTRY", "qpn8_mt1_m16n8k16_t2d2c_pdl", "Frag16FP8", (1, 2, 2, 2, 7)),
    KernelEntry("QPN80B_ENTRY", "qpn8_mt8_m16n8k16_t2d2s4_b1", "Frag16FP8", (8, 2, 2, 4, 1, 0)),
    KernelEntry("QPN80B_ENTRY", "qpn8_mt4_m16n8k16_t1d1s4_b2", "Frag16FP8", (4, 1, 1, 4, 2, 0)),
    KernelEntry("QPN80B_ENTRY", "qpn8_mt4_m16n8k16_t1d0s8_b2", "Frag16FP8", (4, 1, 0, 8, 2, 0)),
)

# The grouped mixture-of-experts kernels of csrc/qpn_moe_sm80.cu (gate/up with the fused SiLU, down),
# written into the source by jit.moe_entry_lines.
MOE_ENTRIES = (
    KernelEntry("QPN_MOE80_GEMM_ENTRY", "qpn8_moe_gate_up_m16n8k16", "Frag16FP8", ("true",)),
    KernelEntry("QPN_MOE80_GEMM_ENTRY", "qpn8_moe_down_m16n8k16", "Frag16FP8", ("false",)),
)
