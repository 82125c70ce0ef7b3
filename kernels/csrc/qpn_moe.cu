// QPN grouped mixture-of-experts kernels: every (token, expert) pair of a top-k routing goes
// through gate/up projection, SwiGLU and down projection, reading only the selected experts'
// packed weights, with the routing read on the device (no host synchronisation anywhere, so a
// whole MoE layer is one fixed sequence of launches that a CUDA graph can capture).
//
// Four launches per MoE layer, each with a grid fixed by (pairs = tokens * top_k, experts):
//   1. qpn_moe_align: one block groups the pairs by expert (counting sort in shared memory)
//      into "groups" of at most Atom::TOKENS pairs of one expert; writes the group table and
//      the number of groups. Pairs with an expert id outside [0, E) (e.g. -1: expert not on this
//      rank) are skipped and contribute nothing.
//   2. qpn{2,8}_moe_gate_up_<atom>: block = (group, n-block). Half of the block's warps stream
//      gate tiles, the other half the up tiles of the same rows; after the split-K reduction the
//      epilogue applies SwiGLU in FP32 (silu(gate) * up) and rounds once to FP16 into
//      h[pair, ldh] (the down projection's activations).
//   3. qpn{2,8}_moe_down_<atom>: block = (group, n-block), activations = h rows of the group's
//      pairs; FP32 result per pair into d[pair, H].
//   4. qpn_moe_combine: y[t] = sum over slots k (in slot order) of w[t,k] * d[t*top_k + k]
//      (+ an optional shared-expert term), in FP32, rounded once to FP16.
// Blocks whose group index is past the device-side group count return at once, so the grid
// can be sized by the upper bound the host knows without looking at the routing.
//
// The main loop is the dense family's (qpn_kernels.cu, qpn_linear_body with MT = 1): the atom
// and the decoder are template parameters, so a new atom is one more entry line at the bottom.
// Compiles standalone under NVRTC with no headers.
#include "qpn_family.cuh"

#define QPN_MOE_THREADS 256
#define QPN_MOE_WARPS (QPN_MOE_THREADS / 32)
#define QPN_MOE_ALIGN_THREADS 1024

QPN_DEV int imin(int a, int b) { return a < b ? a : b; }

struct MoeAlignArgs {
  const int* topk_ids;  // [pairs] int32, pair p = token * top_k + slot
  int* sorted_pairs;    // [pairs] pair indices grouped by expert
  int* group_expert;    // [g_max]
  int* group_start;     // [g_max] first index into sorted_pairs
  int* group_count;     // [g_max] pairs in the group (1 .. rows_per_group)
  int* num_groups;      // [1]
  int pairs, num_experts, rows_per_group;
};

// One block; dynamic shared memory = 4 * num_experts ints.
extern "C" __global__ void __launch_bounds__(QPN_MOE_ALIGN_THREADS) qpn_moe_align(MoeAlignArgs a) {
  extern __shared__ int sm[];
  const int E = a.num_experts, R = a.rows_per_group;
  int* cnt = sm;           // pairs per expert
  int* off = sm + E;       // first sorted position of the expert
  int* goff = sm + 2 * E;  // first group of the expert
  int* fill = sm + 3 * E;  // pairs placed so far
  __shared__ int total_groups;
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += blockDim.x) {
    cnt[e] = 0;
    fill[e] = 0;
  }
  __syncthreads();
  for (int p = tid; p < a.pairs; p += blockDim.x) {
    const int e = a.topk_ids[p];
    if ((unsigned)e < (unsigned)E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  if (tid < 32) {
    // Exclusive scan of pair and group counts over the experts: each lane takes a contiguous
    // run of experts, then one warp-wide inclusive scan of the lane sums.
    const int per = (E + 31) / 32;
    const int e0 = imin(E, tid * per), e1 = imin(E, e0 + per);
    int sp = 0, sg = 0;
    for (int e = e0; e < e1; ++e) {
      sp += cnt[e];
      sg += (cnt[e] + R - 1) / R;
    }
    int ip = sp, ig = sg;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int vp = __shfl_up_sync(0xffffffffu, ip, d);
      const int vg = __shfl_up_sync(0xffffffffu, ig, d);
      if (tid >= d) {
        ip += vp;
        ig += vg;
      }
    }
    int p0 = ip - sp, g0 = ig - sg;
    for (int e = e0; e < e1; ++e) {
      off[e] = p0;
      goff[e] = g0;
      p0 += cnt[e];
      g0 += (cnt[e] + R - 1) / R;
    }
    if (tid == 31) total_groups = ig;
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    const int c = cnt[e];
    for (int j = 0; j * R < c; ++j) {
      const int g = goff[e] + j;
      a.group_expert[g] = e;
      a.group_start[g] = off[e] + j * R;
      a.group_count[g] = imin(R, c - j * R);
    }
  }
  // Placement order inside an expert's run is whatever the atomics give: harmless, because each
  // pair is one MMA column (columns never mix) and every result is stored at its pair index.
  for (int p = tid; p < a.pairs; p += blockDim.x) {
    const int e = a.topk_ids[p];
    if ((unsigned)e < (unsigned)E) a.sorted_pairs[off[e] + atomicAdd(&fill[e], 1)] = p;
  }
  if (tid == 0) *a.num_groups = total_groups;
}

