// The INT8 family's m16n8k16 (sm_80+) fragment decoders: Frag16INT8Asym / Sym and the folded
// Frag16INT8FoldAsym / Sym of the route kernels.
#pragma once
#include "qpn_atom_m16n8k16.cuh"

// INT8 W8A16 in m16n8k16 order (kernels/families/int8/layout.py, "Fragment map m16n8k16"): FP8's
// code map, so lane (g, t) covers inputs 16t .. 16t+15 of each k-block in one contiguous 32-byte
// run, and step s takes words 2s (a0 = bytes 0-1: row g, a1 = bytes 2-3: row g + 8) and 2s + 1
// (a2, a3 the same for the step's inputs 2, 3). Every group (32, 64, 128, or a per-channel row's
// record, layout.record_span) is a multiple of that run, so the run lies in ONE group: the lane
// needs one record per row (g, g+8) per k-block, loaded once and used by all four steps, at INT4's
// addresses (Frag16INT4Form: the same record layout): record index at k-block kb =
// ((4 kb) >> GS) + (t >> GS), GS = log2(record span / 16) (Qpn80Args.group_shift).
// Decode as DecINT8Form: one PRMT puts two code bytes under 0x64 (1024 + code exactly), minus
// (1024 + zero) exactly, times the FP16 group scale: one rounding, fp16((code - zero) * scale).
// Mixing groups in one MMA (lanes t of different groups for groups of 32) is harmless here: the
// operands are ordinary FP16 weights, as in any FP16 GEMM.
template <bool SYM>
struct Frag16INT8Form : Frag16LaneRun16 {
  static constexpr bool GROUPED = true;      // per-lane scale registers (sc) feed the decode
  static constexpr bool RECORDS = true;      // ... addressed per (tile, group), not per k-block
  static constexpr int REC = SYM ? 2 : 4;    // record bytes: scale (+ zero point, pad)
  static constexpr int WORDS = 8;            // 32 bytes of codes per lane per (tile, k-block)
  static constexpr float OUT_MULT = 1.0f;    // no output scale (ops passes [1.0])
  // The lane's records of tile ``tile`` at k-block 0: slot 2g + h of a (tile, group) is row g + 8h.
  QPN_DEV static const u8* tile_records(const u8* scales, int tile, int kblocks, int lane, int gs) {
    const int groups = (4 * kblocks + (1 << gs) - 1) >> gs;   // PackedINT8.groups_pad
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
  // Bytes 2h and 2h + 1 of a word under 0x64: (1024 + c_2h, 1024 + c_2h+1), low half first.
  QPN_DEV static u32 biased(u32 word, int h) { return prmt(word, 0x64u, h ? 0x4342u : 0x4140u); }
  // (1024 + zero) of row g (h = 0) or g + 8 (h = 1), both halves: record byte 2 under 0x64.
  QPN_DEV static u32 zero_bias(const u32 (&sc)[2], int h) {
    return SYM ? 0x64806480u : prmt(sc[h], 0x64u, 0x4242u);
  }
  QPN_DEV static u32 apply(u32 h, u32 zb, u32 s) { return hmul2(hsub2(h, zb), s); }
  QPN_DEV static void frag(const u32 (&w)[WORDS], int s, const u32 (&sc)[2],
                           u32& a0, u32& a1, u32& a2, u32& a3) {
    const u32 zg = zero_bias(sc, 0), zg8 = zero_bias(sc, 1);
    const u32 sg = prmt(sc[0], 0u, 0x1010u);
    const u32 sg8 = SYM ? prmt(sc[0], 0u, 0x3232u) : prmt(sc[1], 0u, 0x1010u);
    const u32 v0 = w[2 * s], v1 = w[2 * s + 1];
    a0 = apply(biased(v0, 0), zg, sg);
    a1 = apply(biased(v0, 1), zg8, sg8);
    a2 = apply(biased(v1, 0), zg, sg);
    a3 = apply(biased(v1, 1), zg8, sg8);
  }
};
using Frag16INT8Asym = Frag16INT8Form<false>;
using Frag16INT8Sym = Frag16INT8Form<true>;

// INT8 with the group scale folded into the FP32 sums (records of 64 inputs or more: one group per
// k-block or several, so every input of one MMA shares its row's scale; a per-channel row folds
// once per split-K segment). The operands are the exact integers code - zero, and the kernel (Qpn80,
// FoldsGroups) multiplies each group's FP32 sums by its row's scale before adding them up: per
// code word 2 PRMT and 2 HSUB2 instead of 2 PRMT, 2 HSUB2 and 2 HMUL2. Every product
// (code - zero) x is exact in FP32 (8 + 11 significant bits), so a one-hot row gives
// fp16((code - zero) * scale) exactly as Frag16INT8Form; a sum differs from Frag16INT8Form's only by
// the FP16 rounding of each weight that this form does not make.
// Plain: the decoder a kernel runs for groups of 32 (Qpn80Args.group_shift < 2).
template <bool SYM>
struct Frag16INT8FoldForm : Frag16INT8Form<SYM> {
  using Base = Frag16INT8Form<SYM>;
  using Plain = Base;
  static constexpr bool FOLD = true;
  static constexpr int MIN_FOLD_SHIFT = 2;   // group_shift of a 64-input record: one k-block
  QPN_DEV static void frag(const u32 (&w)[8], int s, const u32 (&sc)[2], u32& a0, u32& a1, u32& a2, u32& a3) {
    const u32 zg = Base::zero_bias(sc, 0), zg8 = Base::zero_bias(sc, 1);
    const u32 v0 = w[2 * s], v1 = w[2 * s + 1];
    a0 = hsub2(Base::biased(v0, 0), zg);
    a1 = hsub2(Base::biased(v0, 1), zg8);
    a2 = hsub2(Base::biased(v1, 0), zg);
    a3 = hsub2(Base::biased(v1, 1), zg8);
  }
  // acc += scale * g over one group's sums (c0 c1 row g, c2 c3 row g + 8), and g = 0.
  template <int T, int MT>
  QPN_DEV static void fold(const u32 (&sc)[T][2], float (&g)[T][MT][4], float (&acc)[T][MT][4]) {
#pragma unroll
    for (int j = 0; j < T; ++j) {
      const float s0 = f16_to_f32((u16)(sc[j][0] & 0xFFFFu));
      const float s8 = f16_to_f32((u16)(SYM ? sc[j][0] >> 16 : sc[j][1] & 0xFFFFu));
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
using Frag16INT8FoldAsym = Frag16INT8FoldForm<false>;
using Frag16INT8FoldSym = Frag16INT8FoldForm<true>;
