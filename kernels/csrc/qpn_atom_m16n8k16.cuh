// The sm_80+ atom of the QPN family: mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 with the
// weights on the A (16-row) side and up to 8 tokens on the B (8-column) side. Fragment order,
// k-slot assignment and scale placement: atoms.py:_m16n8k16 (the two must agree; the CPU test
// tests/test_kernels_sm80.py replays this header's decode on the packed bytes to prove it).
//
// The fragment decoders below use the bit-level decoders shared with the SM70 atom
// (qpn_family.cuh: e2m1x2_bits, e4m3x2_bits); only the order in which a lane's registers feed
// the MMA differs per atom.
#pragma once
#include "qpn_family.cuh"

struct AtomM16N8K16 {
  static constexpr int TILE_N = 16;    // weight rows per tile (the MMA's M)
  static constexpr int K_BLOCK = 64;   // inputs per k-block: 4 MMA steps of 16
  static constexpr int STEPS = 4;
  static constexpr int TOKENS = 8;     // tokens per tile (the MMA's N)
  static constexpr int ACC = 4;        // f32 accumulators per lane per (tile, token tile)
  static constexpr int SCALE_BLOCK_BYTES = 64;
  static constexpr int X_WORDS = 8;    // f16x2 activation registers per lane per k-block (32 bytes)

  // Token whose activations the lane supplies (B column) and the first of its 16 inputs in a k-block.
  QPN_DEV static int b_token(int lane) { return lane >> 2; }
  QPN_DEV static int x_offset(int lane) { return 16 * (lane & 3); }
  // Accumulator i of the lane: weight row within the tile and token within the token tile.
  QPN_DEV static int acc_row(int lane, int i) { return (lane >> 2) + 8 * (i >> 1); }
  QPN_DEV static int acc_token(int lane, int i) { return 2 * (lane & 3) + (i & 1); }

  QPN_DEV static void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
  }
};

// e4m3 pair -> f16x2, exact (sm_89+ has the conversion in hardware). lo: bytes 0, 1 of w; hi: 2, 3.
QPN_DEV u32 cvt_e4m3x2_lo(u32 w) {
  u32 d;
#if __CUDA_ARCH__ >= 890
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(d) : "r"(w));
#else
  d = hmul2(e4m3x2_bits(prmt(w, 0u, 0x1404u)), 0x5C005C00u);
#endif
  return d;
}
QPN_DEV u32 cvt_e4m3x2_hi(u32 w) {
  u32 d;
#if __CUDA_ARCH__ >= 890
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }" : "=r"(d) : "r"(w));
#else
  d = hmul2(e4m3x2_bits(prmt(w, 0u, 0x3424u)), 0x5C005C00u);
#endif
  return d;
}

// NVFP4 in m16n8k16 order, the fast form. A lane's two group scales (rows g and g+8, byte 0 and
// byte 1 of its 16-bit scale word) become f16x2 (s * 2^7, s * 2^7); each operand register is
// e2m1x2_bits (value * 2^-14) times that: e2m1 * e4m3 * 2^-7, in ONE exact FP16 multiply per
// register. Exact because e2m1 has at most 2 significant bits and e4m3 at most 4, every product
// is a multiple of 2^-10 * 2^-7 = 2^-17 (FP16 represents multiples of 2^-24) and at most
// 2688 * 2^-7 = 21, and s * 2^7 <= 448 * 128 = 57344 fits FP16. Products under 2^-14 are FP16
// subnormals, which the tensor cores take as they are (tests: all-subnormal-products case).
// The 2^7 comes back in the FP32 epilogue (OUT_MULT), folded into the global scale.
struct Frag16NVFP4 {
  static constexpr bool GROUPED = true;
  static constexpr int WORDS = 4;            // 16 bytes of codes per lane per (tile, k-block)
  static constexpr float OUT_MULT = 128.0f;
  QPN_DEV static void scales(u32 sp, u32& sg, u32& sg8) {
#if __CUDA_ARCH__ >= 890
    sg = hmul2(cvt_e4m3x2_lo(prmt(sp, 0u, 0x0000u)), 0x58005800u);   // * 2^7
    sg8 = hmul2(cvt_e4m3x2_lo(prmt(sp, 0u, 0x1111u)), 0x58005800u);
#else
    sg = hmul2(e4m3x2_bits(prmt(sp, 0u, 0x0404u)), 0x78007800u);     // (s * 2^-8) * 2^15
    sg8 = hmul2(e4m3x2_bits(prmt(sp, 0u, 0x1414u)), 0x78007800u);
#endif
  }
  // Step s: word s of the lane's k-block; half2 r comes from nibbles 3-r and 7-r (w << 4r).
  QPN_DEV static void frag(const u32 (&w)[WORDS], int s, u32 sg, u32 sg8,
                           u32& a0, u32& a1, u32& a2, u32& a3) {
    u32 h0, h1, h2, h3;
    e2m1x2_quad(w[s], h0, h1, h2, h3);
    a0 = hmul2(h0, sg);
    a1 = hmul2(h1, sg8);
    a2 = hmul2(h2, sg);
    a3 = hmul2(h3, sg8);
  }
};