struct MoeGemmArgs {
  const u8* codes[2];       // packed expert stacks: [0] gate (or down), [1] up (gate_up only)
  const u8* scales[2];      // NVFP4 packed e4m3 group scales (unused for FP8)
  const float* chscale[2];  // FP32 result scale per expert: NVFP4 global; FP8 per tensor / channel
  long long code_stride;    // bytes of packed codes per expert
  long long scale_stride;   // bytes of packed scales per expert
  int chscale_stride;       // floats per expert in chscale (1, or N when per channel)
  int chscale_per_channel;
  const u16* x;             // activations fp16, row r at x + r * ldx, zero padded to K_BLOCK
  int ldx;
  int x_row_div;            // activation row of pair p = p / x_row_div (top_k: tokens; 1: pairs)
  const int* sorted_pairs;
  const int* group_expert;
  const int* group_start;
  const int* group_count;
  const int* num_groups;
  void* y;                  // gate_up: fp16 h [pairs, ldy]; down: fp32 d [pairs, ldy]
  int ldy;
  int n, kblocks, ksplit, tiles_per_block, n_blocks;
};

QPN_DEV float silu_f32(float v) {
  float e;
  asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(-v * 1.4426950408889634f));
  return v / (1.f + e);
}

template <class Atom, class Dec, bool GATE_UP>
__device__ __forceinline__ void qpn_moe_gemm_body(const MoeGemmArgs& a) {
  extern __shared__ float red[];  // [warps][TOKENS][TILE_N] partial tiles for split-K
  const int group = blockIdx.x / a.n_blocks;
  const int nblock = blockIdx.x - group * a.n_blocks;
  if (group >= *a.num_groups) return;  // block-uniform, before the only barrier
  const int expert = a.group_expert[group];
  const int start = a.group_start[group];
  const int count = a.group_count[group];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int tile_in_block = warp / a.ksplit;
  const int ks = warp % a.ksplit;
  // gate_up: warps of the first half stream gate tiles, the second half the up tiles of the
  // same output rows, so the SwiGLU epilogue finds both in shared memory.
  const int half = GATE_UP ? a.tiles_per_block / 2 : a.tiles_per_block;
  const int which = (GATE_UP && tile_in_block >= half) ? 1 : 0;
  const int tile = nblock * half + tile_in_block - which * half;
  const int n_tiles = (a.n + Atom::TILE_N - 1) / Atom::TILE_N;

  float acc[Atom::ACC];
#pragma unroll
  for (int i = 0; i < Atom::ACC; ++i) acc[i] = 0.f;

  if (tile < n_tiles) {
    constexpr int LANE_BYTES = Dec::WORDS * 4;
    constexpr int BLOCK_BYTES = LANE_BYTES * 32;
    constexpr int PAIRS = Atom::STEPS / 2;
    const int col = Atom::b_token(lane);
    const bool xvalid = col < count;
    const int pair = xvalid ? a.sorted_pairs[start + col] : 0;
    const u16* xrow = a.x + (size_t)(pair / a.x_row_div) * a.ldx;
    const u8* cptr = a.codes[which] + (size_t)expert * a.code_stride + (size_t)tile * a.kblocks * BLOCK_BYTES +
                     lane * LANE_BYTES;
    const u8* sptr = a.scales[which] + (size_t)expert * a.scale_stride +
                     (size_t)tile * a.kblocks * Atom::SCALE_BLOCK_BYTES + Atom::scale_pair_offset(lane);
    for (int kb = ks; kb < a.kblocks; kb += a.ksplit) {
      u32 w[Dec::WORDS];
#pragma unroll
      for (int j = 0; j < Dec::WORDS; j += 4)
        ldg128(cptr + (size_t)kb * BLOCK_BYTES + 4 * j, w[j], w[j + 1], w[j + 2], w[j + 3]);
      u32 sc2[2] = {0x3C003C00u, 0x3C003C00u};
      if constexpr (Dec::GROUPED) {
        const u32 sp2 = Dec::scale_pair(ldg16(sptr + (size_t)kb * Atom::SCALE_BLOCK_BYTES));
        sc2[0] = prmt(sp2, 0u, 0x1010u);
        sc2[1] = prmt(sp2, 0u, 0x3232u);
      }
      // Unrolled (one token tile): the word rotation and the loop control cost nothing, 11% fewer
      // instructions per k-block (ptxas 12.9, sm_70), within the 64-register cap.
#pragma unroll
      for (int p = 0; p < PAIRS; ++p) {
        u32 xr[Atom::X_REGS];
        Atom::load_x(xrow + kb * Atom::K_BLOCK + p * 2 * Atom::K_STEP, xr);
        const u32 s = (2 * p * Atom::K_STEP < 16) ? sc2[0] : sc2[1];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          u32 a0 = Dec::front_half2(w, j * Atom::A_REGS);
          u32 a1 = Dec::front_half2(w, j * Atom::A_REGS + 1);
          if constexpr (Dec::GROUPED) {
            a0 = hmul2(a0, s);
            a1 = hmul2(a1, s);
          }
          u32 b0, b1;
          Atom::b_frag(xr, j, b0, b1);
          Atom::mma(acc, a0, a1, b0, b1);
        }
        rotate_words<Dec::WORDS_PER_PAIR>(w);
      }
    }
  }

  constexpr int TILE_ELEMS = Atom::TILE_N * Atom::TOKENS;
  float* mine = red + warp * TILE_ELEMS;
