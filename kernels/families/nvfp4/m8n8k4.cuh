// The NVFP4 family's m8n8k4 (SM70) decoder: DecNVFP4 and its S7 form (see qpn_family.cuh for the
// decoder contract and the e2m1 / e4m3 bit helpers).
#pragma once
#include "qpn_family.cuh"

// NVFP4 e2m1: in a 32-bit word, nibbles 3 and 7 (the top nibble of each half) are placed as
// sign | exponent:mantissa in FP16 bits 15 and 11..9; that FP16 pattern equals the e2m1 value
// times 2^-14 (subnormal for 0.5).
//
// Group scales (NVFP4): the e4m3 group scale is multiplied into the decoded operand in FP16.
// That product is EXACT: an e2m1 value has at most 2 significant bits, an e4m3 value at most 4,
// so the product has at most 6 (FP16 has 11). The MMA then accumulates x * (e2m1 * e4m3) in FP32
// across all of K, and the global scale multiplies the FP32 result once. Nothing is ever
// accumulated in FP16 (the overflow trap of DESIGN.md section 3), and no partial sum needs a
// per-16 flush: scaling exactly before the FP32 accumulation gives the per-16-flush result with
// fewer roundings, and frees the 8 FP32 partial registers per tile that the flush would hold.
//
// Two forms, which differ only in where the 2^14 goes (S7 = the scale carries 2^7):
// * S7 = false, the restore form: operand = (bits * 2^14) * s = e2m1 * s, two FP16 multiplies per
//   register; every operand lies in [2^-10, 2688], FP16 normals whatever the scale.
// * S7 = true: operand = bits * (s * 2^7) = e2m1 * s * 2^-7, one multiply per register (16 issue
//   slots fewer per k-block: what the calibrated model asks of TP4 down and lm_head at M = 1,
//   results/kernel_sm70_loop_notes_*); the FP32 epilogue multiplies by OUT_MULT = 2^7. s * 2^7 is
//   at most 448 * 128 = 57344 (FP16 holds it) and for a normal e4m3 scale (>= 2^-6) the operand is
//   at least 0.5 * 2^-6 * 2^-7 = 2^-14, FP16's smallest normal, so the tensor cores see the same
//   normal operands scaled by 2^-7. Only an e4m3-subnormal scale makes FP16-subnormal operands
//   (down to 2^-17, still exact as numbers); whether the tensor cores take those as they are is a
//   property of the GPU, so ops.py runs this form only on a GPU whose probe (all-subnormal scales,
//   bit-identical to the restore form) passes.
template <bool S7>
struct DecNVFP4Form {
  static constexpr bool GROUPED = true;   // one e4m3 scale per 16 inputs, folded into the operand
  static constexpr bool GROUP_RECORDS = false;  // (DecINT4Form's per-(row, group) records)
  static constexpr int WORDS = 4;         // 16 bytes of codes per lane per k-block
  static constexpr int WORDS_PER_PAIR = 1;  // codes of 8 inputs (2 MMAs of m8n8k4) per word
  // k-blocks a warp loads ahead of the one it decodes (one token tile; _MT2: two): 3 x 576 B of a
  // 32 x 32 tile's codes and scales in flight, what the calibrated model needs a V100 warp to hold
  // when a layer gives 16 warps per SM (TP4 down, results/perf_model_v100_estimate_*). The S7 form
  // at one token tile holds 4 x 576 B: the registers its decode frees take one more stage, and with
  // 3 the t0-bounded fit leaves TP4 down latency-bound just below seed 000's level. All fit 64
  // registers, no spills (S7 at one token tile: 63).
  static constexpr int KBLOCKS_AHEAD = S7 ? 3 : 2;
  static constexpr int KBLOCKS_AHEAD_MT2 = 2;
  static constexpr float OUT_MULT = S7 ? 128.0f : 1.0f;   // FP32 epilogue: restores the scale's 2^-7
  QPN_DEV static u32 rescale(u32 bits) { return S7 ? bits : hmul2(bits, 0x74007400u); }   // * 2^14: exact
  QPN_DEV static u32 dec(u32 t) { return rescale(e2m1x2_bits(t)); }
  // f16x2 register idx (0 .. 15) of the k-block, k order: inputs 2*idx, 2*idx + 1.
  QPN_DEV static u32 half2(const u32 (&w)[WORDS], int idx) { return dec(w[idx >> 2] << (4 * (idx & 3))); }
  // f16x2 register r (0..3) of the pair currently at the front of w: dec(w[0] << 4r), built the
  // way e2m1x2_quad builds it, from the word's odd nibbles (r = 0, 2) or its even ones moved up a
  // nibble (r = 1, 3), with the one-instruction helpers of qpn_ptx.cuh so that, inlined with r
  // constant, the four calls of a pair share the two half-words: 13 integer instructions per word.
  QPN_DEV static u32 front_half2(const u32 (&w)[WORDS], int r) {
    const u32 half = (r & 1) ? and_b32(shl_b32(w[0], 4), 0xF0F0F0F0u) : and_b32(w[0], 0xF0F0F0F0u);
    const u32 t = (r >= 2) ? place(shl_b32(half, 5), shl_b32(half, 8)) : place(shr_b32(half, 3), half);
    return rescale(t);
  }
  // Magnitude bits from a, sign bits from b: the FP16 pattern of two e2m1 codes (times 2^-14).
  QPN_DEV static u32 place(u32 a, u32 b) { return or_and(a, b, 0x8E008E00u); }
  // The k-block's two e4m3 group scales (the lane's 16-bit scale pair: group 0 in the low byte) as
  // FP16 (s0, s1) (S7: times 2^7), exact: e4m3x2_bits gives s * 2^-8, times 2^8 (0x5C00) or 2^15 (0x7800).
  QPN_DEV static u32 scale_pair(u32 sp) {
    return hmul2(e4m3x2_bits(prmt(sp, 0u, 0x1404u)), S7 ? 0x78007800u : 0x5C005C00u);
  }
};
using DecNVFP4 = DecNVFP4Form<false>;
using DecNVFP4S7 = DecNVFP4Form<true>;
