// QPN kernels: packed NVFP4 (qpn2*), FP8 (qpn8*) and INT4 (qpn4*) linear layers, y[M, N] = x[M, K] * W[N, K]^T,
// with W streamed in its packed form and decoded in registers straight into MMA operands.
//
// Grid: blockIdx.x = n_block * m_chunks + m_chunk, so the m_chunks blocks that read the same
// weight tiles are adjacent in launch order and share those reads through L2 (the *_chunked
// route); qpn2/qpn8 and *_mt2 launch with m_chunks = 1. A block is 8 warps: tiles_per_block
// weight tiles x ksplit warps splitting K between them (split-K where N is small). Main loop:
// registers only (no shared memory); one barrier, before the split-K reduction in the epilogue.
//
// Compiles standalone under NVRTC with no headers (see qpn_ptx.cuh).
#include "qpn_family.cuh"

#define QPN_THREADS 256
#define QPN_WARPS (QPN_THREADS / 32)

struct QpnArgs {
  const u8* codes;        // packed codes, fragment order
  const u8* scales;       // NVFP4 packed e4m3 group scales; INT4 group records (unused for FP8)
  const float* chscale;   // FP32 scale of the result: NVFP4 global [1]; FP8 [1] or [N]
  const u16* x;           // activations fp16 [M, ldx], ldx = K padded to K_BLOCK, zero padded
  const u16* bias;        // fp16 [N] or null
  u16* y;                 // fp16 [M, N]
  int m, n, kblocks, ldx;
  int ksplit, tiles_per_block, m_chunks;
  int chscale_per_channel;
  int group_shift;        // INT4: log2(k-blocks per group record); the other families ignore it
};

