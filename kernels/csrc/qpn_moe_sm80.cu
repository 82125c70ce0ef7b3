// The grouped MoE kernels on the sm_80+ atom (m16n8k16, qpn_atom_m16n8k16.cuh): the same launch
// sequence, group table, epilogue (SwiGLU / FP32 per-pair result) and combine as qpn_moe.cu, whose
// routing and combine kernels and m8n8k4 entries this file includes; only the weight tile (16
// rows), the k-block (64 inputs) and the fragment feed differ. One 8-token group per block, split-K
// across the block's warps as in the m8n8k4 body (the dense sm_80 family's stream-K partition is
// not used here: a MoE call's work is a ragged set of (expert, group) tiles known only on the
// device). Compiled only for sm_80 and later (kernels/moe.py:MOE_SOURCES).
#include "qpn_atom_m16n8k16.cuh"
#include "qpn_moe.cu"

template <class F, bool GATE_UP>
__device__ __forceinline__ void qpn_moe80_gemm_body(const MoeGemmArgs& a) {
  using A = AtomM16N8K16;
  extern __shared__ float red[];  // [warps][TOKENS][TILE_N] partial tiles for split-K
  const int group = blockIdx.x / a.n_blocks;
  const int nblock = blockIdx.x - group * a.n_blocks;
  if (group >= *a.num_groups) return;
  const int expert = a.group_expert[group];
  const int start = a.group_start[group];
  const int count = a.group_count[group];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int tile_in_block = warp / a.ksplit;
  const int ks = warp % a.ksplit;
  const int half = GATE_UP ? a.tiles_per_block / 2 : a.tiles_per_block;
  const int which = (GATE_UP && tile_in_block >= half) ? 1 : 0;
  const int tile = nblock * half + tile_in_block - which * half;
  const int n_tiles = (a.n + A::TILE_N - 1) / A::TILE_N;

  float acc[A::ACC];
#pragma unroll
  for (int i = 0; i < A::ACC; ++i) acc[i] = 0.f;

  if (tile < n_tiles) {
    constexpr int LANE_BYTES = F::WORDS * 4;
    constexpr int BLOCK_BYTES = LANE_BYTES * 32;
    const int col = A::b_token(lane);
    const bool xvalid = col < count;
    const int pair = xvalid ? a.sorted_pairs[start + col] : 0;
    const u16* xrow = a.x + (size_t)(pair / a.x_row_div) * a.ldx + F::x_offset(lane);
    const u8* cptr = a.codes[which] + (size_t)expert * a.code_stride + (size_t)tile * a.kblocks * BLOCK_BYTES +
                     lane * LANE_BYTES;
    const u8* sptr = a.scales[which] + (size_t)expert * a.scale_stride +
                     (size_t)tile * a.kblocks * A::SCALE_BLOCK_BYTES + F::scale_offset(lane);
    for (int kb = ks; kb < a.kblocks; kb += a.ksplit) {
      u32 w[F::WORDS];
#pragma unroll
      for (int q = 0; q < F::WORDS; q += 4)
        ldg128(cptr + (size_t)kb * BLOCK_BYTES + 4 * q, w[q], w[q + 1], w[q + 2], w[q + 3]);
      u32 sc[2] = {0u, 0u};
      if constexpr (F::GROUPED) F::load_scales(sptr + (size_t)kb * A::SCALE_BLOCK_BYTES, sc);
      u32 xr[8];
      if (xvalid) {
        F::load_x(xrow + (size_t)kb * A::K_BLOCK, xr);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) xr[i] = 0u;
      }
#pragma unroll
      for (int s = 0; s < A::STEPS; ++s) {
        u32 a0, a1, a2, a3;
        F::frag(w, s, sc, a0, a1, a2, a3);
        A::mma(acc, a0, a1, a2, a3, xr[2 * s], xr[2 * s + 1]);
      }
    }
  }

  constexpr int TILE_ELEMS = A::TILE_N * A::TOKENS;
  float* mine = red + warp * TILE_ELEMS;
#pragma unroll
  for (int i = 0; i < A::ACC; ++i) mine[A::acc_token(lane, i) * A::TILE_N + A::acc_row(lane, i)] = acc[i];
  __syncthreads();
  const int outs = half * TILE_ELEMS;
  for (int o = tid; o < outs; o += QPN_MOE_THREADS) {
    const int row = o % A::TILE_N;
    const int tok = (o / A::TILE_N) % A::TOKENS;
    const int tib = o / TILE_ELEMS;
    const int n = (nblock * half + tib) * A::TILE_N + row;
    if (tok >= count || n >= a.ldy) continue;
    const int pair = a.sorted_pairs[start + tok];
    if (n >= a.n) {
      if (GATE_UP) stg16((u16*)a.y + (size_t)pair * a.ldy + n, 0);
      continue;
    }
    float v = 0.f;
    for (int s = 0; s < a.ksplit; ++s) v += red[(tib * a.ksplit + s) * TILE_ELEMS + tok * A::TILE_N + row];
    const int cidx = expert * a.chscale_stride + (a.chscale_per_channel ? n : 0);
    v *= ldgf(a.chscale[0] + cidx) * F::OUT_MULT;
    if (GATE_UP) {
      float u = 0.f;
      for (int s = 0; s < a.ksplit; ++s)
        u += red[((tib + half) * a.ksplit + s) * TILE_ELEMS + tok * A::TILE_N + row];
      u *= ldgf(a.chscale[1] + cidx) * F::OUT_MULT;
      stg16((u16*)a.y + (size_t)pair * a.ldy + n, f32_to_f16(silu_f32(v) * u));
    } else {
      ((float*)a.y)[(size_t)pair * a.ldy + n] = v;
    }
  }
}

#define QPN_MOE80_GEMM_ENTRY(NAME, F, GATE_UP)                                                  \
  extern "C" __global__ void __launch_bounds__(QPN_MOE_THREADS, 2) NAME(MoeGemmArgs a) {        \
    qpn_moe80_gemm_body<F, GATE_UP>(a);                                                         \
  }

// Entry lines: one per (format, projection), the families' MOE_ENTRIES
// (kernels/families/<family>/kernels_sm80.py), written below by kernels/jit.py (moe_entry_lines) as
// NVRTC compiles the file.
