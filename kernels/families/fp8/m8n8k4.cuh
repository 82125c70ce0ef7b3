// The FP8 family's m8n8k4 (SM70) decoder: DecFP8 (see qpn_family.cuh for the decoder contract).
#pragma once
#include "qpn_family.cuh"

// FP8 e4m3: bytes 1 and 3 of a word become FP16 (sign at 15, exponent:mantissa at 13..7), the
// e4m3 value times 2^-8, restored exactly by the multiply by 2^8 (0x5C00). A left shift by 8
// brings bytes 0 and 2 into place for the next register.
struct DecFP8 {
  static constexpr bool GROUPED = false;  // per-tensor / per-channel scale: applied to the FP32 result
  static constexpr bool GROUP_RECORDS = false;
  static constexpr int WORDS = 8;         // 32 bytes of codes per lane per k-block
  static constexpr int WORDS_PER_PAIR = 2;  // codes of 4 inputs (1 MMA of m8n8k4) per word
  // Two k-blocks ahead at one token tile (3 x 1 KB in flight: TP4 in_proj gives 13 warps per SM,
  // which the model's t0-bounded fit puts latency-bound with 2 KB); one at two token tiles, where a
  // second spills qpn8_mt2_m8n8k4 (8 words a stage).
  static constexpr int KBLOCKS_AHEAD = 2;
  static constexpr int KBLOCKS_AHEAD_MT2 = 1;
  static constexpr float OUT_MULT = 1.0f;   // the scale of the result is all in the FP32 chscale
  QPN_DEV static u32 dec(u32 t) { return hmul2(e4m3x2_bits(t), 0x5C005C00u); }
  QPN_DEV static u32 half2(const u32 (&w)[WORDS], int idx) { return dec(w[idx >> 1] << (8 * (idx & 1))); }
  QPN_DEV static u32 front_half2(const u32 (&w)[WORDS], int r) { return dec(w[r >> 1] << (8 * (r & 1))); }
};