// NVFP4, the exact-normal form: value restored first (* 2^14), then times the exact scale, so
// every operand is the normal FP16 number e2m1 * e4m3. One more FP16 multiply per register than
// Frag16NVFP4. Used by the reconstruct pass and as a measured variant.
struct Frag16NVFP4Exact {
  static constexpr bool GROUPED = true;
  static constexpr int WORDS = 4;
  static constexpr float OUT_MULT = 1.0f;
  QPN_DEV static void scales(u32 sp, u32& sg, u32& sg8) {
#if __CUDA_ARCH__ >= 890
    sg = cvt_e4m3x2_lo(prmt(sp, 0u, 0x0000u));
    sg8 = cvt_e4m3x2_lo(prmt(sp, 0u, 0x1111u));
#else
    sg = hmul2(e4m3x2_bits(prmt(sp, 0u, 0x0404u)), 0x5C005C00u);
    sg8 = hmul2(e4m3x2_bits(prmt(sp, 0u, 0x1414u)), 0x5C005C00u);
#endif
  }
  QPN_DEV static void frag(const u32 (&w)[WORDS], int s, u32 sg, u32 sg8,
                           u32& a0, u32& a1, u32& a2, u32& a3) {
    const u32 v = w[s];
    u32 h0, h1, h2, h3;
    e2m1x2_quad(v, h0, h1, h2, h3);
    a0 = hmul2(hmul2(h0, 0x74007400u), sg);
    a1 = hmul2(hmul2(h1, 0x74007400u), sg8);
    a2 = hmul2(hmul2(h2, 0x74007400u), sg);
    a3 = hmul2(hmul2(h3, 0x74007400u), sg8);
  }
};

// FP8 e4m3 in m16n8k16 order: step s takes words 2s (a0 = bytes 0-1, a1 = bytes 2-3) and 2s+1
// (a2, a3). Exact e4m3 values in FP16; the per-tensor / per-channel scale is applied in FP32.
struct Frag16FP8 {
  static constexpr bool GROUPED = false;
  static constexpr int WORDS = 8;            // 32 bytes of codes per lane per (tile, k-block)
  static constexpr float OUT_MULT = 1.0f;
  QPN_DEV static void scales(u32, u32& sg, u32& sg8) { sg = sg8 = 0u; }
  QPN_DEV static void frag(const u32 (&w)[WORDS], int s, u32, u32, u32& a0, u32& a1, u32& a2, u32& a3) {
    a0 = cvt_e4m3x2_lo(w[2 * s]);
    a1 = cvt_e4m3x2_hi(w[2 * s]);
    a2 = cvt_e4m3x2_lo(w[2 * s + 1]);
    a3 = cvt_e4m3x2_hi(w[2 * s + 1]);
  }
};
