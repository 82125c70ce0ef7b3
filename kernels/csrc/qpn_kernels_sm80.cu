// QPN kernels on the sm_80+ atom (m16n8k16): packed NVFP4 (qpn2*), FP8 (qpn8*) and INT4 W4A16 (qpn4*) linear layers,
// y[M, N] = x[M, K] * W[N, K]^T, weights streamed in their packed form and decoded in registers
// straight into MMA operands. Same formats, prepack rules, decoders and routes as the SM70 family
// (qpn_kernels.cu); what differs is the atom and the way the grid covers the work.
//
// Work split ("stream-K"): the work is a list of items, one item = (group of T weight tiles of 16
// rows, one k-block of 64 inputs), ordered with K fastest. The grid launches exactly as many warps
// as the GPU holds at once (or fewer for small layers), and each warp takes one contiguous run of
// items, so every warp streams the same number of bytes (+-1 item) whatever N and K are: no tail
// wave, and small-N layers are split along K automatically. A warp's run covers whole weight
// groups (results written directly) and at most two partial ones (its first and its last). A
// partial group's FP32 sums go to a scratch slot; the contributor that arrives last (an atomic
// counter per group) adds all partials in warp order -- a fixed order, so results are the same
// bit for bit on every run -- applies the scales and bias, writes FP16 and resets the counter to
// zero for the next launch. No shared memory, no barrier, no second kernel.
//
// Main loop per warp: a D-deep ring of 16-byte weight loads (L1 bypassed) and a DX-deep ring of
// activation loads, consumed and refilled in place, fully unrolled so every register index is a
// compile-time constant; and, PF k-blocks beyond the ring, an L2 prefetch of the weight blocks the
// ring will load next, so the bytes in flight are not limited by registers.
//
// Compiles standalone under NVRTC with no headers (see qpn_ptx.cuh). sm_80 or later.
#include "qpn_atom_m16n8k16.cuh"

#define QPN80_THREADS 256
#define QPN80_WARPS (QPN80_THREADS / 32)

struct Qpn80Args {
  const u8* codes;        // packed codes, m16n8k16 fragment order
  const u8* scales;       // NVFP4 packed e4m3 group scales / INT4 group records (unused for FP8)
  const float* chscale;   // FP32 scale of the result: NVFP4 global [1]; FP8 [1] or [N]
  const u16* x;           // activations fp16 [M, ldx], ldx = K padded to 64, zero padded
  const u16* bias;        // fp16 [N] or null
  u16* y;                 // fp16 [M, N]
  float* partials;        // [chunks][nwarps][2 slots][32 lanes][T * MT * 4] FP32 partial sums
  int* counters;          // [chunks][n_groups] arrival counters, zero between launches
  int m, n, kblocks, ldx;
  int n_groups;           // ceil(ceil(N / 16) / T)
  int nwarps;             // warps per chunk plane (<= n_groups * kblocks)
  int chunks;             // 16-row token chunks (the *_chunked route); 1 otherwise
  int chscale_per_channel;
  int group_shift;        // INT4: log2(group size / 16) (Frag16INT4Form); 0 and unread otherwise
};

// VAR: 0 the kernel; measured variants that drop one stage (results are NOT the product):
// 1 no decode (raw code words, masked finite, as operands), 2 no MMA (decode only),
// 3 loads only (weights, scales, activations; nothing computed), 4 loads only and no split-K
// finish (partial groups stored as if whole: no counter, no reduction), 5 empty (every warp
// returns at once: launch and graph cost alone), 6 the kernel without the split-K finish;
// 7 the kernel WITH the programmatic-dependent-launch hooks below (same results, bit for bit);
// 8 the kernel whose split-K finish always reads whole partials (no thin finish; same results);
// 9 (INT4 fold kernels) the refill loads issued after the group fold instead of before it (same results).
//
// Programmatic dependent launch (sm_90), VAR 7 (the *_pdl kernels): the kernel signals
// griddepcontrol.launch_dependents at its start, so the next kernel of the stream, when launched
// with the PDL attribute, may start on an SM as soon as this one's blocks leave it; and it waits
// (griddepcontrol.wait) for the previous kernel to complete before it reads anything a kernel may
// have written (x, the split-K partials and counters, y). Before that wait it only reads the
// weight: its chscale and the first k-blocks of its weight ring (register kernels: the first
// segment's codes and scales; ring kernels with the activations out of the ring: the first S - 1
// copies), so the ring fill overlaps the previous kernel's tail. Launched without the attribute,
// the wait returns at once (the hooks then cost 0 to 1 us per call on the H200,
// results/kernel_sm80_pdl_notes_h200_20261201.md; with the attribute, up to 2.4 us faster). The
// library launches the *_pdl form of its mt1 route kernels with the attribute on sm_90+
// (sm80_plan._pdl_form, sm80_plan.launch_raw_pdl); the other kernels keep plain launches.
QPN_DEV void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
QPN_DEV void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Deepest register ring whose split-K finish reads four partials at a time without spilling
// (see Qpn80::finish): sm_90 has the registers for D = 4, sm_80-89 only for D = 2.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define QPN80_WIDE_FINISH_D 4
#else
#define QPN80_WIDE_FINISH_D 2
#endif

template <class F, int MT, int T, int D, int PF, int VAR, int MINB = 2>
struct Qpn80 {
  using A = AtomM16N8K16;
  static constexpr int DX = D >= 2 ? 2 : 1;
  // Depth of the NVFP4 scale ring (8 bytes per lane per tile and k-block). The sm_80 path decodes
  // scales with more integer temporaries than sm_89+'s cvt, so there the scales run 2 k-blocks
  // ahead instead of D (keeps every configuration within 128 registers without spills).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  static constexpr int DS = (D % 2 == 0) ? 2 : D;
#else
  static constexpr int DS = D;
#endif
  static constexpr int LANE_BYTES = F::WORDS * 4;
  static constexpr int BLOCK_BYTES = LANE_BYTES * 32;
  static constexpr int PER_LANE = T * MT * 4;
  static constexpr bool LOADS_ONLY = VAR == 3 || VAR == 4;
  static constexpr bool SINK = VAR == 2 || LOADS_ONLY;
  static constexpr bool NO_FINISH = VAR == 4 || VAR == 6;
  static constexpr bool EMPTY = VAR == 5;
  static constexpr bool PDL = VAR == 7;
  static constexpr bool WIDE_PARTIAL = T * MT > 4;   // see finish
  // Group scales applied to FP32 sums (Frag16INT4FoldForm); weights with smaller groups than the
  // decoder folds run its Plain form (same kernel, chosen per launch by Qpn80Args.group_shift).
  static constexpr bool FOLD = FoldsGroups<F>::value && !LOADS_ONLY && VAR != 1 && VAR != 2;

  QPN_DEV static void load_w(const u8* const (&cp)[T], int kb, u32 (&w)[T][F::WORDS]) {
#pragma unroll
    for (int j = 0; j < T; ++j) {
#pragma unroll
      for (int q = 0; q < F::WORDS; q += 4)
        ldg128_stream(cp[j] + (size_t)kb * BLOCK_BYTES + 4 * q, w[j][q], w[j][q + 1], w[j][q + 2], w[j][q + 3]);
    }
  }
  // gs: Qpn80Args.group_shift, read only by a decoder whose scales are group records (INT4).
  QPN_DEV static void load_sc(const u8* const (&sp)[T], int kb, u32 (&sc)[T][2], int gs = 0) {
#pragma unroll
    for (int j = 0; j < T; ++j) {
      if constexpr (F::RECORDS) F::load_scales(sp[j] + F::record_step(kb, gs), sc[j]);
      else if constexpr (F::GROUPED) F::load_scales(sp[j] + (size_t)kb * A::SCALE_BLOCK_BYTES, sc[j]);
    }
  }

