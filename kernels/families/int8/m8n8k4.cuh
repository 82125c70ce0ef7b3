// The INT8 family's m8n8k4 (SM70) decoders: DecINT8 and DecINT8Sym (see qpn_family.cuh for the
// decoder contract).
#pragma once
#include "qpn_family.cuh"

// INT8 W8A16 (kernels/families/int8/: codes, layout, the reference linear). Unsigned 8-bit codes,
// one per byte, a lane's row's 32 inputs of the k-block in input order: word w holds inputs
// 4w .. 4w + 3, byte j input 4w + j. One PRMT puts bytes j and j + 1 under 0x64, each the low byte
// of a half: 0x64XX is the FP16 1024 + XX exactly (FP16's spacing is 1 in [1024, 2048)), so the
// f16x2 (1024 + c_j, 1024 + c_j+1) costs one instruction per register. Subtracting (1024 + zero)
// leaves the exact integers code - zero (-255..255) and the multiply by the FP16 group scale
// rounds once: fp16((code - zero) * scale), the operand the family's reference linear models. The
// MMA sums those in FP32; nothing else rounds before the epilogue's FP16 output.
//
// Group scales: one record per (row, group of 32 / 64 / 128 inputs, or the whole row for a
// per-channel weight), a whole number of k-blocks, so a k-block has ONE record per lane:
// {scale lo, scale hi, zero, 0} (asymmetric, one aligned 32-bit load) or {scale lo, scale hi}
// (symmetric, 16-bit; the zero point is the constant 128). The kernel finds k-block kb's record as
// kb >> QpnArgs::group_shift; a per-channel record spans a power of two at least the padded K
// (layout.record_span), so every k-block finds record 0 with the same arithmetic.
template <bool SYM>
struct DecINT8Form {
  static constexpr bool GROUPED = false;       // not NVFP4's two e4m3 scales per k-block
  static constexpr bool GROUP_RECORDS = true;  // one {scale[, zero]} record per lane per k-block
  static constexpr int REC_BYTES = SYM ? 2 : 4;
  static constexpr int WORDS = 8;           // 32 bytes of codes per lane per k-block (as FP8)
  static constexpr int WORDS_PER_PAIR = 2;  // codes of 4 inputs (1 MMA of m8n8k4) per word
  // Two k-blocks ahead at one token tile, one at two token tiles: FP8's ring, whose code bytes per
  // k-block these are (plus a 2-4 byte record). Not tuned beyond the sm_70 check (no spill under
  // the 64-register cap); no V100 or model figure exists for this family yet.
  static constexpr int KBLOCKS_AHEAD = 2;
  static constexpr int KBLOCKS_AHEAD_MT2 = 1;
  static constexpr float OUT_MULT = 1.0f;   // the family has no output scale (ops passes [1.0])
  // Bytes 2h and 2h + 1 of a word under 0x64: (1024 + c_2h, 1024 + c_2h+1), low half first.
  QPN_DEV static u32 biased(u32 word, int h) { return prmt(word, 0x64u, h ? 0x4342u : 0x4140u); }
  // f16x2 register idx (0 .. 15) of the k-block, k order: inputs 2 idx, 2 idx + 1, as 1024 + code.
  QPN_DEV static u32 half2(const u32 (&w)[WORDS], int idx) { return biased(w[idx >> 1], idx & 1); }
  // Register r (0 .. 3) of the two words at the front of w: MMAs 0 and 1 of the pair.
  QPN_DEV static u32 front_half2(const u32 (&w)[WORDS], int r) { return biased(w[r >> 1], r & 1); }
  QPN_DEV static u32 record(const u8* p) { return SYM ? (u32)ldg16(p) : ldg32(p); }
  // Symmetric: (1024 + 128) = 0x6480 and the scale, each in both halves. Asymmetric: ONE register
  // for both, (1024 + zero) in the low half (record byte 2 under 0x64) and the scale in the high
  // one, which apply broadcasts with the FP16 instructions' half selectors (.H0_H0 / .H1_H1, no
  // instruction of their own): zero_bias and scale2 are the same PRMT, which the compiler keeps
  // once. With a register each, qpn8i_mt2_m8n8k4 spilled 4 bytes under the 64-register cap
  // (ptxas 12.9, sm_70).
  QPN_DEV static u32 zero_bias(u32 rec) { return SYM ? 0x64806480u : prmt(rec, 0x64u, 0x1042u); }
  QPN_DEV static u32 scale2(u32 rec) { return SYM ? prmt(rec, 0u, 0x1010u) : prmt(rec, 0x64u, 0x1042u); }
  QPN_DEV static u32 lo_lo(u32 v) {
    u32 d;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {l, l}; }" : "=r"(d) : "r"(v));
    return d;
  }
  QPN_DEV static u32 hi_hi(u32 v) {
    u32 d;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {h, h}; }" : "=r"(d) : "r"(v));
    return d;
  }
  QPN_DEV static u32 apply(u32 h, u32 zb, u32 s) {
    if constexpr (SYM) return hmul2(hsub2(h, zb), s);
    return hmul2(hsub2(h, lo_lo(zb)), hi_hi(s));
  }
};
using DecINT8 = DecINT8Form<false>;
using DecINT8Sym = DecINT8Form<true>;
