// The FP8 family's m16n8k16 (sm_80+) fragment decoder: Frag16FP8.
#pragma once
#include "qpn_atom_m16n8k16.cuh"

// FP8 e4m3 in m16n8k16 order: step s takes words 2s (a0 = bytes 0-1, a1 = bytes 2-3) and 2s+1
// (a2, a3). Exact e4m3 values in FP16; the per-tensor / per-channel scale is applied in FP32; the
// activations as Frag16LaneRun16 (qpn_atom_m16n8k16.cuh).
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