  // The lane's activation row of each token tile starting at token m0 (a row past M reads row 0
  // and is masked: xv false, loaded as zeros).
  QPN_DEV static void x_rows(const Qpn80Args& a, int m0, int lane, const u16* (&xp)[MT], bool (&xv)[MT]) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const int tok = m0 + t * A::TOKENS + A::b_token(lane);
      xv[t] = tok < a.m;
      xp[t] = a.x + (size_t)(xv[t] ? tok : 0) * a.ldx + F::x_offset(lane);
    }
  }

  QPN_DEV static void load_x(const u16* const (&xp)[MT], const bool (&xv)[MT], int kb, u32 (&xr)[MT][8]) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if (xv[t]) {
        F::load_x(xp[t] + (size_t)kb * A::K_BLOCK, xr[t]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) xr[t][i] = 0u;
      }
    }
  }

  QPN_DEV static void compute(const u32 (&w)[T][F::WORDS], const u32 (&sc)[T][2], const u32 (&xr)[MT][8],
                              float (&acc)[T][MT][4], u32& sink) {
#pragma unroll
    for (int j = 0; j < T; ++j) {
      if constexpr (LOADS_ONLY) {
#pragma unroll
        for (int q = 0; q < F::WORDS; ++q) sink ^= w[j][q];
        if constexpr (F::GROUPED) sink ^= sc[j][0] ^ sc[j][1];
#pragma unroll
        for (int t = 0; t < MT; ++t) sink ^= xr[t][0] ^ xr[t][7];
        continue;
      }
#pragma unroll
      for (int s = 0; s < A::STEPS; ++s) {
        u32 a0, a1, a2, a3;
        if constexpr (VAR == 1) {
          a0 = w[j][s] & 0x3BFF3BFFu;
          a1 = w[j][(s + 1) % F::WORDS] & 0x3BFF3BFFu;
          a2 = w[j][(s + 2) % F::WORDS] & 0x3BFF3BFFu;
          a3 = w[j][(s + 3) % F::WORDS] & 0x3BFF3BFFu;
        } else {
          F::frag(w[j], s, sc[j], a0, a1, a2, a3);
        }
        if constexpr (VAR == 2) {
          sink ^= a0 ^ a1 ^ a2 ^ a3;
        } else {
#pragma unroll
          for (int t = 0; t < MT; ++t) A::mma(acc[j][t], a0, a1, a2, a3, xr[t][2 * s], xr[t][2 * s + 1]);
        }
      }
    }
  }

  // The lane's code and scale pointers of the T tiles of weight group grp, at k-block 0. A group may
  // run past the last tile: it re-reads the last tile (those sums are never stored).
  QPN_DEV static void pointers(const Qpn80Args& a, int grp, int n_tiles, int lane, const u8* (&cp)[T],
                               const u8* (&sp)[T]) {
#pragma unroll
    for (int j = 0; j < T; ++j) {
      const int tile = min(grp * T + j, n_tiles - 1);
      cp[j] = a.codes + (size_t)tile * a.kblocks * BLOCK_BYTES + lane * LANE_BYTES;
      if constexpr (F::RECORDS) sp[j] = F::tile_records(a.scales, tile, a.kblocks, lane, a.group_shift);
      else sp[j] = a.scales + (size_t)tile * a.kblocks * A::SCALE_BLOCK_BYTES + F::scale_offset(lane);
    }
  }

  // After k-block k (ring slot d) is consumed: its slots' loads of the k-blocks D, DS and DX ahead.
  QPN_DEV static void refill(const Qpn80Args& a, const u8* const (&cp)[T], const u8* const (&sp)[T],
                             const u16* const (&xp)[MT], const bool (&xv)[MT], int k, int kb1, int d,
                             u32 (&w)[D][T][F::WORDS], u32 (&sc)[DS][T][2], u32 (&xr)[DX][MT][8]) {
    if (k + D < kb1) load_w(cp, k + D, w[d]);
    if (k + DS < kb1) load_sc(sp, k + DS, sc[d % DS], a.group_shift);
    if (k + DX < kb1) load_x(xp, xv, k + DX, xr[d % DX]);
  }

  // k-blocks [kb0, kb1) of weight group grp into acc.
  QPN_DEV static void segment(const Qpn80Args& a, int grp, int kb0, int kb1, const u16* const (&xp)[MT],
                              const bool (&xv)[MT], int lane, float (&acc)[T][MT][4], bool first) {
    const u8* cp[T];
    const u8* sp[T];
    pointers(a, grp, (a.n + A::TILE_N - 1) / A::TILE_N, lane, cp, sp);
    u32 w[D][T][F::WORDS];
    u32 sc[DS][T][2];
    u32 xr[DX][MT][8];
    u32 sink = 0u;
    // FOLD: this group's sums, scaled into acc after its last k-block (or the segment's last)
    float accg[T][MT][4];
    int fold_mask = 0;   // k-blocks per scale group - 1
    if constexpr (FOLD) {
      zero(accg);
      fold_mask = (1 << (a.group_shift - F::MIN_FOLD_SHIFT)) - 1;
    }
#pragma unroll
    for (int d = 0; d < D; ++d)
      if (kb0 + d < kb1) load_w(cp, kb0 + d, w[d]);
#pragma unroll
    for (int d = 0; d < DS; ++d)
      if (kb0 + d < kb1) load_sc(sp, kb0 + d, sc[d], a.group_shift);
    if constexpr (PDL) {
      if (first) pdl_wait();   // the weight ring is in flight; x comes from the previous kernel
    }
#pragma unroll
    for (int d = 0; d < DX; ++d)
      if (kb0 + d < kb1) load_x(xp, xv, kb0 + d, xr[d]);
    if constexpr (PF > 0) {
      for (int k = kb0 + D; k < kb0 + D + PF && k < kb1; ++k)
#pragma unroll
        for (int j = 0; j < T; ++j) prefetch_l2(cp[j] + (size_t)k * BLOCK_BYTES);
    }
    for (int kb = kb0; kb < kb1; kb += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
        const int k = kb + d;
        if (k < kb1) {
          if constexpr (PF > 0) {
            if (k + D + PF < kb1) {
#pragma unroll
              for (int j = 0; j < T; ++j) prefetch_l2(cp[j] + (size_t)(k + D + PF) * BLOCK_BYTES);
            }
          }
          if constexpr (FOLD) {
            // The refill loads go out before the fold: the fold waits for this k-block's MMAs to
            // complete, and loads issued after it would wait with it (ring slots refilled late).
            // The fold's records are kept first, since the record refill overwrites their slot.
            compute(w[d], sc[d % DS], xr[d % DX], accg, sink);
            const bool fold_now = ((k + 1) & fold_mask) == 0 || k + 1 == kb1;
            u32 fsc[T][2];
#pragma unroll
            for (int j = 0; j < T; ++j) fsc[j][0] = sc[d % DS][j][0], fsc[j][1] = sc[d % DS][j][1];
            if constexpr (VAR == 9) {   // the order before: fold, then refill
              if (fold_now) F::fold(fsc, accg, acc);
              refill(a, cp, sp, xp, xv, k, kb1, d, w, sc, xr);
            } else {
              refill(a, cp, sp, xp, xv, k, kb1, d, w, sc, xr);
              if (fold_now) F::fold(fsc, accg, acc);
            }
          } else {
            compute(w[d], sc[d % DS], xr[d % DX], acc, sink);
            refill(a, cp, sp, xp, xv, k, kb1, d, w, sc, xr);
          }
        }
      }
    }
    if constexpr (SINK) acc[0][0][0] += __uint_as_float(sink & 0x007FFFFFu);
  }

  // cs_tensor: the per-tensor result scale times OUT_MULT (a power of two: exact), loaded once
  // before any main loop, so a per-tensor layer's epilogue does not wait on memory; per-channel
  // scales and the bias (both rare on the QPN path) are read in the epilogue.
  // Rows of the T tiles of group grp (in a Qpn80Band block: the warp's own T tiles, group 8 g + w).
  QPN_DEV static void store(const Qpn80Args& a, int grp, int m0, int lane, const float (&v)[T][MT][4],
                            float cs_tensor) {
#pragma unroll
    for (int j = 0; j < T; ++j)
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          store_one(a, (grp * T + j) * A::TILE_N + A::acc_row(lane, i), m0 + t * A::TOKENS + A::acc_token(lane, i),
                    v[j][t][i], cs_tensor);
  }
  QPN_DEV static void store_one(const Qpn80Args& a, int row, int tok, float v, float cs_tensor) {
    if (row < a.n && tok < a.m) {  // one rounding of the FP32 sum, then the bias, as before
      const float cs = a.chscale_per_channel ? ldgf(a.chscale + row) * F::OUT_MULT : cs_tensor;
      float r = v * cs;
      if (a.bias) r += f16_to_f32(ldg16(a.bias + row));
      stg16(a.y + (size_t)tok * a.n + row, f32_to_f16(r));
    }
  }

  // Balanced runs in 32-bit arithmetic: items = q * nwarps + r; warps 0..r-1 take q+1 items.
  // (Every run is non-empty: the host keeps nwarps <= items < 2^31.)
  QPN_DEV static int run_start(int i, int q, int r) { return i * q + min(i, r); }
  QPN_DEV static int warp_of(int x, int q, int r) {
    const int b = r * (q + 1);
    return x < b ? x / (q + 1) : r + (x - b) / q;
  }

  // Run ``unit`` of the stream-K partition (Qpn80Args.nwarps runs: warps, or blocks for Qpn80Coop):
  // items [lo, hi), and the q, r of items = q * runs + r that warp_of needs.
  QPN_DEV static void run_of(const Qpn80Args& a, int unit, int& q, int& r, int& lo, int& hi) {
    const int items = a.n_groups * a.kblocks;
    q = items / a.nwarps;
    r = items % a.nwarps;
    lo = run_start(unit, q, r);
    hi = run_start(unit + 1, q, r);
  }

  // The per-tensor result scale times OUT_MULT, read once before any main loop (0 for a
  // per-channel scale, which store reads in the epilogue).
  QPN_DEV static float result_scale(const Qpn80Args& a) {
    return a.chscale_per_channel ? 0.f : ldgf(a.chscale) * F::OUT_MULT;
  }

  QPN_DEV static float* slot_ptr(const Qpn80Args& a, int plane, int warp, int slot, int lane) {
    return a.partials + ((((size_t)plane * a.nwarps + warp) * 2 + slot) * 32 + lane) * PER_LANE;
  }

  QPN_DEV static void run(const Qpn80Args& a) {
    if constexpr (FoldsGroups<F>::value) {
      if (a.group_shift < F::MIN_FOLD_SHIFT) {
        Qpn80<typename F::Plain, MT, T, D, PF, VAR, MINB>::run(a);
        return;
      }
    }
    const int lane = threadIdx.x & 31;
    const int plane = blockIdx.x % a.chunks;
    const int gw = (blockIdx.x / a.chunks) * QPN80_WARPS + (threadIdx.x >> 5);
    if (gw >= a.nwarps) return;
    if constexpr (EMPTY) return;
    if constexpr (PDL) pdl_launch_dependents();
    const float cs_tensor = result_scale(a);
    int q, r, lo, hi;
    run_of(a, gw, q, r, lo, hi);
    const int m0 = plane * MT * A::TOKENS;
    const u16* xp[MT];
    bool xv[MT];
    x_rows(a, m0, lane, xp, xv);
    const int first_grp = lo / a.kblocks;
    for (int item = lo; item < hi;) {
      const int grp = item / a.kblocks;
      const int gbase = grp * a.kblocks;
      const int kb0 = item - gbase;
      const int kb1 = min(hi, gbase + a.kblocks) - gbase;
      item = gbase + kb1;
      float acc[T][MT][4];
      zero(acc);
      segment(a, grp, kb0, kb1, xp, xv, lane, acc, gbase + kb0 == lo);
      finish(a, grp, kb0, kb1, first_grp, gw, q, r, plane, m0, lane, acc, cs_tensor, grp);
    }
  }

  QPN_DEV static void zero(float (&acc)[T][MT][4]) {
#pragma unroll
    for (int j = 0; j < T; ++j)
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][t][i] = 0.f;
  }

  // Partials read per batch by the last contributor (RB, per lane: T x MT accumulators of 4) and by
  // the thin finish (THIN_B, one float each). RB: four at a time in the register-ring kernels without
  // L2 prefetch (D > 1, PF = 0) whose partial is at most two 16x8 accumulators (T * MT <= 2) -- the
  // small-layer routes: their finish (about 13 contributors per group on the TP1 / TP4 down and
  // out_proj shapes) then waits on 4 round trips instead of 7. Elsewhere RB = 4 spills (ptxas 12.9:
  // on sm_90 the ring kernels with their tighter register caps, the PF > 0 kernels and T * MT = 4;
  // on sm_80-89 also the D = 4 kernels, hence QPN80_WIDE_FINISH_D); RB = 8 spills everywhere.
  static constexpr int RB = (MINB <= 2 && D > 1 && D <= QPN80_WIDE_FINISH_D && PF == 0 && T * MT <= 2) ? 4 : 2;
  static constexpr int THIN_B = 16;
  // Where the thin finish compiles in without spills (ptxas 12.9, sm_80 and sm_90): the register
  // ring 2 deep without L2 prefetch, partials of at most two accumulators, 128 registers. (The
  // four-tile, D = 4 and shared-ring kernels, whose bases are D = 1 with tighter caps, spill 4-12
  // bytes with it.)
  static constexpr bool THIN = VAR != 8 && MINB <= 2 && T * MT <= 2 && D == 2 && PF == 0;
  static constexpr int GROUP_ROWS = T * A::TILE_N;
  static constexpr int ROWS_PER_LANE = (GROUP_ROWS + 31) / 32;

  // The thin finish: with few tokens most of a partial's accumulators hold rows of tokens past M
  // (at M = 1, 1 of 8). Then each contributor parks only its sums of real tokens, token-major
  // ([token][group row], lane 0's slot start), and the last one reads them a row per lane, THIN_B
  // contributors per batch: (tokens x rows per lane) batches of one round trip each, against
  // contributors / RB batches for the full partials. Taken where that is no more round trips
  // (every contributor decides the same from the launch's M and the group's contributor count).
  // The sums are added in the same order, fw..lw: the results are the same bits either way.
  QPN_DEV static bool thin_finish(int tokens, int contributors) {
    return THIN && tokens * ROWS_PER_LANE * ((contributors + THIN_B - 1) / THIN_B) <=
                                (contributors + RB - 1) / RB;
  }

  // The end of one segment (k-blocks [kb0, kb1) of group grp) of warp gw's run: a whole group is
  // stored directly; a partial one is parked (park), its arrival counted, and the last contributor
  // to arrive finishes it (reduce). The result goes to the rows of group out_grp (grp itself,
  // except in the M-band kernel).
  QPN_DEV static void finish(const Qpn80Args& a, int grp, int kb0, int kb1, int first_grp, int gw, int q, int r,
                             int plane, int m0, int lane, const float (&acc)[T][MT][4], float cs_tensor,
                             int out_grp) {
    if (NO_FINISH || (kb0 == 0 && kb1 == a.kblocks)) {
      store(a, out_grp, m0, lane, acc, cs_tensor);
      return;
    }
    // the group's first and last contributing warps (stream-K runs are contiguous)
    const int fw = warp_of(grp * a.kblocks, q, r);
    const int lw = warp_of(grp * a.kblocks + a.kblocks - 1, q, r);
    const int tokens = min(a.m - m0, MT * A::TOKENS);
    const bool thin = thin_finish(tokens, lw - fw + 1);
    park(a, plane, gw, grp == first_grp ? 0 : 1, lane, tokens, thin, acc);
    __threadfence();
    __syncwarp();
    int* ctr = a.counters + (size_t)plane * a.n_groups + grp;
    int old = 0;
    if (lane == 0) old = atomicAdd(ctr, 1);
    old = __shfl_sync(0xffffffffu, old, 0);
    if (old == lw - fw) reduce(a, grp, gw, q, r, fw, lw, plane, m0, tokens, thin, ctr, lane, acc, cs_tensor, out_grp);
  }

  // A partial group's sums into warp gw's slot (0: its run's first group, 1: its last): thin
  // (the real tokens' sums, token-major from lane 0's slot start) or whole.
  QPN_DEV static void park(const Qpn80Args& a, int plane, int gw, int slot, int lane, int tokens, bool thin,
                           const float (&acc)[T][MT][4]) {
    if (thin) {
      float* mine = slot_ptr(a, plane, gw, slot, 0);
#pragma unroll
      for (int j = 0; j < T; ++j)
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int tok = t * A::TOKENS + A::acc_token(lane, i);
            if (tok < tokens) stgf(mine + tok * GROUP_ROWS + j * A::TILE_N + A::acc_row(lane, i), acc[j][t][i]);
          }
    } else {
      float* mine = slot_ptr(a, plane, gw, slot, lane);
#pragma unroll
      for (int j = 0; j < T; ++j)
#pragma unroll
        for (int t = 0; t < MT; ++t)
          stg128f(mine + (j * MT + t) * 4, acc[j][t][0], acc[j][t][1], acc[j][t][2], acc[j][t][3]);
    }
  }

  // The last contributor (of fw..lw) of partial group grp: add every contributor's parked sums in
  // warp order (its own from acc), store the group, reset its counter ctr.
  QPN_DEV static void reduce(const Qpn80Args& a, int grp, int gw, int q, int r, int fw, int lw, int plane, int m0,
                             int tokens, bool thin, int* ctr, int lane, const float (&acc)[T][MT][4],
                             float cs_tensor, int out_grp) {
    __threadfence();
    const int gbase = grp * a.kblocks;
    if (thin) {
      // fw's run may start in an earlier group (grp is then its second slot); the others' start in
      // grp. One base address per batch: consecutive warps' slots are a constant stride apart.
      constexpr int SLOT = 32 * PER_LANE, WARP_STRIDE = 2 * SLOT;
      const int first_off = run_start(fw, q, r) < gbase ? SLOT : 0;
      for (int p = 0; p < tokens * ROWS_PER_LANE; ++p) {
        const int tok = p / ROWS_PER_LANE, row = lane + 32 * (p - tok * ROWS_PER_LANE);
        if (row >= GROUP_ROWS) continue;   // T = 1: 16 rows, lanes 16-31 idle
        float s = 0.f;
        for (int w0 = fw; w0 <= lw; w0 += THIN_B) {
          const float* base = slot_ptr(a, plane, w0, 0, 0) + tok * GROUP_ROWS + row;
          // Every load unconditional (past lw: lw's again, not added), so no branch separates them
          // and the batch is one round trip; a load under its own branch was waited on by its add
          // before the next was issued (measured: one round trip per contributor).
          float v[THIN_B];
#pragma unroll
          for (int b = 0; b < THIN_B; ++b)
            v[b] = ldcgf(base + min(b, lw - w0) * WARP_STRIDE + (b == 0 && w0 == fw ? first_off : 0));
#pragma unroll
          for (int b = 0; b < THIN_B; ++b) s = w0 + b <= lw ? s + v[b] : s;
        }
        store_one(a, out_grp * GROUP_ROWS + row, m0 + tok, s, cs_tensor);
      }
      if (lane == 0) atomicExch(ctr, 0);
      return;
    }
    float sum[T][MT][4];
    zero(sum);
    // Fixed order fw..lw: deterministic sums. The partials are read RB warps at a time (all loads
    // of a batch in flight before the first add), so a group split over many warps (small layers)
    // does not pay one L2 round trip per contributor; the order of the additions is unchanged.
    if constexpr (WIDE_PARTIAL) {
      // Partials of more than four 16x8 accumulators (the M-band kernels, Qpn80Band): one at a
      // time, the warp's own re-read from its slot too, so acc is dead by then (else MT = 8 spills).
      for (int wi = fw; wi <= lw; ++wi) {
        const float* p = slot_ptr(a, plane, wi, run_start(wi, q, r) / a.kblocks == grp ? 0 : 1, lane);
#pragma unroll
        for (int j = 0; j < T; ++j)
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            float v[4];
            ldcg128f(p + (j * MT + t) * 4, v[0], v[1], v[2], v[3]);
#pragma unroll
            for (int i = 0; i < 4; ++i) sum[j][t][i] += v[i];
          }
      }
    } else {
      for (int w0 = fw; w0 <= lw; w0 += RB) {
        float v[RB][T][MT][4];
#pragma unroll
        for (int b = 0; b < RB; ++b) {
          const int wi = w0 + b;
          if (wi <= lw && wi != gw) {
            const float* p = slot_ptr(a, plane, wi, run_start(wi, q, r) / a.kblocks == grp ? 0 : 1, lane);
#pragma unroll
            for (int j = 0; j < T; ++j)
#pragma unroll
              for (int t = 0; t < MT; ++t)
                ldcg128f(p + (j * MT + t) * 4, v[b][j][t][0], v[b][j][t][1], v[b][j][t][2], v[b][j][t][3]);
          } else {
#pragma unroll
            for (int j = 0; j < T; ++j)
#pragma unroll
              for (int t = 0; t < MT; ++t)
#pragma unroll
                for (int i = 0; i < 4; ++i) v[b][j][t][i] = acc[j][t][i];
          }
        }
#pragma unroll
        for (int b = 0; b < RB; ++b) {
          if (w0 + b <= lw) {
#pragma unroll
            for (int j = 0; j < T; ++j)
#pragma unroll
              for (int t = 0; t < MT; ++t)
#pragma unroll
                for (int i = 0; i < 4; ++i) sum[j][t][i] += v[b][j][t][i];
          }
        }
      }
    }
    if (lane == 0) atomicExch(ctr, 0);
    store(a, out_grp, m0, lane, sum, cs_tensor);
  }
};

