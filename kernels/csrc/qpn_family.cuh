// The QPN kernel family: the tensor-core atom and the weight decoder are template parameters,
// so a new atom (e.g. m16n8k16 for sm_80+) is one more Atom struct plus its prepack geometry in
// atoms.py, not a fork of the decoders, the kernels or the dispatch.
#pragma once
#include "qpn_ptx.cuh"

// Drop the first S words of a register array and shift the rest down (S zero words enter at the
// end). Lets a rolled loop always read w[0..]: constant register indices, no local memory.
template <int S, int N>
QPN_DEV void rotate_words(u32 (&w)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) w[j] = (j + S < N) ? w[j + S] : 0u;
}

// ------------------------------------------------------------------------------------ atoms
// SM70 mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32, weights on the A (row-major 8x4) side,
// activations on the B (column-major 4x8) side. A warp issues four independent 8x8x4 MMAs, one
// per quadpair (lanes 4q..4q+3 and 4q+16..4q+19); every quadpair gets the SAME activation
// fragment and its own 8 weight rows, so the warp tile is 32 weight rows x 8 tokens.
// Must agree with atoms.py:_m8n8k4.
struct AtomM8N8K4 {
  static constexpr int TILE_N = 32;      // weight rows per warp tile
  static constexpr int K_BLOCK = 32;     // inputs per k-block (one code vector load per lane)
  static constexpr int K_STEP = 4;       // inputs per MMA
  static constexpr int STEPS = K_BLOCK / K_STEP;
  static constexpr int A_REGS = 2;       // f16x2 registers of A per MMA
  static constexpr int ACC = 8;          // f32 accumulators per lane per 8-token tile
  static constexpr int TOKENS = 8;       // tokens per tile
  static constexpr int SCALE_BLOCK_BYTES = 64;  // NVFP4 scales per (tile, k-block)
  static constexpr int X_REGS = 4;       // f16x2 registers per activation load (8 halves = 2 MMAs)

  // Token whose activations this lane supplies in the B fragment.
  QPN_DEV static int b_token(int lane) { return (lane & 3) + ((lane >> 4) << 2); }
  // Weight row (within the warp tile) that this lane supplies in the A fragment.
  QPN_DEV static int a_row(int lane) { return 8 * ((lane >> 2) & 3) + (lane & 3) + ((lane >> 4) << 2); }
  // Accumulator i of this lane: weight row (within the tile) and token.
  QPN_DEV static int acc_row(int lane, int i) {
    return 8 * ((lane >> 2) & 3) + (lane & 1) + (i & 2) + ((lane >> 4) << 2);
  }
  QPN_DEV static int acc_token(int lane, int i) { return (i & 4) + (lane & 2) + (i & 1); }
  // NVFP4 group scales of the lane's A row for the two groups of a k-block: one 16-bit word.
  QPN_DEV static int scale_pair_offset(int lane) { return 2 * lane; }

  // Activations for MMAs 2p and 2p+1 of a k-block: 8 consecutive halves of the lane's token row.
  // A lane whose token is past M reads a real row instead (the caller points it at row 0): its B
  // column only reaches the accumulator column of that token, which the epilogue never stores, so
  // the load needs no predicate and no zero fill (ptxas 12.9, sm_70: the predicated form cost
  // qpn2_mt1_m8n8k4 22 of 180 instructions per k-block, moves and a schedule around the guards).
  QPN_DEV static void load_x(const u16* p, u32 (&xr)[X_REGS]) { ldg128(p, xr[0], xr[1], xr[2], xr[3]); }
  // B fragment of MMA (2p + j) from that load: k = 4j..4j+3, two halves per register.
  QPN_DEV static void b_frag(const u32 (&xr)[X_REGS], int j, u32& b0, u32& b1) {
    b0 = xr[2 * j];
    b1 = xr[2 * j + 1];
  }
  QPN_DEV static void mma(float (&d)[8], u32 a0, u32 a1, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
  }
};