#pragma unroll
  for (int i = 0; i < Atom::ACC; ++i)
    mine[Atom::acc_token(lane, i) * Atom::TILE_N + Atom::acc_row(lane, i)] = acc[i];
  __syncthreads();
  const int outs = half * TILE_ELEMS;
  for (int o = tid; o < outs; o += QPN_MOE_THREADS) {
    const int row = o % Atom::TILE_N;
    const int tok = (o / Atom::TILE_N) % Atom::TOKENS;
    const int tib = o / TILE_ELEMS;
    const int n = (nblock * half + tib) * Atom::TILE_N + row;
    if (tok >= count || n >= a.ldy) continue;
    const int pair = a.sorted_pairs[start + tok];
    if (n >= a.n) {  // K padding of the down projection's activations must read as zero
      if (GATE_UP) stg16((u16*)a.y + (size_t)pair * a.ldy + n, 0);
      continue;
    }
    float v = 0.f;
    for (int s = 0; s < a.ksplit; ++s) v += red[(tib * a.ksplit + s) * TILE_ELEMS + tok * Atom::TILE_N + row];
    const int cidx = expert * a.chscale_stride + (a.chscale_per_channel ? n : 0);
    v *= ldgf(a.chscale[0] + cidx);
    if (GATE_UP) {
      float u = 0.f;
      for (int s = 0; s < a.ksplit; ++s)
        u += red[((tib + half) * a.ksplit + s) * TILE_ELEMS + tok * Atom::TILE_N + row];
      u *= ldgf(a.chscale[1] + cidx);
      stg16((u16*)a.y + (size_t)pair * a.ldy + n, f32_to_f16(silu_f32(v) * u));
    } else {
      ((float*)a.y)[(size_t)pair * a.ldy + n] = v;
    }
  }
}

struct MoeCombineArgs {
  const float* d;      // [tokens * top_k, h] routed down-projection results
  const int* ids;      // [tokens * top_k]
  const float* w;      // [tokens * top_k] routing weights
  const float* d2;     // [tokens, h] shared-expert result or null
  const float* w2;     // [tokens] shared-expert weight or null (weight 1)
  u16* y;              // [tokens, h] fp16
  int tokens, top_k, num_experts, h;
};

extern "C" __global__ void __launch_bounds__(QPN_MOE_THREADS) qpn_moe_combine(MoeCombineArgs a) {
  const long long idx = (long long)blockIdx.x * QPN_MOE_THREADS + threadIdx.x;
  if (idx >= (long long)a.tokens * a.h) return;
  const int t = (int)(idx / a.h);
  const int n = (int)(idx - (long long)t * a.h);
  float acc = 0.f;
  for (int k = 0; k < a.top_k; ++k) {
    const int p = t * a.top_k + k;
    if ((unsigned)a.ids[p] < (unsigned)a.num_experts) acc = fma_rn(a.w[p], a.d[(size_t)p * a.h + n], acc);
  }
  if (a.d2) acc = fma_rn(a.w2 ? a.w2[t] : 1.f, a.d2[idx], acc);
  stg16(a.y + idx, f32_to_f16(acc));
}

#define QPN_MOE_GEMM_ENTRY(NAME, ATOM, DEC, GATE_UP)                                            \
  extern "C" __global__ void __launch_bounds__(QPN_MOE_THREADS, 4) NAME(MoeGemmArgs a) {        \
    qpn_moe_gemm_body<ATOM, DEC, GATE_UP>(a);                                                   \
  }

// Entry points, one per (format, projection), written below by kernels/jit.py (moe_entry_lines) from
// each format's registered data (its MoE entry points and m8n8k4 decoder) as NVRTC compiles the file.
// qpn_moe_sm80.cu includes this file for the routing and combine kernels and adds its own entries.