// The shared-memory ring (issue 14): the same work split, reduction and fragment decoders as
// Qpn80, but every operand of a k-block (the T tiles' codes, their NVFP4 scales and the MT token
// tiles' activations) is copied global -> shared by cp.async (no registers held while in flight),
// S k-blocks deep per warp. Each warp owns its S slots, so no block-wide barrier: a
// cp.async.wait_group and a __syncwarp make a slot's bytes visible to the warp. The ring runs over
// the warp's whole run of items, across group boundaries, so a warp never drains and refills it
// between the groups of its run (the finish of a group overlaps the copies of the next).
// Registers hold only the current k-block's operands, the decode and the accumulators.
//
// Slot layout (bytes; every copy is 16 B; reads are conflict-free):
//   codes   [T][chunk_pos(u)][16 B]  u: the tile-block's 16-byte chunks in global order; lane l
//                                   decodes chunks H l .. H l + H - 1 (see chunk_pos)
//   scales  [T][64 B]               NVFP4 only, as packed (lane l reads 8 B at 8 * (l >> 2))
//   x       [MT][1024 B]            NVFP4: [step s][token g][16 B pair p] (lane (g, t) reads 8 B at
//                                   256 s + 32 g + 8 t); FP8: [h][lane][16 B] (lane reads 2 x 16 B)
// Rows past M are zero-filled by the copy itself (src-size 0).
// XG = 1: the activations stay out of the ring: read from global memory through L1 (where the
// warps of an SM that work on the same k-range share them) one k-block ahead, into registers.
// The H200 sweep of the first ring showed the activation copies through L2 (1 KB per token tile
// and k-block, as many bytes as two weight tiles) costing more at M = 8 than at M = 1.
template <class F, int MT, int T, int S, int XG, int VAR>
struct Qpn80Ring : Qpn80<F, MT, T, 1, 0, VAR> {
  static_assert(!F::RECORDS, "group-record decoders (INT4) run on the register ring Qpn80 only");
  using B = Qpn80<F, MT, T, 1, 0, VAR>;
  using A = AtomM16N8K16;
  static constexpr int LANE_BYTES = F::WORDS * 4;
  static constexpr int H = LANE_BYTES / 16;
  static constexpr int W_BYTES = LANE_BYTES * 32;
  static constexpr int SC_BYTES = F::GROUPED ? A::SCALE_BLOCK_BYTES : 0;
  static constexpr int X_BYTES = A::TOKENS * A::K_BLOCK * 2;
  static constexpr int SC_OFF = T * W_BYTES;
  static constexpr int X_OFF = SC_OFF + T * SC_BYTES;
  static constexpr int STAGE = X_OFF + (XG ? 0 : MT * X_BYTES);
  static_assert(STAGE % 16 == 0, "slots must stay 16-byte aligned");
  static_assert(H == 1 || H == 2, "chunk_pos is laid out for one or two 16-byte chunks per lane");

