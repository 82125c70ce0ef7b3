// The NVFP4 family's m16n8k16 (sm_80+) fragment decoders: Frag16NVFP4 (unit scale), Frag16NVFP4S7
// (scales times 2^7) and Frag16NVFP4Exact (normal operands).
#pragma once
#include "qpn_atom_m16n8k16.cuh"

// e2m1x2_quad (qpn_family.cuh) with fewer integer-pipe instructions, bit for bit the same four
// registers (h_r from nibbles 3-r and 7-r). On sm_90 the NVFP4 kernels are bound by the integer
// (ALU) pipe: Nsight Compute on gate_up, M = 1 (2026-12-01): ALU the busiest pipe, 49.6% at 45% of
// DRAM, i.e. the pipe would saturate before the memory does; ptxas turned the quad into about 12
// ALU instructions per word (LOP3 and right shifts) plus 5 IMAD.SHL. Here the gap between a
// nibble's sign (bit 3) and its magnitude (bits 0-2), 3 in e2m1 and 6 in the FP16 pattern
// (bit 15 vs bits 9-11), is closed once per word and nibble parity with a carry-free add on the
// FMA pipe: the even nibbles' sign moves up 3 (Me + Se * 8: fields 7 bits wide in their byte,
// no overlap), the odd nibbles' magnitude moves down 3 (Mo >> 3 as the high word of Mo * 2^29,
// plus So). Each register is then one left shift (IMAD.SHL) of its parity's word and one mask:
// 8 LOP3 per word on the ALU, the rest on the FMA pipe (ptxas 13.0, sm_90, t2d4p0 main loop: 370
// ALU instructions per 4 k-blocks instead of 444, 904 instructions in all instead of 972). Used
// on sm_89+ (Frag16NVFP4::frag); sm_80-86 keep e2m1x2_quad, whose registers fit there. Checked
// against e2m1x2_quad on all 2^32 words on the H200 (2026-12-01).
QPN_DEV void e2m1x2_quad_fma(u32 v, u32& h0, u32& h1, u32& h2, u32& h3) {
  const u32 mo = v & 0x70707070u, so = v & 0x80808080u;   // odd nibbles: magnitude, sign
  const u32 ve = v & 0x0F0F0F0Fu, se = v & 0x08080808u;   // even nibbles: whole, sign
  // mo >> 3 as the high word of mo * (2^29 + 1): exact, since mo / 8 is an integer and mo < 2^32
  // adds less than 1 (a power-of-two factor would be turned back into an ALU shift by ptxas).
  const u32 yo = __umulhi(mo, 0x20000001u) + so;   // odd nibble n: sign 4n+3, magnitude 4n-3 .. 4n-1
  const u32 ye = se * 7u + ve;                     // even nibble n: sign 4n+6, magnitude 4n .. 4n+2
  h0 = yo & 0x8E008E00u;                        // nibbles 3, 7: already in place
  h2 = (yo << 8) & 0x8E008E00u;                 // nibbles 1, 5
  h1 = (ye << 1) & 0x8E008E00u;                 // nibbles 2, 6
  h3 = (ye << 9) & 0x8E008E00u;                 // nibbles 0, 4
}

