// The INT4 family's m16n8k16 (sm_80+) fragment decoders: Frag16INT4Asym / Sym and the folded
// Frag16INT4FoldAsym / Sym of the route kernels.
#pragma once
#include "qpn_atom_m16n8k16.cuh"

// INT4 W4A16 in m16n8k16 order (kernels/families/int4/layout.py, "Fragment map m16n8k16"): the FP8 k-slot
// permutation, so lane (g, t) covers inputs 16t .. 16t+15 of each k-block in one contiguous run.
// Every allowed group size (32, 64, 128) is a multiple of that run, so the run lies in ONE group:
// the lane needs one record per row (g, g+8) per k-block, loaded once and used by all four steps.
// Record index of the lane at k-block kb = (64 kb + 16 t) / gsize = (4 kb + t) >> GS, GS =
// log2(gsize / 16) (ops.kernel_member, Qpn80Args.group_shift). Since t < 4 and 4 kb is a multiple
// of 2^min(GS, 2), that is ((4 kb) >> GS) + (t >> GS): the lane's part goes into its tile pointer
// (tile_records), the k-block's part is record_step.
// Word s feeds step s; pair r (nibbles r, r+4) is register a_r: row g + 8 (r & 1), inputs
// 16t + 4s + 2 (r >> 1) + (0, 1). Decode as DecINT4Form: (1024 + code) exactly by OR-ing the
// nibble under 0x6400, minus (1024 + zero) exactly, times the FP16 group scale: one rounding,
// fp16((code - zero) * scale), what the INT4 family's reference linear models.
// Mixing groups in one MMA (lanes t of different groups for gsize 32) is harmless here: unlike
// NVFP4's e4m3 scales, the operands are ordinary FP16 weights, as in any FP16 GEMM.
template <bool SYM>
struct Frag16INT4Form : Frag16LaneRun16 {
  static constexpr bool GROUPED = true;      // per-lane scale registers (sc) feed the decode
  static constexpr bool RECORDS = true;      // ... addressed per (tile, group), not per k-block
  static constexpr int REC = SYM ? 2 : 4;    // record bytes: scale (+ zero point, pad)
  static constexpr int WORDS = 4;            // 16 bytes of codes per lane per (tile, k-block)
  static constexpr float OUT_MULT = 1.0f;    // no output scale (ops passes [1.0])
  // The lane's records of tile ``tile`` at k-block 0: slot 2g + h of a (tile, group) is row g + 8h.
  QPN_DEV static const u8* tile_records(const u8* scales, int tile, int kblocks, int lane, int gs) {
    const int groups = (4 * kblocks + (1 << gs) - 1) >> gs;   // PackedINT4.groups_pad
    return scales + ((size_t)tile * groups + ((lane & 3) >> gs)) * (16 * REC) + (lane >> 2) * (2 * REC);
  }
  QPN_DEV static size_t record_step(int kb, int gs) { return (size_t)((4 * kb) >> gs) * (16 * REC); }
  // Asymmetric: sc[0], sc[1] = the records of rows g, g+8; symmetric: sc[0] = (s_g, s_g8).
  QPN_DEV static void load_scales(const u8* p, u32 (&sc)[2]) {
    if constexpr (SYM) {
      sc[0] = ldg32(p);
      sc[1] = 0u;
    } else {
      ldg64(p, sc[0], sc[1]);
    }
  }
  QPN_DEV static u32 biased(u32 t) { return and_or(t, 0x000F000Fu, 0x64006400u); }
  QPN_DEV static u32 apply(u32 h, u32 zb, u32 s) { return hmul2(hsub2(h, zb), s); }
  QPN_DEV static void frag(const u32 (&w)[WORDS], int s, const u32 (&sc)[2],
                           u32& a0, u32& a1, u32& a2, u32& a3) {
    // (1024 + zero) in both halves: record byte 2 under 0x64; the scale's two bytes in both halves
    const u32 zg = SYM ? 0x64086408u : prmt(sc[0], 0x64u, 0x4242u);
    const u32 zg8 = SYM ? 0x64086408u : prmt(sc[1], 0x64u, 0x4242u);
    const u32 sg = prmt(sc[0], 0u, 0x1010u);
    const u32 sg8 = SYM ? prmt(sc[0], 0u, 0x3232u) : prmt(sc[1], 0u, 0x1010u);
    const u32 v = w[s];
    a0 = apply(biased(v), zg, sg);
    a1 = apply(biased(shr_b32(v, 4)), zg8, sg8);
    a2 = apply(biased(shr_b32(v, 8)), zg, sg);
    a3 = apply(biased(shr_b32(v, 12)), zg8, sg8);
  }
};
using Frag16INT4Asym = Frag16INT4Form<false>;
using Frag16INT4Sym = Frag16INT4Form<true>;

