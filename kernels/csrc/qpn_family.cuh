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
//
// Each weight family's decoders (DecNVFP4, DecFP8, DecINT4, ...) live in its package,
// kernels/families/<family>/m8n8k4.cuh; kernels/jit.py includes them into each source that
// instantiates kernels, ahead of the entry lines it writes.
