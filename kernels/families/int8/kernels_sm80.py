"""The INT8 family's sm_80+ (m16n8k16) kernels, as data: every configured kernel of
csrc/qpn_kernels_sm80.cu it instantiates (``ENTRIES``: kernels/jit.py writes their entry lines into
the source as NVRTC compiles it), which one serves each route, and the family's launch settings.
kernels/sm80_tables.py gathers these from every family; no torch here.

Both members have kernels of their own (WeightFormat.kernel_tag), so the tables are keyed by member.
"""
from __future__ import annotations

from ...weight_format import KernelEntry
from .members import INT8, INT8_SYM

# The register ring with the folded decoder. Only configurations that build for sm_80 AND sm_90
# without spills under the 128-register cap are listed (ptxas 12.9; tests/test_kernels_sm80.py): a
# k-block carries FP8's 32 code bytes per lane, twice INT4's, and the plain decoder runs in the same
# kernel for groups of 32, so INT4's own choices spill here (sm_80: t2d2 32 bytes asymmetric, 20
# symmetric; t2d1 at MT = 2 20 and 12 bytes; t1d2 at MT = 2 16 bytes, t1d3 at MT = 2 on sm_90).
# Among the rest, one H100 run through the device tool (2026-12-06; graph replay of
# sm80_plan.run_sm80_kernel, groups of 128, us, not kept under results/) chose:
# - M <= 8, one tile two k-blocks deep (t1d2) at every layer size: TP1 MLP down 5120 x 17408 at M = 1
#   35.7 against 36.6 (t1d3), 36.8 (t1d4), 37.3 (t2d1); gate_up 34816 x 5120 64.5 against 64.2-65.0;
#   TP4 down 5120 x 4352 12.6 against 13.6-15.6; 1536 x 5120 7.8 against 13.1-15.9; at M = 8 within
#   3% of the best (t2d1, 38.8 against 39.9 on TP1 down). FP8's route kernels on the same shapes, the
#   same code bytes: 32.7, 59.6, 10.9, 6.2 us; torch FP16 65.0, 124.5, 17.0, 7.8 us. Per channel (one
#   record over all of K) the same kernel took 34.7 us on TP1 down.
# - M 9-16 and, once per 16-row chunk, the chunked route: one tile one k-block deep (t1d1): within
#   4% of the plain decoder's t1d2 / t1d3 everywhere; two tiles (t2d1, plain) were 7-12% faster on
#   the TP1 shapes but 20-45% slower on the small ones, and spill 4 bytes on sm_80.
# The shared-memory ring and block-cooperative kernels take no group records (their static_assert).
ROUTE_KERNELS = {
    (INT8, 1): "qpn8i_mt1_m16n8k16_t1d2p0_fold",
    (INT8, 2): "qpn8i_mt2_m16n8k16_t1d1p0_fold",
    (INT8_SYM, 1): "qpn8i_sym_mt1_m16n8k16_t1d2p0_fold",
    (INT8_SYM, 2): "qpn8i_sym_mt2_m16n8k16_t1d1p0_fold",
}
# The route kernels are register rings already: their own.
ROUTE_KERNELS_NO_SMEM = dict(ROUTE_KERNELS)
# Fewest work items per warp: FP8's, whose bytes per item these kernels share.
MIN_ITEMS = {INT8: 2, INT8_SYM: 2}
FRAGMENTS = {"Frag16INT8Asym": INT8, "Frag16INT8Sym": INT8_SYM,
             "Frag16INT8FoldAsym": INT8, "Frag16INT8FoldSym": INT8_SYM}
# No PDL forms: programmatic dependent launch was measured for INT4's route kernels, not for these
# (sm80_plan launches them plainly).

ENTRIES = (
    KernelEntry("QPN80_ENTRY", "qpn8i_mt1_m16n8k16_t1d2p0_fold", "Frag16INT8FoldAsym", (1, 1, 2, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_mt2_m16n8k16_t1d1p0_fold", "Frag16INT8FoldAsym", (2, 1, 1, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_sym_mt1_m16n8k16_t1d2p0_fold", "Frag16INT8FoldSym", (1, 1, 2, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_sym_mt2_m16n8k16_t1d1p0_fold", "Frag16INT8FoldSym", (2, 1, 1, 0, 0)),
    # Measured candidates (above), and the route kernels' configuration with the plain decoder (every
    # operand fp16((code - zero) * scale), as on sm_70 and in the reconstruct pass) at every group size:
    # the GPU tests run each on every group size, so both decoders are checked there.
    KernelEntry("QPN80_ENTRY", "qpn8i_mt1_m16n8k16_t2d1p0_fold", "Frag16INT8FoldAsym", (1, 2, 1, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_mt1_m16n8k16_t1d4p0_fold", "Frag16INT8FoldAsym", (1, 1, 4, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_mt1_m16n8k16_t1d2p0", "Frag16INT8Asym", (1, 1, 2, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_sym_mt1_m16n8k16_t1d2p0", "Frag16INT8Sym", (1, 1, 2, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_mt2_m16n8k16_t1d2p0", "Frag16INT8Asym", (2, 1, 2, 0, 0)),
    KernelEntry("QPN80_RECONSTRUCT_GS_ENTRY", "qpn8i_reconstruct_ws_m16n8k16", "Frag16INT8Asym"),
    KernelEntry("QPN80_RECONSTRUCT_GS_ENTRY", "qpn8i_sym_reconstruct_ws_m16n8k16", "Frag16INT8Sym"),
)