  // Shared-memory position (16-byte units) of a tile-block's chunk u. NVFP4 (H = 1): u itself.
  // FP8 (H = 2): lane l decodes chunks 2l and 2l+1; u ^ ((u >> 3) & 1) keeps each copy
  // instruction's 32 chunks (u = lane + 32 h) in one contiguous 512-byte range, and puts every
  // 8-lane phase on 8 distinct 16-byte bank groups for the copies and for the reads
  // (u = 2 lane + h) alike. The layout it replaces ([h][lane][16 B]) put consecutive lanes'
  // copies 512 bytes apart (2-way conflicts on the shared-memory side), and on the H200 the
  // FP8 ring's copies then reached the L2 as one request per 16 bytes (run 5's counters).
  QPN_DEV static constexpr int chunk_pos(int u) { return H == 1 ? u : (u ^ ((u >> 3) & 1)); }

  // Activations of one token tile and k-block in a slot: where the 16-byte copy of token g's inputs
  // 8 qc .. 8 qc + 7 goes, and lane's read u of XU (XR registers: NVFP4 MMA step u, FP8 steps 2u, 2u+1).
  static constexpr int XU = F::GROUPED ? 4 : 2;
  static constexpr int XR = 8 / XU;
  QPN_DEV static u32 x_copy_pos(int g, int qc) {
    return F::GROUPED ? 256 * (qc >> 1) + 32 * g + 16 * (qc & 1) : 512 * (qc & 1) + 16 * (4 * g + (qc >> 1));
  }
  QPN_DEV static void read_x(u32 xb, int u, int lane, u32 (&xr)[8]) {
    if constexpr (F::GROUPED) lds64(xb + 256 * u + 32 * (lane >> 2) + 8 * (lane & 3), xr[XR * u], xr[XR * u + 1]);
    else lds128(xb + 512 * u + 16 * lane, xr[XR * u], xr[XR * u + 1], xr[XR * u + 2], xr[XR * u + 3]);
  }

