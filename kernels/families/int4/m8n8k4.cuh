// The INT4 family's m8n8k4 (SM70) decoders: DecINT4 and DecINT4Sym (see qpn_family.cuh for the
// decoder contract).
#pragma once
#include "qpn_family.cuh"

// INT4 W4A16 (kernels/families/int4/: codes, layout, the reference linear). Unsigned 4-bit
// codes, two per byte in the packed word order: pair r (r = 0..3) of a word is nibbles r and r + 4,
// i.e. bits 4r..4r+3 of each 16-bit half, so (w >> 4r) & 0x000F000F | 0x64006400 (one LOP3 after
// the shift) is the f16x2 (1024 + c_lo, 1024 + c_hi) exactly: 0x6400 is 1024, where FP16's spacing
// is 1. Subtracting (1024 + zero) leaves the exact integers code - zero (-15..15), and the multiply
// by the FP16 group scale rounds once: fp16((code - zero) * scale), the operand linear_int4 models.
// The MMA sums those in FP32; nothing else rounds before the epilogue's FP16 output.
//
// Group scales: one record per (row, group of 32 / 64 / 128 inputs), a whole number of k-blocks,
// so a k-block has ONE record per lane: {scale lo, scale hi, zero, 0} (asymmetric, one aligned
// 32-bit load) or {scale lo, scale hi} (symmetric, 16-bit; the zero point is the constant 8).
// The kernel finds k-block kb's group as kb >> QpnArgs::group_shift (log2 of k-blocks per group).
template <bool SYM>
struct DecINT4Form {
  static constexpr bool GROUPED = false;       // not NVFP4's two e4m3 scales per k-block
  static constexpr bool GROUP_RECORDS = true;  // one {scale[, zero]} record per lane per k-block
  static constexpr int REC_BYTES = SYM ? 2 : 4;
  static constexpr int WORDS = 4;         // 16 bytes of codes per lane per k-block
  static constexpr int WORDS_PER_PAIR = 1;  // codes of 8 inputs (2 MMAs of m8n8k4) per word
  // Two k-blocks ahead, as NVFP4's restore form, whose code bytes per k-block these are (plus a
  // 2-4 byte record instead of a 2-byte scale pair); one at two token tiles for the symmetric
  // member, whose second stage spills 4 bytes there (ptxas 12.9, sm_70: qpn4_sym_mt2_m8n8k4).
  // Not tuned beyond that: no V100 or model figure exists for this family yet.
  static constexpr int KBLOCKS_AHEAD = 2;
  static constexpr int KBLOCKS_AHEAD_MT2 = SYM ? 1 : 2;
  static constexpr float OUT_MULT = 1.0f;   // the family has no output scale (ops passes [1.0])
  QPN_DEV static u32 biased(u32 t) { return and_or(t, 0x000F000Fu, 0x64006400u); }
  // f16x2 register idx (0 .. 15) of the k-block, k order: inputs 2*idx, 2*idx + 1, as 1024 + code.
  QPN_DEV static u32 half2(const u32 (&w)[WORDS], int idx) { return biased(w[idx >> 2] >> (4 * (idx & 3))); }
  // Pair r of the word at the front of w (the shift written as one instruction: NVVM otherwise
  // folds the mask through it and rebuilds it per pair).
  QPN_DEV static u32 front_half2(const u32 (&w)[WORDS], int r) { return biased(r ? shr_b32(w[0], 4 * r) : w[0]); }
  QPN_DEV static u32 record(const u8* p) { return SYM ? (u32)ldg16(p) : ldg32(p); }
  // (1024 + zero) in both halves: the zero byte (record byte 2) under 0x64 (byte 0 of b).
  QPN_DEV static u32 zero_bias(u32 rec) { return SYM ? 0x64086408u : prmt(rec, 0x64u, 0x4242u); }
  QPN_DEV static u32 scale2(u32 rec) { return prmt(rec, 0u, 0x1010u); }
  QPN_DEV static u32 apply(u32 h, u32 zb, u32 s) { return hmul2(hsub2(h, zb), s); }
};
using DecINT4 = DecINT4Form<false>;
using DecINT4Sym = DecINT4Form<true>;
