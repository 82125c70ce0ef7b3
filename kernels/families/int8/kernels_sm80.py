"""The INT8 family's sm_80+ (m16n8k16) kernels, as data: every configured kernel of
csrc/qpn_kernels_sm80.cu it instantiates (``ENTRIES``: kernels/jit.py writes their entry lines into
the source as NVRTC compiles it), which one serves each route, and the family's launch settings.
kernels/sm80_tables.py gathers these from every family; no torch here.

Both members have kernels of their own (WeightFormat.kernel_tag), so the tables are keyed by member.
The family is staged (members.py): its route kernels are ``UNSERVED_ROUTE_KERNELS``, which the
launch planning finds (sm80_plan.sm80_kernel_for) and the served tables leave out.
"""
from __future__ import annotations

from ...weight_format import KernelEntry
from .members import INT8, INT8_SYM

# The register ring with the folded decoder, not swept for this family (no GPU timing of INT8 yet);
# the configurations are those that build for sm_80 AND sm_90 without spills under the 128-register
# cap (ptxas 12.9; tests/test_kernels_sm80.py), chosen to keep INT4's bytes in flight per warp. A
# k-block carries FP8's 32 code bytes per lane, twice INT4's, and its plain decoder runs in the same
# kernel for groups of 32, so INT4's own configurations spill here: sm_80 t2d2 (INT4's M <= 8 kernel)
# 32 bytes asymmetric, 20 symmetric; t2d1 at MT = 2 (INT4's M 9-16 kernel) 20 and 12 bytes; t1d2 at
# MT = 2 16 bytes. So M <= 8 runs two tiles one k-block deep (t2d1: 2 KB in flight per warp, as
# INT4's t2d2, and two tiles sharing each activation load), M 9-16 and, once per 16-row chunk, the
# chunked route one tile one k-block deep (t1d1: 1 KB, as INT4's t2d1). t1d2 and t1d4 at MT = 1
# (2 and 4 KB, one tile) are built as candidates for a sweep. The shared-memory ring and
# block-cooperative kernels take no group records (their static_assert), so there is no other kind
# of kernel to choose here.
UNSERVED_ROUTE_KERNELS = {
    (INT8, 1): "qpn8i_mt1_m16n8k16_t2d1p0_fold",
    (INT8, 2): "qpn8i_mt2_m16n8k16_t1d1p0_fold",
    (INT8_SYM, 1): "qpn8i_sym_mt1_m16n8k16_t2d1p0_fold",
    (INT8_SYM, 2): "qpn8i_sym_mt2_m16n8k16_t1d1p0_fold",
}
# Fewest work items per warp: FP8's, whose bytes per item these kernels share.
MIN_ITEMS = {INT8: 2, INT8_SYM: 2}
FRAGMENTS = {"Frag16INT8Asym": INT8, "Frag16INT8Sym": INT8_SYM,
             "Frag16INT8FoldAsym": INT8, "Frag16INT8FoldSym": INT8_SYM}
# No PDL forms: programmatic dependent launch was measured for INT4's route kernels, not for these
# (sm80_plan launches them plainly).

ENTRIES = (
    KernelEntry("QPN80_ENTRY", "qpn8i_mt1_m16n8k16_t2d1p0_fold", "Frag16INT8FoldAsym", (1, 2, 1, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_mt2_m16n8k16_t1d1p0_fold", "Frag16INT8FoldAsym", (2, 1, 1, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_sym_mt1_m16n8k16_t2d1p0_fold", "Frag16INT8FoldSym", (1, 2, 1, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_sym_mt2_m16n8k16_t1d1p0_fold", "Frag16INT8FoldSym", (2, 1, 1, 0, 0)),
    # Candidates for a sweep (one tile per warp, a deeper ring), and the route kernels' configuration
    # with the plain decoder (every operand fp16((code - zero) * scale), as on sm_70 and in the
    # reconstruct pass) at every group size: the GPU tests run each on every group size, so both
    # decoders are checked there, and a sweep can time the fold against it.
    KernelEntry("QPN80_ENTRY", "qpn8i_mt1_m16n8k16_t1d2p0_fold", "Frag16INT8FoldAsym", (1, 1, 2, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_mt1_m16n8k16_t1d4p0_fold", "Frag16INT8FoldAsym", (1, 1, 4, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_mt1_m16n8k16_t2d1p0", "Frag16INT8Asym", (1, 2, 1, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn8i_sym_mt1_m16n8k16_t2d1p0", "Frag16INT8Sym", (1, 2, 1, 0, 0)),
    KernelEntry("QPN80_RECONSTRUCT_GS_ENTRY", "qpn8i_reconstruct_ws_m16n8k16", "Frag16INT8Asym"),
    KernelEntry("QPN80_RECONSTRUCT_GS_ENTRY", "qpn8i_sym_reconstruct_ws_m16n8k16", "Frag16INT8Sym"),
)