template <class Atom, class Dec, int MT>
__device__ __forceinline__ void qpn_linear_body(const QpnArgs& a) {
  extern __shared__ float red[];  // [warps][MT * TOKENS][TILE_N]: partial tiles for split-K
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int chunk = blockIdx.x % a.m_chunks;
  const int nblock = blockIdx.x / a.m_chunks;
  const int tile_in_block = warp / a.ksplit;
  const int ks = warp % a.ksplit;
  const int tile = nblock * a.tiles_per_block + tile_in_block;
  const int n_tiles = (a.n + Atom::TILE_N - 1) / Atom::TILE_N;
  const int m0 = chunk * (MT * Atom::TOKENS);

  float acc[MT][Atom::ACC];
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int i = 0; i < Atom::ACC; ++i) acc[t][i] = 0.f;

  if (tile < n_tiles) {
    constexpr int LANE_BYTES = Dec::WORDS * 4;
    constexpr int BLOCK_BYTES = LANE_BYTES * 32;
    constexpr int PAIRS = Atom::STEPS / 2;           // activation loads per k-block per tile
    const u8* cptr = a.codes + (size_t)tile * a.kblocks * BLOCK_BYTES + lane * LANE_BYTES;
    const u8* sptr = a.scales + (size_t)tile * a.kblocks * Atom::SCALE_BLOCK_BYTES + Atom::scale_pair_offset(lane);
    // INT4 (Dec::GROUP_RECORDS): the lane's record of k-block kb is record lane of group
    // kb >> group_shift of its tile. Loaded with every k-block's codes, so the ring needs no
    // group bookkeeping; the k-blocks of one group re-read the same bytes (from L1).
    const u8* rbase = a.scales;
    if constexpr (Dec::GROUP_RECORDS) {
      const int groups_pad = (a.kblocks + (1 << a.group_shift) - 1) >> a.group_shift;
      rbase = a.scales + ((size_t)tile * groups_pad * 32 + lane) * Dec::REC_BYTES;
    }
    // Activation pointers of the lane's token rows at this warp's next k-block (a token past M
    // reads row 0: see AtomM8N8K4::load_x).
    const u16* xnext[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const int tok = m0 + t * Atom::TOKENS + Atom::b_token(lane);
      const u16* xrow = a.x + (size_t)(tok < a.m ? tok : 0) * a.ldx;
      xnext[t] = xrow + ks * Atom::K_BLOCK;
    }

    // Weights in flight: the codes and scales of the KBLOCKS_AHEAD k-blocks after the one being
    // decoded are already loading (a ring of registers, shifted down one stage per k-block). Issue
    // 14: the calibrated model put these kernels latency-bound on the V100 with nothing ahead.
    constexpr int AHEAD = MT == 1 ? Dec::KBLOCKS_AHEAD : Dec::KBLOCKS_AHEAD_MT2;
    u32 wq[AHEAD][Dec::WORDS];
    u32 spq[AHEAD];
    const u8* cnext = cptr + (size_t)ks * BLOCK_BYTES;
    const u8* snext = sptr + (size_t)ks * Atom::SCALE_BLOCK_BYTES;
#pragma unroll
    for (int d = 0; d < AHEAD; ++d) {
      spq[d] = 0u;
      if (ks + d * a.ksplit < a.kblocks) {
#pragma unroll
        for (int j = 0; j < Dec::WORDS; j += 4) ldg128(cnext + 4 * j, wq[d][j], wq[d][j + 1], wq[d][j + 2], wq[d][j + 3]);
        if constexpr (Dec::GROUPED) spq[d] = ldg16(snext);
        if constexpr (Dec::GROUP_RECORDS)
          spq[d] = Dec::record(rbase + (size_t)((ks + d * a.ksplit) >> a.group_shift) * (32 * Dec::REC_BYTES));
      }
      cnext += (size_t)a.ksplit * BLOCK_BYTES;
      snext += (size_t)a.ksplit * Atom::SCALE_BLOCK_BYTES;
    }
    for (int kb = ks; kb < a.kblocks; kb += a.ksplit) {
      u32 w[Dec::WORDS];
#pragma unroll
      for (int j = 0; j < Dec::WORDS; ++j) w[j] = wq[0][j];
      u32 sc2[2] = {0x3C003C00u, 0x3C003C00u};  // FP16 1.0 (FP8 has no group scale)
      if constexpr (Dec::GROUPED) {
        const u32 sp2 = Dec::scale_pair(spq[0]);   // (s0, s1); sc2[g] = (s_g, s_g), one PRMT each
        sc2[0] = prmt(sp2, 0u, 0x1010u);
        sc2[1] = prmt(sp2, 0u, 0x3232u);
      }
      u32 zb = 0u, sg = 0u;   // INT4: (1024 + zero) and the group scale, both halves
      if constexpr (Dec::GROUP_RECORDS) {
        zb = Dec::zero_bias(spq[0]);
        sg = Dec::scale2(spq[0]);
      }
#pragma unroll
      for (int d = 0; d + 1 < AHEAD; ++d) {
#pragma unroll
        for (int j = 0; j < Dec::WORDS; ++j) wq[d][j] = wq[d + 1][j];
        spq[d] = spq[d + 1];
      }
      if (kb + AHEAD * a.ksplit < a.kblocks) {
        u32(&last)[Dec::WORDS] = wq[AHEAD - 1];
#pragma unroll
        for (int j = 0; j < Dec::WORDS; j += 4) ldg128(cnext + 4 * j, last[j], last[j + 1], last[j + 2], last[j + 3]);
        if constexpr (Dec::GROUPED) spq[AHEAD - 1] = ldg16(snext);
        if constexpr (Dec::GROUP_RECORDS)
          spq[AHEAD - 1] =
              Dec::record(rbase + (size_t)((kb + AHEAD * a.ksplit) >> a.group_shift) * (32 * Dec::REC_BYTES));
      }
      cnext += (size_t)a.ksplit * BLOCK_BYTES;
      snext += (size_t)a.ksplit * Atom::SCALE_BLOCK_BYTES;
      const u16* xk[MT];
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        xk[t] = xnext[t];
        xnext[t] += a.ksplit * Atom::K_BLOCK;
      }
      // Unrolled (the word rotation and the loop control then cost nothing) except FP8 at MT = 2,
      // rolled on purpose there: one pair of MMAs per iteration keeps the live activation registers
      // at X_REGS per tile (unrolled, every load of the k-block is hoisted and it spills).
#pragma unroll((MT == 1 || Dec::WORDS == 4) ? PAIRS : 1)
      for (int p = 0; p < PAIRS; ++p) {
        u32 xr[MT][Atom::X_REGS];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          Atom::load_x(xk[t], xr[t]);
          xk[t] += 2 * Atom::K_STEP;
        }
        const u32 s = (2 * p * Atom::K_STEP < 16) ? sc2[0] : sc2[1];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          u32 a0 = Dec::front_half2(w, j * Atom::A_REGS);
          u32 a1 = Dec::front_half2(w, j * Atom::A_REGS + 1);
          if constexpr (Dec::GROUPED) {
            a0 = hmul2(a0, s);
            a1 = hmul2(a1, s);
          }
          if constexpr (Dec::GROUP_RECORDS) {
            a0 = Dec::apply(a0, zb, sg);
            a1 = Dec::apply(a1, zb, sg);
          }
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            u32 b0, b1;
            Atom::b_frag(xr[t], j, b0, b1);
            Atom::mma(acc[t], a0, a1, b0, b1);
          }
        }
        rotate_words<Dec::WORDS_PER_PAIR>(w);
      }
    }
  }

  // Epilogue: every warp parks its tile in shared memory as [token][row]; after the one barrier,
  // threads sum the ksplit partial tiles, apply the FP32 scale (NVFP4 global, FP8 per tensor or
  // per channel) and the bias, and round once to FP16.
  constexpr int TILE_ELEMS = Atom::TILE_N * MT * Atom::TOKENS;
  float* mine = red + warp * TILE_ELEMS;
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int i = 0; i < Atom::ACC; ++i)
      mine[(t * Atom::TOKENS + Atom::acc_token(lane, i)) * Atom::TILE_N + Atom::acc_row(lane, i)] = acc[t][i];
  __syncthreads();
  const int outs = a.tiles_per_block * TILE_ELEMS;
  for (int o = tid; o < outs; o += QPN_THREADS) {
    const int row = o % Atom::TILE_N;
    const int tok_l = (o / Atom::TILE_N) % (MT * Atom::TOKENS);
    const int tib = o / TILE_ELEMS;
    const int n = (nblock * a.tiles_per_block + tib) * Atom::TILE_N + row;
    const int tok = m0 + tok_l;
    if (n >= a.n || tok >= a.m) continue;
    float v = 0.f;
    for (int s = 0; s < a.ksplit; ++s) v += red[(tib * a.ksplit + s) * TILE_ELEMS + tok_l * Atom::TILE_N + row];
    v *= ldgf(a.chscale + (a.chscale_per_channel ? n : 0)) * Dec::OUT_MULT;
    if (a.bias) v += f16_to_f32(ldg16(a.bias + n));
    stg16(a.y + (size_t)tok * a.n + n, f32_to_f16(v));
  }
}