  // The codes and NVFP4 scales of the T tiles of weight group grp at k-block kb into the X_OFF bytes
  // at shared address sl.
  QPN_DEV static void issue_weights(const Qpn80Args& a, u32 sl, int grp, int kb, int n_tiles, int lane) {
#pragma unroll
    for (int j = 0; j < T; ++j) {
      const int tile = min(grp * T + j, n_tiles - 1);
      const size_t blk = (size_t)tile * a.kblocks + kb;
      // Copy h moves the tile-block's 16-byte chunk lane + 32 h, so each copy instruction reads
      // 512 contiguous bytes (FP8, two chunks per lane: a lane-strided copy read every other 16
      // bytes and ran at half the NVFP4 ring's rate on the H200); chunk c belongs to lane c / H.
      const u8* c = a.codes + blk * W_BYTES;
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const int ch = lane + 32 * h;
        cp_async16(sl + j * W_BYTES + 16 * chunk_pos(ch), c + 16 * ch, 16u);
      }
      if constexpr (F::GROUPED) {
        if (lane < 4) cp_async16(sl + SC_OFF + j * SC_BYTES + lane * 16,
                                 a.scales + blk * A::SCALE_BLOCK_BYTES + lane * 16, 16u);
      }
    }
  }

  // Copy item (grp, kb) into slot at shared address sl.
  QPN_DEV static void issue(const Qpn80Args& a, u32 sl, int grp, int kb, int n_tiles, int lane,
                            const u16* const (&xsrc)[MT][2], const u32 (&xbytes)[MT][2], const u32 (&xdst)[2]) {
    issue_weights(a, sl, grp, kb, n_tiles, lane);
    if constexpr (!XG) {
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          cp_async16(sl + X_OFF + t * X_BYTES + xdst[i], xsrc[t][i] + (size_t)kb * A::K_BLOCK, xbytes[t][i]);
    }
  }

  QPN_DEV static void read_weights(u32 sl, int lane, u32 (&w)[T][F::WORDS], u32 (&sc)[T][2]) {
#pragma unroll
    for (int j = 0; j < T; ++j) {
#pragma unroll
      for (int h = 0; h < H; ++h)
        lds128(sl + j * W_BYTES + 16 * chunk_pos(H * lane + h), w[j][4 * h], w[j][4 * h + 1], w[j][4 * h + 2],
               w[j][4 * h + 3]);
      if constexpr (F::GROUPED) lds64(sl + SC_OFF + j * SC_BYTES + 8 * (lane >> 2), sc[j][0], sc[j][1]);
      else sc[j][0] = sc[j][1] = 0u;
    }
  }

  QPN_DEV static void read(u32 sl, int lane, u32 (&w)[T][F::WORDS], u32 (&sc)[T][2], u32 (&xr)[MT][8]) {
    read_weights(sl, lane, w, sc);
    if constexpr (XG) return;
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int u = 0; u < XU; ++u) read_x(sl + X_OFF + t * X_BYTES, u, lane, xr[t]);
  }

  QPN_DEV static void run(const Qpn80Args& a, u8* smem) {
    const int lane = threadIdx.x & 31;
    const int plane = blockIdx.x % a.chunks;
    const int gw = (blockIdx.x / a.chunks) * QPN80_WARPS + (threadIdx.x >> 5);
    if (gw >= a.nwarps) return;
    if constexpr (B::EMPTY) return;
    if constexpr (B::PDL) pdl_launch_dependents();
    const u32 ring = smem_addr(smem) + (threadIdx.x >> 5) * (S * STAGE);
    const float cs_tensor = B::result_scale(a);
    int q, r, lo, hi;
    B::run_of(a, gw, q, r, lo, hi);
    const int m0 = plane * MT * A::TOKENS;
    const int n_tiles = (a.n + A::TILE_N - 1) / A::TILE_N;
    // This lane's two 16-byte activation copies per token tile: chunk c = lane + 32 i is token
    // c >> 3, inputs 8 (c & 7) .. +7 of the k-block.
    const u16* xsrc[MT][2];
    u32 xbytes[MT][2], xdst[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = lane + 32 * i, g = c >> 3, qc = c & 7;
      xdst[i] = x_copy_pos(g, qc);
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const int tok = m0 + t * A::TOKENS + g;
        xbytes[t][i] = tok < a.m ? 16u : 0u;
        xsrc[t][i] = a.x + (size_t)(tok < a.m ? tok : 0) * a.ldx + 8 * qc;
      }
    }
    const int first_grp = lo / a.kblocks;
    // Issue cursor (item lo + issued) and consume cursor, both as (group, k-block).
    int ig = first_grp, ik = lo - first_grp * a.kblocks;
    int issued = 0;
    // PDL: with the activations in the ring, nothing is copied before the wait; without them, the
    // first S - 1 copies (weights only) go before it.
    if constexpr (B::PDL && !XG) pdl_wait();
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (lo + issued < hi) {
        issue(a, ring + (issued % S) * STAGE, ig, ik, n_tiles, lane, xsrc, xbytes, xdst);
        if (++ik == a.kblocks) { ik = 0; ++ig; }
      }
      cp_async_commit();
      ++issued;
    }
    if constexpr (B::PDL && XG) pdl_wait();
    int cg = first_grp, ck = lo - first_grp * a.kblocks, ck0 = ck;   // consume cursor
    float acc[T][MT][4];
    B::zero(acc);
    u32 sink = 0u;
    // XG: activations of the item being consumed (xa) and of the next one (xn), from global memory.
    const u16* xp[MT];
    bool xv[MT];
    u32 xn[MT][8];
    if constexpr (XG) {
      B::x_rows(a, m0, lane, xp, xv);
      B::load_x(xp, xv, ck, xn);
    }
    for (int item = lo; item < hi; ++item) {
      cp_async_wait<S - 2>();
      __syncwarp();
      if (lo + issued < hi) {
        issue(a, ring + (issued % S) * STAGE, ig, ik, n_tiles, lane, xsrc, xbytes, xdst);
        if (++ik == a.kblocks) { ik = 0; ++ig; }
      }
      cp_async_commit();
      ++issued;
      {
        u32 w[T][F::WORDS], sc[T][2], xr[MT][8];
        read(ring + ((item - lo) % S) * STAGE, lane, w, sc, xr);
        if constexpr (XG) {
#pragma unroll
          for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int i = 0; i < 8; ++i) xr[t][i] = xn[t][i];
          if (item + 1 < hi) B::load_x(xp, xv, ck + 1 == a.kblocks ? 0 : ck + 1, xn);
        }
        B::compute(w, sc, xr, acc, sink);
      }
      if (++ck == a.kblocks || item + 1 == hi) {
        if constexpr (B::SINK) acc[0][0][0] += __uint_as_float(sink & 0x007FFFFFu);
        B::finish(a, cg, ck0, ck, first_grp, gw, q, r, plane, m0, lane, acc, cs_tensor, cg);
        B::zero(acc);
        ++cg;
        ck = ck0 = 0;
      }
    }
    cp_async_wait<0>();
  }
};

// The block-cooperative register ring (issue 14): the same work items, decoders and split-K finish
// as Qpn80, but the unit of the stream-K partition is a block of 8 warps, and its warps interleave
// along K inside the block's run (warp i takes items lo + i, lo + i + 8, ...). Why: at any moment
// the 8 warps read one contiguous window of each weight tile instead of 8 separate streams; a pure
// read with this pattern reaches 87% of the H200's read ceiling on gate_up at 16 warps per SM
// against 80% for the per-warp runs (results/read_probe_h200_20261201.csv); in the kernels the gain
// is smaller, and only FP8 keeps it (QPN80C_ENTRY below). Each warp's ring
// runs across group boundaries. When the warps leave a group, each parks its FP32 sums in shared
// memory and the block meets at a barrier; one warp (a different one per group) adds the 8 in warp
// order -- deterministic -- and finishes the group as Qpn80::finish does for a warp (a whole group
// is stored; a partial one goes to the split-K scratch, where the last block to arrive adds the
// blocks' sums in block order). The barrier waits for no load: every warp's next k-blocks are
// already in flight. Shared memory: 2 x 8 warps x 32 lanes x T * MT * 4 floats (double-buffered
// by group parity, so one group's reduction can run while the warps fill the next one's slots).
template <class F, int MT, int T, int D, int VAR>
struct Qpn80Coop : Qpn80<F, MT, T, 1, 0, VAR> {
  static_assert(!F::RECORDS, "group-record decoders (INT4) run on the register ring Qpn80 only");
  using B = Qpn80<F, MT, T, 1, 0, VAR>;
  using A = AtomM16N8K16;
  static constexpr int DX = D >= 2 ? 2 : 1;
  static constexpr int DS = B::DS;
  static constexpr int PER_LANE = B::PER_LANE;
  static constexpr int LANE_BYTES = B::LANE_BYTES, BLOCK_BYTES = B::BLOCK_BYTES;
  static constexpr int SLOT_FLOATS = QPN80_WARPS * 32 * PER_LANE;   // one group parity

  struct Cursor {   // item g * kblocks + k of the work list
    int g, k;
    QPN_DEV void step(int kblocks) {
      k += QPN80_WARPS;
      while (k >= kblocks) { k -= kblocks; ++g; }
    }
  };

