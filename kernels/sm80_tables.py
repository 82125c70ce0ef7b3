"""The sm_80+ (m16n8k16) kernel tables: which configured kernel of csrc/qpn_kernels_sm80.cu serves
each packed route, the kernels that replace them where a GPU cannot give a block their shared
memory, the M-band kernels, which route kernels launch with programmatic dependent launch, the
fewest work items per warp, and the fragment decoder each format's kernels are configured with.

Data only (keyed by the formats' WeightFormat), so that the build (jit.ENTRY_POINTS) can require
every kernel named here and the launch planning (sm80_plan) can pick among them; nothing on the
SM70 path reads it.
"""
from __future__ import annotations

from . import formats

# sm_80+ (m16n8k16): which configured kernel of csrc/qpn_kernels_sm80.cu serves each packed route,
# by (the format family's WeightFormat, formats.FAMILIES, or for a family whose members have kernels
# of their own, INT4, each member; token tiles per weight pass). Chosen on the H200 among the
# spill-free configurations (benchmarks/kernel_matched_bench.py --sweep); a change here needs no
# recompilation.
# (H200 sweeps 2026-11-30, results/kernel_sm80_ring_sweep_h200_20261130.csv (TP1 shapes) and
# results/kernel_sm80_ring3_sweep_h200_20261130.csv (FP8, down, TP4 down, after the batched split-K
# finish): the register ring t2d4p0 is best for NVFP4 M <= 8 on every measured shape except the
# largest, lm_head (248320 rows), where the shared-memory ring t4s4 reads at 63% of the ceiling
# against 58% (SM80_LARGE_N_KERNELS); NVFP4 M 9-16 goes to the ring t2s4x; FP8 stays on the
# register ring, which the FP8 ring kernels do not beat -- results/kernel_sm80_ring_notes_h200_20261130.md.
# Run 6 (results/kernel_sm80_fp8swizzle_sweep_h200_20261130.csv): once the FP8 ring's copies were
# coalesced (chunk_pos in the .cu), the ring t2s3x has the best mean for FP8 M 9-16: in_proj 57.8%
# vs 53.0% for the register t1d4p0, out_proj 36.8% vs 37.5%; FP8 M <= 8 stays on the register ring.)
# INT4 (both members, kernels of their own: formats.WeightFormat.kernel_tag; sm80_plan looks them up
# by the member kernel_inputs.kernel_member names): the register ring with the folded decoder, chosen
# by two H200 sweeps of 2026-12-04 (results/kernel_int4_sweep_h200_20261204.csv, _sweep2_): M <= 8
# t2d2 at every layer size (below); M 9-16 and, once per 16-row chunk, the chunked route: t2d1.
_NVFP4, _FP8 = formats.FAMILIES["nvfp4"], formats.FAMILIES["fp8"]
_INT4, _INT4_SYM = formats.INT4, formats.INT4_SYM
SM80_ROUTE_KERNELS = {
    (_NVFP4, 1): "qpn2_mt1_m16n8k16_t2d4p0",
    (_NVFP4, 2): "qpn2_mt2_m16n8k16_t2s4x",
    (_FP8, 1): "qpn8_mt1_m16n8k16_t2d2c",
    (_FP8, 2): "qpn8_mt2_m16n8k16_t2s3x",
    (_INT4, 1): "qpn4_mt1_m16n8k16_t2d2p0_fold",
    (_INT4, 2): "qpn4_mt2_m16n8k16_t2d1p0_fold",
    (_INT4_SYM, 1): "qpn4_sym_mt1_m16n8k16_t2d2p0_fold",
    (_INT4_SYM, 2): "qpn4_sym_mt2_m16n8k16_t2d1p0_fold",
}
# (2026-12-01: FP8 M <= 8 moved from the per-warp register ring t2d2p0 to its block-cooperative
# form t2d2c, 3 points of the read ceiling faster on average over the TP1 FP8 shapes at M 1 and 8,
# results/kernel_sm80_coop2_sweep_h200_20261201.csv; see QPN80C_ENTRY in the .cu.)
# Layers with at least SM80_LARGE_N[format] output rows (NVFP4: lm_head) use these instead, where listed.
# (2026-12-01, session 3: the NVFP4 operands lost their * 2^7 everywhere except in t4s4, where the
# unit-scale form t4s4_u measured 2% slower; see Frag16NVFP4Scaled in qpn_atom_m16n8k16.cuh.
# The threshold was 100,000 (TP1 lm_head only); two H200 sweeps of the same lease
# (results/kernel_sm80_depth{1,2}_sweep_h200_20261201.csv) put t4s4 7-10% ahead of t2d4p0 on TP4
# lm_head (62,080 rows: 64.5 / 66.0 against 69.3 / 73.0 us at M = 1 / 8), even with it on TP1
# gate_up (34,816 rows, its x 2^7 form t4s4_s7 in the 4a6d26c sweeps: 41.5 / 42.9 against 42.0 / 43.4
# us) and behind it on the smaller layers; hence 50,000.)
# INT4 has none since its fold kernels issue their ring refills before the group fold (2026-12-04):
# two tiles per warp (t2d2) then beat four (t4d1) on every gate_up shape at M 1-8, TP1 32.6 against
# 34.6 us, TP2 19.6 against 22.0 us at M = 1 (results/kernel_int4_refill_gateup_sweep_h200_20261204.csv);
# before it four tiles had been 8-13% faster from 16,384 rows.
# The threshold per format (a family member where its kernels are its own, as the keys below).
SM80_LARGE_N = {_NVFP4: 50_000}
SM80_LARGE_N_KERNELS = {(_NVFP4, 1): "qpn2_mt1_m16n8k16_t4s4"}
# The *_chunked route (M 17-96) on sm_80+: the M-band kernels of a format family, by token tiles (MT)
# ascending; sm80_plan.sm80_kernel_for takes the first whose 8 x MT rows hold M, else the last: one weight
# pass per chunk of its 8 x MT rows. A family not listed (FP8) runs its (family, 2) kernel above once
# per 16-row chunk, as the route did before. H200 sweeps 2026-12-01
# (results/kernel_sm80_band_sweep_h200_20261201.csv, _sweep2_): NVFP4 1.3-1.7x faster than the
# 16-row chunks at M 17-64 on gate_up and down; the FP8 band forms tie on in_proj and lose on out_proj
# (QPN80B_ENTRY in the .cu).
SM80_BAND_KERNELS = {
    _NVFP4: ("qpn2_mt4_m16n8k16_t1d4s4_b2", "qpn2_mt8_m16n8k16_t1d2s4_b2"),
}
# Route kernels whose *_pdl form (VAR 7) sm80_plan launches with programmatic dependent launch on sm_90+
# (sm80_plan.pdl_form): every mt1 kernel and the FP8 mt2 ring. Called back to back, they are 1.5-4.5 us
# faster per call (graph replay) on every H200 shape at M 1-8 and on all four FP8 shapes at M 16,
# against the same kernels launched plainly in the same run
# (results/kernel_matched_sm80_pdlfp8_h200_20261201.csv, qpn vs qpn_plain; the block-cooperative
# FP8 M <= 8 kernel since: 1.6-2.8 us, results/kernel_matched_sm80_readlimit_h200_20261201.csv); in
# a model's MLP block, torch kernels between, no measurable change (docs/architecture.md). The NVFP4 mt2 ring
# stays on plain launches (slower with PDL on the small layers: down 33.8 -> 34.2 us, TP4 down
# 17.9 -> 19.0 us; results/kernel_sm80_pdl_notes_h200_20261201.md). INT4's mt1 kernels: 1.1-1.5 us
# faster per call on every TP1 / TP2 shape at M 1 and 8 (results/kernel_matched_int4_pdl_h200_20261204.csv);
# its mt2 kernels were not timed with PDL.
SM80_PDL_KERNELS = frozenset({SM80_ROUTE_KERNELS[_NVFP4, 1], SM80_LARGE_N_KERNELS[_NVFP4, 1],
                              SM80_ROUTE_KERNELS[_FP8, 1], SM80_ROUTE_KERNELS[_FP8, 2],
                              SM80_ROUTE_KERNELS[_INT4, 1], SM80_ROUTE_KERNELS[_INT4_SYM, 1]})
