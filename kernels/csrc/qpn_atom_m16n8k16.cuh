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

  // Token whose activations the lane supplies (B column). Which inputs it supplies in each step is
  // the fragment's layout (Frag16*::x_offset / load_x).
  QPN_DEV static int b_token(int lane) { return lane >> 2; }
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

// 8-byte read-only load and store (the NVFP4 layout's activation quads, the reconstruct pass).
QPN_DEV void ldg64(const void* p, u32& a, u32& b) {
  asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}
QPN_DEV void stg64(void* p, u32 a, u32 b) {
  asm volatile("st.global.v2.u32 [%0], {%1,%2};" :: "l"(p), "r"(a), "r"(b) : "memory");
}
// cp.async (sm_80+): global -> shared without registers. src_bytes < 16 zero-fills the rest (0:
// a row past M arrives as zeros). .cg: cached in L2 only (weights are read once).
QPN_DEV u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
QPN_DEV void cp_async16(u32 dst, const void* src, u32 src_bytes) {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
#endif
}
QPN_DEV void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
QPN_DEV void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}
QPN_DEV void lds128(u32 p, u32& a, u32& b, u32& c, u32& d) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(p) : "memory");
}
QPN_DEV void lds64(u32 p, u32& a, u32& b) {
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "r"(p) : "memory");
}

// f16x2 with both halves = the low (resp. high) half of v. ptxas folds this into the consuming
// HMUL2 as an operand selector (.H0_H0 / .H1_H1): no extra instruction.
QPN_DEV u32 dup_lo(u32 v) {
  u32 d;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {l, l}; }" : "=r"(d) : "r"(v));
  return d;
}
QPN_DEV u32 dup_hi(u32 v) {
  u32 d;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {h, h}; }" : "=r"(d) : "r"(v));
  return d;
}

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

// FP8 e4m3 in m16n8k16 order: step s takes words 2s (a0 = bytes 0-1, a1 = bytes 2-3) and 2s+1
// (a2, a3). Exact e4m3 values in FP16; the per-tensor / per-channel scale is applied in FP32.
// The k-slot permutation of the fragments without an MMA per scale group (FP8, INT4): lane (g, t)
// covers token g's inputs 16t .. 16t+15 of each k-block in one contiguous run (32 bytes of
// activations), and step s its inputs 16t + 4s .. +3.
struct Frag16LaneRun16 {
  QPN_DEV static int x_offset(int lane) { return 16 * (lane & 3); }
  QPN_DEV static void load_x(const u16* p, u32 (&xr)[8]) {
    ldg128(p, xr[0], xr[1], xr[2], xr[3]);
    ldg128(p + 8, xr[4], xr[5], xr[6], xr[7]);
  }
  // Reconstruct: step s covers inputs 16t + 4s .. +3 (a0 a2 on row g, a1 a3 on row g+8).
  QPN_DEV static void store_ws(u16* row_g, size_t ldw, int lane, int s, u32 a0, u32 a1, u32 a2, u32 a3) {
    u16* p = row_g + 4 * s + x_offset(lane);
    stg64(p, a0, a2);
    stg64(p + 8 * ldw, a1, a3);
  }
};

struct Frag16FP8 : Frag16LaneRun16 {
  static constexpr bool GROUPED = false;
  static constexpr bool RECORDS = false;
  static constexpr int WORDS = 8;            // 32 bytes of codes per lane per (tile, k-block)
  static constexpr float OUT_MULT = 1.0f;
  // Activations (Frag16LaneRun16): step s takes words 2s, 2s+1. FP8 has no group scale, so no need
  // to keep an MMA within 16 consecutive inputs.
  QPN_DEV static int scale_offset(int) { return 0; }
  QPN_DEV static void load_scales(const u8*, u32 (&sc)[2]) { sc[0] = sc[1] = 0u; }
  QPN_DEV static void frag(const u32 (&w)[WORDS], int s, const u32 (&)[2], u32& a0, u32& a1, u32& a2, u32& a3) {
    a0 = cvt_e4m3x2_lo(w[2 * s]);
    a1 = cvt_e4m3x2_hi(w[2 * s]);
    a2 = cvt_e4m3x2_lo(w[2 * s + 1]);
    a3 = cvt_e4m3x2_hi(w[2 * s + 1]);
  }
};

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

// Whether decoder F folds its group scales into the sums (F::FOLD), false for every other decoder.
template <class F, class = void>
struct FoldsGroups { static constexpr bool value = false; };
template <class F>
struct FoldsGroups<F, decltype(void(F::FOLD))> { static constexpr bool value = F::FOLD; };