  // Warp wib leaves group g (relative index rel in the block's run): park, meet, reduce, finish.
  QPN_DEV static void flush(const Qpn80Args& a, float* red, int g, int rel, int lo, int hi, int unit, int q, int r,
                            int plane, int m0, int lane, int wib, float (&acc)[T][MT][4], float cs_tensor) {
    float* slots = red + (rel & 1) * SLOT_FLOATS;
#pragma unroll
    for (int j = 0; j < T; ++j)
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) slots[((wib * 32 + lane) * PER_LANE) + (j * MT + t) * 4 + i] = acc[j][t][i];
    // bar.sync counts the block's threads wherever each warp calls it from (sm_70+); every warp
    // flushes every group of the block's run exactly once, in order, so the counts always match.
    asm volatile("bar.sync 1, %0;" :: "n"(QPN80_THREADS) : "memory");
    B::zero(acc);
    if (wib != rel % QPN80_WARPS) return;
    float sum[T][MT][4];
    B::zero(sum);
    for (int w = 0; w < QPN80_WARPS; ++w)   // warp order: the same sums on every run
#pragma unroll
      for (int j = 0; j < T; ++j)
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) sum[j][t][i] += slots[((w * 32 + lane) * PER_LANE) + (j * MT + t) * 4 + i];
    const int gbase = g * a.kblocks;
    B::finish(a, g, max(lo, gbase) - gbase, min(hi, gbase + a.kblocks) - gbase, lo / a.kblocks, unit, q, r, plane,
              m0, lane, sum, cs_tensor, g);
  }

  QPN_DEV static void run(const Qpn80Args& a, float* red) {
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int plane = blockIdx.x % a.chunks;
    const int unit = blockIdx.x / a.chunks;   // a.nwarps counts blocks here
    if (unit >= a.nwarps) return;             // the whole block: no barrier is left waiting
    if constexpr (B::EMPTY) return;
    if constexpr (B::PDL) pdl_launch_dependents();
    const float cs_tensor = B::result_scale(a);
    int q, r, lo, hi;
    B::run_of(a, unit, q, r, lo, hi);
    const int m0 = plane * MT * A::TOKENS;
    const int n_tiles = (a.n + A::TILE_N - 1) / A::TILE_N;
    const u16* xp[MT];
    bool xv[MT];
    B::x_rows(a, m0, lane, xp, xv);
    const int g_first = lo / a.kblocks, g_last = (hi - 1) / a.kblocks;
    // This warp's items: lo + wib + 8 j, j < mine, walked by cursors (group, k-block) that step 8
    // items without a division (a division per item doubled the integer work of the loads).
    const int mine = hi - lo > wib ? (hi - lo - wib + QPN80_WARPS - 1) / QPN80_WARPS : 0;
    u32 w[D][T][F::WORDS];
    u32 sc[DS][T][2];
    u32 xr[DX][MT][8];
    u32 sink = 0u;
    const u8* cp[T];
    const u8* sp[T];
    Cursor cc{(lo + wib) / a.kblocks, (lo + wib) % a.kblocks};   // the item consumed next
    Cursor cw = cc, cs = cc, cx = cc;                             // the next weight / scale / x load
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (d < mine) {
        B::pointers(a, cw.g, n_tiles, lane, cp, sp);
        B::load_w(cp, cw.k, w[d]);
        if (d < DS) { B::load_sc(sp, cw.k, sc[d]); cs.step(a.kblocks); }
        cw.step(a.kblocks);
      }
    }
    if constexpr (B::PDL) pdl_wait();   // the weight ring is in flight; x comes from the previous kernel
#pragma unroll
    for (int d = 0; d < DX; ++d) {
      if (d < mine) {
        B::load_x(xp, xv, cx.k, xr[d]);
        cx.step(a.kblocks);
      }
    }
    float acc[T][MT][4];
    B::zero(acc);
    int cur = g_first;   // the group acc belongs to
    for (int j0 = 0; j0 < mine; j0 += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
        const int j = j0 + d;
        if (j < mine) {
          while (cur < cc.g) {
            if constexpr (B::SINK) acc[0][0][0] += __uint_as_float(sink & 0x007FFFFFu);
            flush(a, red, cur, cur - g_first, lo, hi, unit, q, r, plane, m0, lane, wib, acc, cs_tensor);
            ++cur;
          }
          B::compute(w[d], sc[d % DS], xr[d % DX], acc, sink);
          cc.step(a.kblocks);
          if (j + D < mine) {
            B::pointers(a, cw.g, n_tiles, lane, cp, sp);
            B::load_w(cp, cw.k, w[d]);
            cw.step(a.kblocks);
          }
          if (j + DS < mine) {
            B::pointers(a, cs.g, n_tiles, lane, cp, sp);
            B::load_sc(sp, cs.k, sc[d % DS]);
            cs.step(a.kblocks);
          }
          if (j + DX < mine) {
            B::load_x(xp, xv, cx.k, xr[d % DX]);
            cx.step(a.kblocks);
          }
        }
      }
    }
    if constexpr (B::SINK) acc[0][0][0] += __uint_as_float(sink & 0x007FFFFFu);
    for (; cur <= g_last; ++cur)
      flush(a, red, cur, cur - g_first, lo, hi, unit, q, r, plane, m0, lane, wib, acc, cs_tensor);
  }
};

// The M-band kernel (issue 14, item 1): one pass over the weights for a chunk of up to MT token
// tiles (64 rows at MT = 8). It serves the *_chunked route (M 17-96) on sm_80+, where the route
// used to launch one grid plane per 16-row chunk, each plane streaming every weight again (the later
// reads mostly from L2, still one decode per plane). The unit of the stream-K partition is a block
// of 8 warps and an item is (group of 8 x T weight tiles, one k-block): warp w of the block decodes
// tiles T (8 g + w) .. + T - 1 of group g, so all 8 warps consume the same k-block at the same time
// and share its activations. The block copies them (MT x 1 KB per k-block, rows past M as zeros)
// into a shared-memory ring S k-blocks ahead with cp.async, one barrier per k-block; per k-block a
// block reads MT KB of activations from L2 next to 8 T weight tiles (4.5 KB of NVFP4 at T = 1).
// Every token tile is multiplied, rows past M as zeros: no per-tile test in the inner loop; ops
// picks the smallest MT that holds M instead (sm80_tables.SM80_BAND_KERNELS). Weights and group scales go
// through each warp's register ring (Qpn80's loads, D deep). The split-K finish is Qpn80::finish,
// per warp on its own tiles: counter and partial-sum plane chunk x 8 + w, so a group's blocks are
// still added in a fixed order. Shared memory: S x MT KB per block, plus the 8 warps' weight tiles
// per slot when D = 0 (dynamic; sm80_plan.Sm80Kernel.smem_bytes).
template <class F, int MT, int T, int D, int S, int VAR>
struct Qpn80Band : Qpn80<F, MT, T, 1, 0, VAR> {
  static_assert(!F::RECORDS, "group-record decoders (INT4) run on the register ring Qpn80 only");
  using B = Qpn80<F, MT, T, 1, 0, VAR>;
  using A = AtomM16N8K16;
  static_assert(VAR == 0 || VAR == 3, "the band kernel has the plain and the loads-only forms");
  // D = 0: the codes and scales go through the shared-memory ring too, S - 1 k-blocks ahead, with no
  // register cost (tried for more weight bytes in flight per SM; not faster, see the entry lines).
  static constexpr bool WS = D == 0;
  static constexpr int DR = WS ? 1 : D;   // register ring depth (array sizes; unused when WS)
  static constexpr int DS = Qpn80<F, MT, T, DR, 0, VAR>::DS;   // its scale ring depth
  // Qpn80Ring without activations in its slots: its weight copies and reads (R::X_OFF bytes per
  // warp and k-block) and its activation layout per token tile.
  using R = Qpn80Ring<F, MT, T, 2, 1, VAR>;
  static constexpr int X_BYTES = A::TOKENS * A::K_BLOCK * 2;       // one token tile's k-block
  static constexpr int X_PART = MT * X_BYTES;
  static constexpr int STAGE = X_PART + (WS ? QPN80_WARPS * R::X_OFF : 0);
  static constexpr int COPIES = X_PART / 16;
  static constexpr int PER_THREAD = (COPIES + QPN80_THREADS - 1) / QPN80_THREADS;
  static constexpr int SPU = A::STEPS / R::XU;   // MMA steps per activation read

  struct Cursor {   // item g * kblocks + k of the work list
    int g, k;
    QPN_DEV void step(int kblocks) {
      if (++k == kblocks) { k = 0; ++g; }
    }
  };

  // Codes and/or NVFP4 scales of this warp's tiles of item (g, k) (one address computation for both
  // where the two rings are equally deep).
  template <bool CODES, bool SCALES>
  QPN_DEV static void load_item(const Qpn80Args& a, int g, int k, int wib, int n_tiles, int lane,
                                u32 (&w)[T][F::WORDS], u32 (&sc)[T][2]) {
    const u8* cp[T];
    const u8* sp[T];
    B::pointers(a, g * QPN80_WARPS + wib, n_tiles, lane, cp, sp);
    if constexpr (CODES) B::load_w(cp, k, w);
    if constexpr (SCALES) B::load_sc(sp, k, sc);
  }