# The register-ring kernels (no shared memory) serve a route when the GPU cannot give a block the
# ring kernel's shared memory (sm_86 / sm_89 allow about 99 KB per block). INT4's route kernels are
# register rings already: their own.
SM80_ROUTE_KERNELS_NO_SMEM = {
    (_NVFP4, 1): "qpn2_mt1_m16n8k16_t2d4p0",
    (_NVFP4, 2): "qpn2_mt2_m16n8k16_t1d4p8",
    (_FP8, 1): "qpn8_mt1_m16n8k16_t2d2c",   # 16 KB of static shared memory: fits every sm_80+ GPU
    (_FP8, 2): "qpn8_mt2_m16n8k16_t1d4p0",
    **{key: SM80_ROUTE_KERNELS[key] for key in ((_INT4, 1), (_INT4, 2), (_INT4_SYM, 1), (_INT4_SYM, 2))},
}
# The route kernels of a staged format (kernels, no served route yet: formats.py, "Staging"), keyed
# as SM80_ROUTE_KERNELS; kept out of it, which the served tools (benchmarks, route checks) read as
# the served set. INT4's stood here until it was served; no format is staged today.
SM80_UNSERVED_ROUTE_KERNELS: dict = {}
# Fewest work items (k-blocks of one weight group) per warp, per format (family member): below about
# the ring depth a warp spends its time filling the ring and reducing, so small layers get fewer,
# longer runs (sm80_plan.sm80_partition). INT4 as NVFP4, whose ring depth its kernels share.
SM80_MIN_ITEMS = {_NVFP4: 4, _FP8: 2, _INT4: 4, _INT4_SYM: 4}
# The fragment decoder each format's kernels are configured with (QPN80*_ENTRY's second field starts
# with it; no key is the start of another).
SM80_FRAGMENTS = {"Frag16NVFP4": _NVFP4, "Frag16FP8": _FP8, "Frag16INT4Asym": _INT4, "Frag16INT4Sym": _INT4_SYM,
                  "Frag16INT4FoldAsym": _INT4, "Frag16INT4FoldSym": _INT4_SYM}