// --------------------------------------------------------------------------------- decoders
// The bit-level decoders every atom shares. Each turns two codes of a 32-bit word into one f16x2
// register WITHOUT rounding: the code's bits are moved into FP16 position, so the result is the
// code's value times a fixed power of two, restored exactly by whoever consumes it (a multiply
// by that power of two in FP16, or folded into the FP32 scale of the result).
//
// e2m1: nibbles 3 and 7 (the top nibble of each 16-bit half) -> sign at bit 15, exponent:mantissa
// at bits 11..9. That FP16 pattern is the e2m1 value times 2^-14 (0.5 becomes the subnormal 2^-15).
QPN_DEV u32 e2m1x2_bits(u32 t) { return and_or(t >> 3, 0x0E000E00u, t & 0x80008000u); }
// The same for nibbles 3-R and 7-R of v, i.e. e2m1x2_bits(v << 4R), written with the two shifts
// explicit: the compiler otherwise emulates (v << 4R) >> 3 with an extra mask.
template <int R>
QPN_DEV u32 e2m1x2_pair(u32 v) {
  const u32 mag = (R == 0) ? (v >> 3) : (v << (4 * R - 3));
  return and_or(mag, 0x0E000E00u, (v << (4 * R)) & 0x80008000u);
}
// All four pairs of a word at once, h_r = e2m1x2_pair<r>(v), in 13 operations instead of 15:
// split the word into its odd nibbles (1, 3, 5, 7) and its even ones moved up by one nibble.
// In such a half-empty word, for the pair at nibbles 3/7 the magnitude source (>> 3) and the sign
// source (the word itself) hold nothing but zeros where the other one's bits land, so one
// (a | b) & mask (a single LOP3) assembles the FP16 pair; the pair at 1/5 is the same at << 5, << 8.
QPN_DEV void e2m1x2_quad(u32 v, u32& h0, u32& h1, u32& h2, u32& h3) {
  const u32 odd = v & 0xF0F0F0F0u;
  const u32 even = (v << 4) & 0xF0F0F0F0u;
  h0 = ((odd >> 3) | odd) & 0x8E008E00u;
  h2 = ((odd << 5) | (odd << 8)) & 0x8E008E00u;
  h1 = ((even >> 3) | even) & 0x8E008E00u;
  h3 = ((even << 5) | (even << 8)) & 0x8E008E00u;
}
// e4m3: bytes 1 and 3 (the top byte of each half) -> sign at 15, exponent:mantissa at 13..7: the
// e4m3 value times 2^-8 (subnormals included; the smallest, 2^-9, becomes 2^-17, still exact).
QPN_DEV u32 e4m3x2_bits(u32 t) { return and_or(t >> 1, 0x3F803F80u, t & 0x80008000u); }

// A decoder turns a lane's code vector for one k-block into the stream of f16x2 operand
// registers, index 0 .. K_BLOCK/2 - 1 in k order (the atom takes A_REGS of them per MMA).
// Only bit moves and one exact power-of-two FP16 multiply: no rounding anywhere.

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

// FP8 e4m3: bytes 1 and 3 of a word become FP16 (sign at 15, exponent:mantissa at 13..7), the
// e4m3 value times 2^-8, restored exactly by the multiply by 2^8 (0x5C00). A left shift by 8
// brings bytes 0 and 2 into place for the next register.
struct DecFP8 {
  static constexpr bool GROUPED = false;  // per-tensor / per-channel scale: applied to the FP32 result
  static constexpr bool GROUP_RECORDS = false;
  static constexpr int WORDS = 8;         // 32 bytes of codes per lane per k-block
  static constexpr int WORDS_PER_PAIR = 2;  // codes of 4 inputs (1 MMA of m8n8k4) per word
  // Two k-blocks ahead at one token tile (3 x 1 KB in flight: TP4 in_proj gives 13 warps per SM,
  // which the model's t0-bounded fit puts latency-bound with 2 KB); one at two token tiles, where a
  // second spills qpn8_mt2_m8n8k4 (8 words a stage).
  static constexpr int KBLOCKS_AHEAD = 2;
  static constexpr int KBLOCKS_AHEAD_MT2 = 1;
  static constexpr float OUT_MULT = 1.0f;   // the scale of the result is all in the FP32 chscale
  QPN_DEV static u32 dec(u32 t) { return hmul2(e4m3x2_bits(t), 0x5C005C00u); }
  QPN_DEV static u32 half2(const u32 (&w)[WORDS], int idx) { return dec(w[idx >> 1] << (8 * (idx & 1))); }
  QPN_DEV static u32 front_half2(const u32 (&w)[WORDS], int r) { return dec(w[r >> 1] << (8 * (r & 1))); }
};

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
