"""The INT4 family's sm_80+ (m16n8k16) kernels, as data: every configured kernel of
csrc/qpn_kernels_sm80.cu it instantiates (``ENTRIES``: kernels/jit.py writes their entry lines into
the source as NVRTC compiles it), which one serves each route, and the family's launch settings.
kernels/sm80_tables.py gathers these from every family; no torch here.

Both members have kernels of their own (WeightFormat.kernel_tag), so the tables are keyed by member.
"""
from __future__ import annotations

from ...weight_format import KernelEntry
from .members import INT4, INT4_SYM

# The register ring with the folded decoder, chosen by two H200 sweeps of 2026-12-04
# (results/kernel_int4_sweep_h200_20261204.csv, _sweep2_): M <= 8 t2d2 at every layer size; M 9-16
# and, once per 16-row chunk, the chunked route: t2d1. No large-N kernel since the fold kernels issue
# their ring refills before the group fold: two tiles per warp (t2d2) then beat four (t4d1) on
# every gate_up shape at M 1-8, TP1 32.6 against 34.6 us, TP2 19.6 against 22.0 us at M = 1
# (results/kernel_int4_refill_gateup_sweep_h200_20261204.csv); before it four tiles had been 8-13%
# faster from 16,384 rows.
ROUTE_KERNELS = {
    (INT4, 1): "qpn4_mt1_m16n8k16_t2d2p0_fold",
    (INT4, 2): "qpn4_mt2_m16n8k16_t2d1p0_fold",
    (INT4_SYM, 1): "qpn4_sym_mt1_m16n8k16_t2d2p0_fold",
    (INT4_SYM, 2): "qpn4_sym_mt2_m16n8k16_t2d1p0_fold",
}
# The mt1 kernels launch in their *_pdl form on sm_90+: 1.1-1.5 us faster per call on every TP1 /
# TP2 shape at M 1 and 8 (results/kernel_matched_int4_pdl_h200_20261204.csv); the mt2 kernels were
# not timed with PDL.
PDL_KERNELS = frozenset({ROUTE_KERNELS[INT4, 1], ROUTE_KERNELS[INT4_SYM, 1]})
# The route kernels are register rings already: their own.
ROUTE_KERNELS_NO_SMEM = dict(ROUTE_KERNELS)
# As NVFP4, whose ring depth its kernels share.
MIN_ITEMS = {INT4: 4, INT4_SYM: 4}
FRAGMENTS = {"Frag16INT4Asym": INT4, "Frag16INT4Sym": INT4_SYM,
             "Frag16INT4FoldAsym": INT4, "Frag16INT4FoldSym": INT4_SYM}