// NVFP4 layout on m16n8k16: MMA step s of a k-block is NVFP4 group s (inputs 16s .. 16s+15) of the
// tile's 16 rows; lane (g, t) supplies inputs 16s + 4t .. 16s + 4t + 3 of rows g and g+8 (atoms.py).
// Why one group per MMA: the tensor core adds its 16 products (and the running sum) with limited
// alignment precision, so a product far below the largest one in the same instruction is rounded
// off. With one group per MMA, large products that cancel (the FP16-overflow trap: +-1e5 terms in
// one group) share their instruction only with products of the same group, which carry the same
// scale, and the running sum after the group is already cancelled; small products of other
// groups are never added next to them (the cuBLAS exposure, not worse).
// Scales: a lane reads 8 bytes per (tile, k-block): (row g, group s), (row g+8, group s) for s =
// 0..3, so word 0 holds steps 0 (low half) and 1, word 1 steps 2 and 3, each as one e4m3 pair.
//
// The fast form: f16x2 (s_g, s_g8) per step, one conversion (sm_89+); each operand register is
// e2m1x2_bits (value * 2^-14) times the row's scale as it is: e2m1 * e4m3 * 2^-14, in ONE exact FP16
// multiply per register. Exact because e2m1 has at most 2 significant bits and e4m3 at most 4: every
// product is a multiple of 2^-10 * 2^-14 = 2^-24, which FP16 represents (its subnormal step), and at
// most 2688 * 2^-14 = 0.16. Most operands are FP16 subnormals, which the tensor cores take as they
// are (tests: the every-byte replay checks each multiply is exact; the GPU tests include an
// all-subnormal-products case). The 2^14 comes back in the FP32 epilogue (OUT_MULT), folded into
// the global scale.
// UP = 7 (Frag16NVFP4S7): the scales times 2^7, operands e2m1 * e4m3 * 2^-7 (multiples of 2^-17, at
// most 21; s * 2^7 <= 57344 fits FP16), one more FP16 multiply per step on sm_89+. Measured side by
// side on the H200 (results/kernel_sm80_scale_ab{1,2}_sweep_h200_20261201.csv, two runs within
// 0.5%): UP = 0 is 3% faster in the M 9-16 ring kernel t2s4x and the same in t2d4p0, but 2% slower
// in the large-N ring kernel t4s4 (TP1 lm_head M = 1: 234.1 vs 228.7 us), which therefore keeps UP = 7.
template <int UP>
struct Frag16NVFP4Scaled {
  static constexpr bool GROUPED = true;
  static constexpr bool RECORDS = false;     // scales per (tile, k-block): SCALE_BLOCK_BYTES each
  static constexpr int WORDS = 4;            // 16 bytes of codes per lane per (tile, k-block)
  static constexpr float OUT_MULT = float(1 << (14 - UP));
  // Activations: lane (g, t) reads token g's inputs 16s + 4t .. +3 for step s (4 x 8 bytes).
  QPN_DEV static int x_offset(int lane) { return 4 * (lane & 3); }
  QPN_DEV static void load_x(const u16* p, u32 (&xr)[8]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) ldg64(p + 16 * s, xr[2 * s], xr[2 * s + 1]);
  }
  // Scales: 8 bytes per lane per (tile, k-block), at byte 8g (the lanes of one g read the same).
  QPN_DEV static int scale_offset(int lane) { return 8 * (lane >> 2); }
  QPN_DEV static void load_scales(const u8* p, u32 (&sc)[2]) { ldg64(p, sc[0], sc[1]); }
  // (s_g, s_g8) * 2^UP of step s, exact.
  QPN_DEV static u32 step_scales(const u32 (&sc)[2], int s) {
    const u32 w = sc[s >> 1];
#if __CUDA_ARCH__ >= 890
    const u32 p = (s & 1) ? cvt_e4m3x2_hi(w) : cvt_e4m3x2_lo(w);
    return UP == 0 ? p : hmul2(p, (u32)(15 + UP) * 0x04000400u);   // * 2^UP (FP16 exponent 15 + UP)
#else
    return hmul2(e4m3x2_bits(prmt(w, 0u, (s & 1) ? 0x3424u : 0x1404u)), (u32)(23 + UP) * 0x04000400u);  // (s*2^-8)*2^(8+UP)
#endif
  }
  // Step s: word s of the lane's k-block; half2 r comes from nibbles 3-r and 7-r (w << 4r).
  QPN_DEV static void frag(const u32 (&w)[WORDS], int s, const u32 (&sc)[2],
                           u32& a0, u32& a1, u32& a2, u32& a3) {
    const u32 p = step_scales(sc, s);
    const u32 sg = dup_lo(p), sg8 = dup_hi(p);
    u32 h0, h1, h2, h3;
#if __CUDA_ARCH__ >= 890
    e2m1x2_quad_fma(w[s], h0, h1, h2, h3);
#else
    e2m1x2_quad(w[s], h0, h1, h2, h3);   // sm_80-86: the FMA form costs the t2d4p0 kernel a spill there
#endif
    a0 = hmul2(h0, sg);
    a1 = hmul2(h1, sg8);
    a2 = hmul2(h2, sg);
    a3 = hmul2(h3, sg8);
  }
};

using Frag16NVFP4 = Frag16NVFP4Scaled<0>;
using Frag16NVFP4S7 = Frag16NVFP4Scaled<7>;

// NVFP4, the exact-normal form: value restored first (* 2^14), then times the exact scale, so
// every operand is the normal FP16 number e2m1 * e4m3. One more FP16 multiply per register than
// Frag16NVFP4. Same layout. Used by the reconstruct pass and as a measured variant.
struct Frag16NVFP4Exact : Frag16NVFP4 {
  static constexpr float OUT_MULT = 1.0f;
  QPN_DEV static void frag(const u32 (&w)[WORDS], int s, const u32 (&sc)[2],
                           u32& a0, u32& a1, u32& a2, u32& a3) {
    const u32 ws = sc[s >> 1];
    const u32 p = (s & 1) ? cvt_e4m3x2_hi(ws) : cvt_e4m3x2_lo(ws);   // exact (s_g, s_g8)
    const u32 sg = dup_lo(p), sg8 = dup_hi(p);
    u32 h0, h1, h2, h3;
    e2m1x2_quad(w[s], h0, h1, h2, h3);
    a0 = hmul2(hmul2(h0, 0x74007400u), sg);
    a1 = hmul2(hmul2(h1, 0x74007400u), sg8);
    a2 = hmul2(hmul2(h2, 0x74007400u), sg);
    a3 = hmul2(hmul2(h3, 0x74007400u), sg8);
  }
  // Reconstruct: the registers of step s are (row g: a0 a2) and (row g+8: a1 a3) at inputs
  // 16s + 4t .. +3 of the k-block.
  QPN_DEV static void store_ws(u16* row_g, size_t ldw, int lane, int s, u32 a0, u32 a1, u32 a2, u32 a3) {
    u16* p = row_g + 16 * s + x_offset(lane);
    stg64(p, a0, a2);
    stg64(p + 8 * ldw, a1, a3);
  }
};
