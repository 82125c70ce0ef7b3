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

// Whether decoder F folds its group scales into the sums (F::FOLD), false for every other decoder.
template <class F, class = void>
struct FoldsGroups { static constexpr bool value = false; };
template <class F>
struct FoldsGroups<F, decltype(void(F::FOLD))> { static constexpr bool value = F::FOLD; };

// Each weight family's fragment decoders (Frag16NVFP4, Frag16FP8, Frag16INT4*, ...) live in its
// package, kernels/families/<family>/m16n8k16.cuh; kernels/jit.py includes them into each source
// that instantiates kernels, ahead of the entry lines it writes.