ENTRIES = (
    # INT4 W4A16 (issue 26; the route kernels sm80_tables.SM80_ROUTE_KERNELS names for both members).
    # The register ring with the folded decoder (Frag16INT4FoldForm: group scales applied to FP32 sums;
    # groups of 32 run its plain form in the same kernel), the same 16 code bytes per lane per (tile,
    # k-block) as NVFP4 and an 8-byte (asymmetric) or 4-byte (symmetric) record load where NVFP4 has an
    # 8-byte scale load. Chosen by H200 sweeps of 2026-12-04 (results/kernel_int4_sweep_h200_20261204.csv,
    # _sweep2_, _sweep3_): the fold alone 3-8% faster than the same configuration decoding scaled FP16
    # operands; a shallower ring (t2d2) faster than the NVFP4 routes' t2d4; M 9-16 two tiles one k-block
    # deep (t2d1: 47.7 against 61.2 us on gate_up TP1 for the t1d4 form). Configurations with three
    # tiles, a ring of 3+ with two or an L2 prefetch were slower; with four tiles and a ring of 2, or
    # MT = 2 with t2d2 / t1d2, they spill. On the down layers one tile per warp (t1d2, t1d3) and more
    # items per warp were slower too. No ring kernel (their cp.async layout copies per-k-block scale
    # blocks, not group records) and no M-band kernel (the chunked route runs the MT = 2 kernel once per
    # 16-row chunk).
    # Qpn80::segment issues the ring's refill loads before the group fold, which waits for the
    # k-block's MMAs; issued after it, they waited with it. Same run, plain launches, M = 1: TP1 MLP
    # down 19.6 against 21.8 us for the old order (*_foldfirst), gate_up 33.6 against 39.3
    # (results/kernel_int4_refill_sweep_h200_20261204.csv). It also made two tiles per warp faster
    # than four on every gate_up shape (t4d1, kept below as a measured variant, had served layers of
    # 16,384 rows or more: TP1 32.6 against 34.6 us at M = 1;
    # results/kernel_int4_refill_gateup_sweep_h200_20261204.csv).
    # The split-K finish of the t2d2 kernels is the thin one at M = 1-4 (Qpn80::thin_finish): on the TP1
    # MLP down at M = 1 it cut 2.0 us (21.7 against 23.7 us for the whole-partial finish, *_wide), within
    # 0.5 us of the kernel with no finish at all (results/kernel_int4_thin_sweep_h200_20261204.csv).
    # Measured and dropped the same day (code not kept unless named):
    # - one register ring over a warp's whole run, across group boundaries, with a run's partial groups
    #   counted after its loop: slower on every shape (TP1 down at M = 1 26.5 against 22.8 us, NVFP4
    #   t2d4p0 32.7 against 27.9; results/kernel_int4_stream_sweep_h200_20261204.csv, where *_segring is
    #   the per-segment ring these kernels keep);
    # - a bulk L2 prefetch (cp.async.bulk.prefetch.L2, sm_90, one instruction per tile) of a segment's
    #   codes at its start: slower on every shape, INT4 and NVFP4 (TP1 INT4 down at M = 1 26.8 against
    #   22.5 us; results/kernel_int4_bpf_sweep_h200_20261204.csv; commit c27ccb4 holds the code);
    # - the block-cooperative ring (Qpn80Coop with the group records and a fold per item; t2d2c, t2d3c,
    #   t1d4c, t1d6c, t1d2c at 3 blocks per SM): slower on every shape and M, its loads alone too (TP1
    #   down at M = 1 24.7 against 22.0 us, loads only 20.0 against 17.7; gate_up 44.0 against 33.8;
    #   results/kernel_int4_coop_sweep_h200_20261204.csv, before the refill order above). Its numerics
    #   were not established: the every-kernel GPU test failed on one of them and was not pursued.
    KernelEntry("QPN80_ENTRY", "qpn4_mt1_m16n8k16_t2d2p0_fold", "Frag16INT4FoldAsym", (1, 2, 2, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn4_mt2_m16n8k16_t2d1p0_fold", "Frag16INT4FoldAsym", (2, 2, 1, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn4_sym_mt1_m16n8k16_t2d2p0_fold", "Frag16INT4FoldSym", (1, 2, 2, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn4_sym_mt2_m16n8k16_t2d1p0_fold", "Frag16INT4FoldSym", (2, 2, 1, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn4_mt1_m16n8k16_t2d2p0_fold_pdl", "Frag16INT4FoldAsym", (1, 2, 2, 0, 7)),
    KernelEntry("QPN80_ENTRY", "qpn4_sym_mt1_m16n8k16_t2d2p0_fold_pdl", "Frag16INT4FoldSym", (1, 2, 2, 0, 7)),
    # Measured variants: loads only (the split-K finish kept), the kernel without that finish, with its
    # finish reading whole partials at every M (_wide: no thin finish), with the refill loads after the
    # group fold (_foldfirst: the order before), and four tiles per warp.
    KernelEntry("QPN80_ENTRY", "qpn4_mt1_m16n8k16_t2d2p0_fold_loadonly", "Frag16INT4FoldAsym", (1, 2, 2, 0, 3)),
    KernelEntry("QPN80_ENTRY", "qpn4_mt1_m16n8k16_t2d2p0_fold_nofinish", "Frag16INT4FoldAsym", (1, 2, 2, 0, 6)),
    KernelEntry("QPN80_ENTRY", "qpn4_mt1_m16n8k16_t2d2p0_fold_wide", "Frag16INT4FoldAsym", (1, 2, 2, 0, 8)),
    KernelEntry("QPN80_ENTRY", "qpn4_mt1_m16n8k16_t2d2p0_fold_foldfirst", "Frag16INT4FoldAsym", (1, 2, 2, 0, 9)),
    KernelEntry("QPN80_ENTRY", "qpn4_mt1_m16n8k16_t4d1p0_fold", "Frag16INT4FoldAsym", (1, 4, 1, 0, 0)),
    KernelEntry("QPN80_ENTRY", "qpn4_mt1_m16n8k16_t4d1p0_fold_loadonly", "Frag16INT4FoldAsym", (1, 4, 1, 0, 3)),
    KernelEntry("QPN80_RECONSTRUCT_GS_ENTRY", "qpn4_reconstruct_ws_m16n8k16", "Frag16INT4Asym"),
    KernelEntry("QPN80_RECONSTRUCT_GS_ENTRY", "qpn4_sym_reconstruct_ws_m16n8k16", "Frag16INT4Sym"),
)