  QPN_DEV static void issue_x(u32 slot, int kb, const u16* const (&src)[PER_THREAD], const u32 (&dst)[PER_THREAD],
                              const u32 (&bytes)[PER_THREAD], const bool (&on)[PER_THREAD]) {
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i)
      if (on[i]) cp_async16(slot + dst[i], src[i] + (size_t)kb * A::K_BLOCK, bytes[i]);
  }

  // WS: where warp wib's weights of an item lie in a stage (R::X_OFF bytes after the activations).
  QPN_DEV static u32 warp_weights(u32 slot, int wib) { return slot + X_PART + wib * R::X_OFF; }

  QPN_DEV static void compute(u32 xs, int lane, const u32 (&w)[T][F::WORDS], const u32 (&sc)[T][2],
                              float (&acc)[T][MT][4], u32& sink) {
#pragma unroll
    for (int u = 0; u < R::XU; ++u) {
      u32 xr[MT][8];   // read u fills registers R::XR u .. R::XR (u + 1) - 1 of each token tile
#pragma unroll
      for (int t = 0; t < MT; ++t) R::read_x(xs + t * X_BYTES, u, lane, xr[t]);
      if constexpr (B::LOADS_ONLY) {
#pragma unroll
        for (int t = 0; t < MT; ++t) sink ^= xr[t][R::XR * u];
        continue;
      }
#pragma unroll
      for (int ss = 0; ss < SPU; ++ss) {
        const int s = u * SPU + ss;
#pragma unroll
        for (int j = 0; j < T; ++j) {
          u32 a0, a1, a2, a3;
          F::frag(w[j], s, sc[j], a0, a1, a2, a3);
#pragma unroll
          for (int t = 0; t < MT; ++t) A::mma(acc[j][t], a0, a1, a2, a3, xr[t][2 * s], xr[t][2 * s + 1]);
        }
      }
    }
    if constexpr (B::LOADS_ONLY) {
#pragma unroll
      for (int j = 0; j < T; ++j) {
#pragma unroll
        for (int q = 0; q < F::WORDS; ++q) sink ^= w[j][q];
        sink ^= sc[j][0] ^ sc[j][1];
      }
    }
  }

  QPN_DEV static void run(const Qpn80Args& a, u8* smem) {
    const int tid = threadIdx.x, lane = tid & 31, wib = tid >> 5;
    const int chunk = blockIdx.x % a.chunks;
    const int unit = blockIdx.x / a.chunks;   // a.nwarps counts blocks here
    if (unit >= a.nwarps) return;             // the whole block: no barrier is left waiting
    const float cs_tensor = B::result_scale(a);
    int q, r, lo, hi;
    B::run_of(a, unit, q, r, lo, hi);
    const int m0 = chunk * MT * A::TOKENS;
    const int n_tiles = (a.n + A::TILE_N - 1) / A::TILE_N;
    const int plane = chunk * QPN80_WARPS + wib;
    // This thread's activation copies: copy c = tid + 256 i is token tile c >> 6, token (c >> 3) & 7,
    // inputs 8 (c & 7) .. +7 of the k-block (the Qpn80Ring layout per token tile); rows past M as zeros.
    const u16* xsrc[PER_THREAD];
    u32 xdst[PER_THREAD], xbytes[PER_THREAD];
    bool xon[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int c = tid + QPN80_THREADS * i, t = c >> 6, g = (c >> 3) & 7, qc = c & 7;
      const int tok = m0 + t * A::TOKENS + g;
      xon[i] = c < COPIES;
      xbytes[i] = tok < a.m ? 16u : 0u;
      xsrc[i] = a.x + (size_t)(tok < a.m ? tok : 0) * a.ldx + 8 * qc;
      xdst[i] = t * X_BYTES + R::x_copy_pos(g, qc);
    }
    const u32 ring = smem_addr(smem);
    const int first_grp = lo / a.kblocks;
    Cursor cx{first_grp, lo - first_grp * a.kblocks};   // the next activation copy (crosses groups)
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (lo + s < hi) {
        issue_x(ring + s * STAGE, cx.k, xsrc, xdst, xbytes, xon);
        if constexpr (WS) R::issue_weights(a, warp_weights(ring + s * STAGE, wib), cx.g * QPN80_WARPS + wib, cx.k,
                                           n_tiles, lane);
      }
      cp_async_commit();
      cx.step(a.kblocks);
    }
    u32 w[DR][T][F::WORDS];
    u32 sc[DS][T][2];
    u32 sink = 0u;
    int rel = 0;   // items consumed: the activation slot is rel % S
    // One segment per group of the run: the weight ring restarts per segment (as Qpn80::segment), so
    // the split-K finish is emitted once, outside the unrolled loop (inside it, D copies of the finish
    // made the loop body several times the instruction cache).
    for (int g = first_grp; g * a.kblocks < hi; ++g) {
      const int kb0 = max(lo - g * a.kblocks, 0), kb1 = min(hi - g * a.kblocks, a.kblocks);
#pragma unroll
      for (int d = 0; d < D; ++d) {   // (none when WS)
        if (kb0 + d < kb1) {
          if (d < DS) load_item<true, true>(a, g, kb0 + d, wib, n_tiles, lane, w[d], sc[d % DS]);
          else load_item<true, false>(a, g, kb0 + d, wib, n_tiles, lane, w[d], sc[0]);
        }
      }
      float acc[T][MT][4];
      B::zero(acc);
      for (int kb = kb0; kb < kb1; kb += DR) {
#pragma unroll
        for (int d = 0; d < DR; ++d) {
          const int k = kb + d;
          if (k < kb1) {   // uniform over the block: every thread meets every barrier
            cp_async_wait<S - 2>();
            __syncthreads();   // item's operands are in; every warp is done with the slot refilled next
            if (lo + rel + S - 1 < hi) {
              const u32 next = ring + ((rel + S - 1) % S) * STAGE;
              issue_x(next, cx.k, xsrc, xdst, xbytes, xon);
              if constexpr (WS) R::issue_weights(a, warp_weights(next, wib), cx.g * QPN80_WARPS + wib, cx.k, n_tiles,
                                                 lane);
            }
            cp_async_commit();
            cx.step(a.kblocks);
            const u32 cur = ring + (rel % S) * STAGE;
            ++rel;
            if constexpr (WS) {
              R::read_weights(warp_weights(cur, wib), lane, w[0], sc[0]);
              compute(cur, lane, w[0], sc[0], acc, sink);
              continue;
            }
            compute(cur, lane, w[d], sc[d % DS], acc, sink);
            if constexpr (DS == D) {   // codes and scales of the same item: one address computation
              if (k + D < kb1) load_item<true, true>(a, g, k + D, wib, n_tiles, lane, w[d], sc[d]);
            } else {
              if (k + D < kb1) load_item<true, false>(a, g, k + D, wib, n_tiles, lane, w[d], sc[0]);
              if (k + DS < kb1) load_item<false, true>(a, g, k + DS, wib, n_tiles, lane, w[d], sc[d % DS]);
            }
          }
        }
      }
      if constexpr (B::SINK) acc[0][0][0] += __uint_as_float(sink & 0x007FFFFFu);
      B::finish(a, g, kb0, kb1, first_grp, unit, q, r, plane, m0, lane, acc, cs_tensor, g * QPN80_WARPS + wib);
    }
    cp_async_wait<0>();
  }
};

// Reconstruct pass for the *_reconstruct route: packed codes -> FP16 workspace ws[N_pad, K_pad]
// (row-major) holding the exact FP16 values e2m1 x e4m3 (NVFP4) or e4m3 (FP8). One thread per
// (tile, k-block, lane): the lane's 16 inputs of rows g and g+8 (where they lie is the fragment's
// layout, Frag16*::store_ws), eight 8-byte stores.
template <class F>
__device__ __forceinline__ void qpn80_reconstruct_body(const u8* codes, const u8* scales, u16* ws,
                                                       int n_tiles, int kblocks, int gs = 0) {
  using A = AtomM16N8K16;
  const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = (int)(gid & 31);
  const long long tb = gid >> 5;
  if (tb >= (long long)n_tiles * kblocks) return;
  const int tile = (int)(tb / kblocks), kb = (int)(tb % kblocks);
  constexpr int LANE_BYTES = F::WORDS * 4;
  u32 w[F::WORDS];
  const u8* p = codes + ((size_t)tile * kblocks + kb) * (LANE_BYTES * 32) + lane * LANE_BYTES;
#pragma unroll
  for (int q = 0; q < F::WORDS; q += 4) ldg128(p + 4 * q, w[q], w[q + 1], w[q + 2], w[q + 3]);
  u32 sc[2] = {0u, 0u};
  if constexpr (F::RECORDS)
    F::load_scales(F::tile_records(scales, tile, kblocks, lane, gs) + F::record_step(kb, gs), sc);
  else if constexpr (F::GROUPED)
    F::load_scales(scales + ((size_t)tile * kblocks + kb) * A::SCALE_BLOCK_BYTES + F::scale_offset(lane), sc);
  const size_t ldw = (size_t)kblocks * A::K_BLOCK;
  u16* row_g = ws + ((size_t)tile * A::TILE_N + (lane >> 2)) * ldw + (size_t)kb * A::K_BLOCK;
#pragma unroll
  for (int s = 0; s < A::STEPS; ++s) {
    u32 a0, a1, a2, a3;
    F::frag(w, s, sc, a0, a1, a2, a3);
    F::store_ws(row_g, ldw, lane, s, a0, a1, a2, a3);
  }
}