// Reconstruct pass: packed codes -> FP16 workspace ws[N_pad, K_pad] (row-major) holding
// e2m1 x e4m3(group scale) for NVFP4 or e4m3 for FP8; both are exact in FP16, so the GEMM that
// follows (FP32 accumulate, FP32 out) and the final per-tensor / per-channel scale lose nothing
// here. One thread per (tile, k-block, lane): 32 consecutive halves of one row, 4 x 16-byte stores.
template <class Atom, class Dec>
__device__ __forceinline__ void qpn_reconstruct_body(const u8* codes, const u8* scales, u16* ws,
                                                     int n_tiles, int kblocks, int group_shift) {
  const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = (int)(gid & 31);
  const long long tb = gid >> 5;
  if (tb >= (long long)n_tiles * kblocks) return;
  const int tile = (int)(tb / kblocks), kb = (int)(tb % kblocks);
  constexpr int LANE_BYTES = Dec::WORDS * 4;
  u32 w[Dec::WORDS];
  const u8* p = codes + ((size_t)tile * kblocks + kb) * (LANE_BYTES * 32) + lane * LANE_BYTES;
#pragma unroll
  for (int j = 0; j < Dec::WORDS; j += 4) ldg128(p + 4 * j, w[j], w[j + 1], w[j + 2], w[j + 3]);
  u32 sc2[2] = {0x3C003C00u, 0x3C003C00u};
  if constexpr (Dec::GROUPED) {
    const u32 sp2 = Dec::scale_pair(ldg16(scales + ((size_t)tile * kblocks + kb) * Atom::SCALE_BLOCK_BYTES +
                                          Atom::scale_pair_offset(lane)));
    sc2[0] = prmt(sp2, 0u, 0x1010u);
    sc2[1] = prmt(sp2, 0u, 0x3232u);
  }
  u32 zb = 0u, sg = 0u;
  if constexpr (Dec::GROUP_RECORDS) {
    const int groups_pad = (kblocks + (1 << group_shift) - 1) >> group_shift;
    const u32 rec =
        Dec::record(scales + (((size_t)tile * groups_pad + (kb >> group_shift)) * 32 + lane) * Dec::REC_BYTES);
    zb = Dec::zero_bias(rec);
    sg = Dec::scale2(rec);
  }
  const size_t ldw = (size_t)kblocks * Atom::K_BLOCK;
  u16* out = ws + ((size_t)tile * Atom::TILE_N + Atom::a_row(lane)) * ldw + (size_t)kb * Atom::K_BLOCK;
  u32 h[Atom::K_BLOCK / 2];
#pragma unroll
  for (int idx = 0; idx < Atom::K_BLOCK / 2; ++idx) {
    h[idx] = Dec::half2(w, idx);
    if constexpr (Dec::GROUPED) h[idx] = hmul2(h[idx], sc2[idx / 8]);
    if constexpr (Dec::GROUP_RECORDS) h[idx] = Dec::apply(h[idx], zb, sg);
  }
#pragma unroll
  for (int j = 0; j < Atom::K_BLOCK / 2; j += 4) stg128(out + 2 * j, h[j], h[j + 1], h[j + 2], h[j + 3]);
}

#define QPN_LINEAR_ENTRY(NAME, ATOM, DEC, MT)                                              \
  extern "C" __global__ void __launch_bounds__(QPN_THREADS, 4) NAME(QpnArgs a) {          \
    qpn_linear_body<ATOM, DEC, MT>(a);                                                      \
  }

#define QPN_RECONSTRUCT_ENTRY(NAME, ATOM, DEC)                                              \
  extern "C" __global__ void __launch_bounds__(QPN_THREADS) NAME(                           \
      const u8* codes, const u8* scales, u16* ws, int n_tiles, int kblocks, int group_shift) { \
    qpn_reconstruct_body<ATOM, DEC>(codes, scales, ws, n_tiles, kblocks, group_shift);      \
  }

// Entry points: one QPN_LINEAR_ENTRY per (format member, decoder form, token tiles per weight pass)
// and one QPN_RECONSTRUCT_ENTRY per member, written from each format's registered data
// (kernels/formats.py, WeightFormat.m8n8k4_kernels) and appended to this file by kernels/jit.py
// (kernel_sources) before NVRTC compiles it: a new format adds its decoder to qpn_family.cuh and
// nothing here. Route -> entry point lives in ops.py.