// INT4 with the group scale folded into the FP32 sums (groups of 64 and 128: one group per
// k-block or two, so every input of one MMA shares its row's scale). The operands are exact
// integers, (code - zero) for row g and 16 (code - zero) for row g + 8 -- the high nibble of
// each byte OR-ed under 0x6400 is 1024 + 16 code, so no shift per register pair -- and the
// kernel (Qpn80, FoldsGroups) multiplies each group's sums by scale (row g) or scale / 16
// (row g + 8) in FP32 before adding them up: per code word 1 shift, 4 LOP3 and 4 HSUB2 instead
// of 3 shifts, 4 LOP3, 4 HSUB2 and 4 HMUL2. Every product (code - zero) x is exact in FP32, so a
// one-hot row gives fp16((code - zero) * scale) exactly as Frag16INT4Form; a sum differs from
// Frag16INT4Form's only by the FP16 rounding of each weight that this form does not make.
// Plain: the decoder a kernel runs for groups of 32 (Qpn80Args.group_shift < 2).
template <bool SYM>
struct Frag16INT4FoldForm : Frag16INT4Form<SYM> {
  using Plain = Frag16INT4Form<SYM>;
  static constexpr bool FOLD = true;
  static constexpr int MIN_FOLD_SHIFT = 2;   // group_shift of a 64-input group: one k-block
  QPN_DEV static void frag(const u32 (&w)[4], int s, const u32 (&sc)[2], u32& a0, u32& a1, u32& a2, u32& a3) {
    // 1024 + zero (row g, low nibbles) and 1024 + 16 zero (row g + 8, high nibbles) in both halves
    const u32 zg = SYM ? 0x64086408u : prmt(sc[0], 0x64u, 0x4242u);
    const u32 zh = SYM ? 0x64806480u : (shl_b32(prmt(sc[1], 0u, 0x4242u), 4) | 0x64006400u);
    const u32 v = w[s];
    const u32 v8 = shr_b32(v, 8);
    a0 = hsub2(and_or(v, 0x000F000Fu, 0x64006400u), zg);
    a1 = hsub2(and_or(v, 0x00F000F0u, 0x64006400u), zh);
    a2 = hsub2(and_or(v8, 0x000F000Fu, 0x64006400u), zg);
    a3 = hsub2(and_or(v8, 0x00F000F0u, 0x64006400u), zh);
  }
  // acc += scale * g over one group's sums (c0 c1 row g, c2 c3 row g + 8), and g = 0.
  template <int T, int MT>
  QPN_DEV static void fold(const u32 (&sc)[T][2], float (&g)[T][MT][4], float (&acc)[T][MT][4]) {
#pragma unroll
    for (int j = 0; j < T; ++j) {
      const float s0 = f16_to_f32((u16)(sc[j][0] & 0xFFFFu));
      const float s8 = f16_to_f32((u16)(SYM ? sc[j][0] >> 16 : sc[j][1] & 0xFFFFu)) * 0.0625f;
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        acc[j][t][0] = fma_rn(s0, g[j][t][0], acc[j][t][0]);
        acc[j][t][1] = fma_rn(s0, g[j][t][1], acc[j][t][1]);
        acc[j][t][2] = fma_rn(s8, g[j][t][2], acc[j][t][2]);
        acc[j][t][3] = fma_rn(s8, g[j][t][3], acc[j][t][3]);
#pragma unroll
        for (int i = 0; i < 4; ++i) g[j][t][i] = 0.f;
      }
    }
  }
};
using Frag16INT4FoldAsym = Frag16INT4FoldForm<false>;
using Frag16INT4FoldSym = Frag16INT4FoldForm<true>;