#define QPN80_ENTRY(NAME, F, MT, T, D, PF, VAR)                                             \
  extern "C" __global__ void __launch_bounds__(QPN80_THREADS, 2) NAME(Qpn80Args a) {        \
    Qpn80<F, MT, T, D, PF, VAR>::run(a);                                                     \
  }

// The same with a register cap sized for MINB blocks of 256 threads per SM (MINB = 3: 80 registers,
// 24 warps per SM; 4: 64 registers, 32 warps per SM).
#define QPN80M_ENTRY(NAME, F, MT, T, D, PF, MINB, VAR)                                     \
  extern "C" __global__ void __launch_bounds__(QPN80_THREADS, MINB) NAME(Qpn80Args a) {     \
    Qpn80<F, MT, T, D, PF, VAR, MINB>::run(a);                                               \
  }

// Ring kernels: dynamic shared memory of QPN80_WARPS * S * STAGE bytes (ops computes the same from
// sm80_plan.Sm80Kernel.smem_bytes); MINB = blocks per SM the register cap is sized for.
#define QPN80R_ENTRY(NAME, F, MT, T, S, MINB, VAR)                                          \
  extern "C" __global__ void __launch_bounds__(QPN80_THREADS, MINB) NAME(Qpn80Args a) {     \
    extern __shared__ __align__(16) u8 qpn80_smem[];                                         \
    Qpn80Ring<F, MT, T, S, 0, VAR>::run(a, qpn80_smem);                                       \
  }
// The same with the activations read from global memory (XG = 1): only codes and scales in the ring.
#define QPN80RX_ENTRY(NAME, F, MT, T, S, MINB, VAR)                                         \
  extern "C" __global__ void __launch_bounds__(QPN80_THREADS, MINB) NAME(Qpn80Args a) {     \
    extern __shared__ __align__(16) u8 qpn80_smem[];                                         \
    Qpn80Ring<F, MT, T, S, 1, VAR>::run(a, qpn80_smem);                                       \
  }

// Block-cooperative kernels (Qpn80Coop): static shared memory for the in-block reduction; the
// split-K partition counts blocks (ops passes blocks as Qpn80Args.nwarps).
#define QPN80C_ENTRY(NAME, F, MT, T, D, MINB, VAR)                                          \
  extern "C" __global__ void __launch_bounds__(QPN80_THREADS, MINB) NAME(Qpn80Args a) {     \
    __shared__ __align__(16) float qpn80_red[2 * QPN80_WARPS * 32 * T * MT * 4];             \
    Qpn80Coop<F, MT, T, D, VAR>::run(a, qpn80_red);                                          \
  }

//
// M-band kernels (Qpn80Band): dynamic shared memory of S * MT KB per block; the split-K partition
// counts blocks, each owning a group of 8 x T weight tiles (ops passes blocks as Qpn80Args.nwarps).
#define QPN80B_ENTRY(NAME, F, MT, T, D, S, MINB, VAR)                                       \
  extern "C" __global__ void __launch_bounds__(QPN80_THREADS, MINB) NAME(Qpn80Args a) {     \
    extern __shared__ __align__(16) u8 qpn80_smem[];                                         \
    Qpn80Band<F, MT, T, D, S, VAR>::run(a, qpn80_smem);                                       \
  }

#define QPN80_RECONSTRUCT_ENTRY(NAME, F)                                                    \
  extern "C" __global__ void __launch_bounds__(QPN80_THREADS) NAME(                          \
      const u8* codes, const u8* scales, u16* ws, int n_tiles, int kblocks) {                 \
    qpn80_reconstruct_body<F>(codes, scales, ws, n_tiles, kblocks);                           \
  }
// The same for a decoder with per-(tile, group) records (INT4): the group shift as one more
// argument (ops._launch_reconstruct passes it for a format whose weights choose their group size).
#define QPN80_RECONSTRUCT_GS_ENTRY(NAME, F)                                                 \
  extern "C" __global__ void __launch_bounds__(QPN80_THREADS) NAME(                          \
      const u8* codes, const u8* scales, u16* ws, int n_tiles, int kblocks, int gs) {         \
    qpn80_reconstruct_body<F>(codes, scales, ws, n_tiles, kblocks, gs);                       \
  }

// Entry lines. Every kernel is named by its configuration: <format>_mt<MT>_m16n8k16_t<T>d<D>p<PF>[_variant],
// T = weight tiles of 16 rows per warp (they share each activation load), D = ring depth in
// k-blocks (NVFP4: D x 16 B, FP8: D x 32 B in flight per lane per tile), PF = L2 prefetch distance
// in k-blocks beyond the ring (0: none). The lines are not in this file: each weight family lists its
// configured kernels as data (kernels/families/<family>/kernels_sm80.py, ENTRIES, with the
// measurements behind them) and kernels/jit.py (sm80_entry_lines) appends their lines below as NVRTC
// compiles the file. Which one serves each route is the same files' ROUTE_KERNELS, gathered by
// kernels/sm80_tables.py and chosen on the H200 (benchmarks/kernel_matched_bench.py --sweep). Only
// configurations that compile without spills for sm_80 and sm_90 under the 128-register cap are listed
// (tests check it).
//
// Shared-memory ring kernels (Qpn80Ring): <format>_mt<MT>_m16n8k16_t<T>s<S>[_variant], S = ring
// slots per warp (S - 1 k-blocks in flight while one is consumed); MINB = blocks per SM the
// register cap is sized for (the shared memory per block is 8 x S x STAGE bytes).
// ..x: activations from global memory (XG = 1).
//
// Issue 14, 2026-12-01 (session 3), measured and dropped (commit fb81b8a holds the code): the same
// per-warp ring filled by the bulk-copy engine (cp.async.bulk, one mbarrier per slot, sm_90; one lane
// copies a slot's tiles), 4-8 slots at 2-4 blocks per SM. Slower than the route kernels on every
// TP1 shape at M 1-16 (results/kernel_sm80_bulk_sweep_h200_20261201.csv): FP8 in_proj M = 1 31.3-34.9
// vs 27.2 us, NVFP4 gate_up M = 1 48.9-57.7 vs 42.8 us. Its loads alone read lm_head at 85% of the
// ceiling (t2d4p0 in the same sweep: 62%); not profiled further: each k-block adds an mbarrier wait,
// shared-memory reads and the copy issue to the already issue-bound decode.
//
// Measured variants (same arguments; never routes): *_exact: NVFP4 with normal FP16 operands (one
// more multiply per register); *_nodecode, *_nomma, *_loadonly: one stage dropped, to see where
// the time goes (their outputs are not the product).
//
// Issue 14, 2026-12-01: the route kernels with the PDL hooks (VAR 7; bit for bit the same
// results; the mt1 forms are what ops launches on sm_90+, the mt2 forms are measured only).
//
// M-band kernels (Qpn80Band): <format>_mt<MT>_m16n8k16_t<T>d<D>s<S>_b<MINB> (D = 0: the weights
// through the shared ring too). H200 sweeps, 2026-12-01, against the MT = 2 route kernels once per
// 16-row chunk (results/kernel_sm80_band_sweep_h200_20261201.csv; _sweep2_ adds the D = 0 forms,
// _sweep3_ the T = 2 forms): NVFP4 gains at every M -- gate_up 68.5 vs 98.3 us at M = 17 and 32 (mt4 t1d4s4_b2),
// 108 vs 188 us at M = 64 (mt8 t1d2s4_b2); down 41.5 vs 53.9 and 77.2 vs 97.8 us -- and serves the
// chunked route (sm80_tables.SM80_BAND_KERNELS). FP8 does not: the best FP8 band form ties the 16-row chunks on
// in_proj (40.0 vs 40.4 us at M = 17, 68.4 vs 71.0 at 64) and loses on out_proj (24.4 vs 21.9 us),
// so FP8 keeps them; its forms stay as measured variants. Where the band kernel's time goes is not
// settled: its loads alone (the loads-only form, no decode, no MMA) take as long as the whole kernel
// (103 vs 108 us on gate_up at M = 64, about 20% of the read ceiling), deeper weight rings (D = 8,
// or the weights through the shared ring) do not help, and neither do two tiles per warp, which
// halve the activation reads per weight byte (sweep3: at best 2% faster, slower on most shapes). Dropped
// after the sweeps (commit history): one-block register rings at MT = 8 (t1d4s4_b1, t2d4s4_b1; FP8
// t1d2s4_b1, t1d4s4_b1, t1d1s4_b2), the D = 0 forms at MT = 8 (t1d0s8_b2, t1d0s16_b1; FP8 t1d0s6_b2)
// and the T = 2 forms (t2d2s4_b2, t2d0s6_b1; FP8 t2d1s4_b2, t2d0s5_b2).
