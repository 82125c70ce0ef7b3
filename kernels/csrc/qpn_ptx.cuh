// PTX primitives for the QPN kernels. No headers at all: NVRTC compiles these sources on a
// machine that has only the NVRTC library (no CUDA toolkit, no cuda_fp16.h), so halves are
// carried as raw 16-bit patterns and every FP16 operation is one line of inline PTX.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define QPN_DEV __device__ __forceinline__

// Read-only, 16-byte vector load (weights and activations are never written by these kernels).
QPN_DEV void ldg128(const void* p, u32& a, u32& b, u32& c, u32& d) {
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}

QPN_DEV u32 ldg32(const void* p) {
  u32 v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

QPN_DEV u32 ldg8(const void* p) {
  u16 v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return (u32)v;
}

QPN_DEV u16 ldg16(const void* p) {
  u16 v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

QPN_DEV float fma_rn(float a, float b, float c) {
  float d;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}

QPN_DEV float ldgf(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

QPN_DEV void stg128(void* p, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

QPN_DEV void stg16(void* p, u16 v) {
  asm volatile("st.global.u16 [%0], %1;" :: "l"(p), "h"(v) : "memory");
}

// FP16x2 multiply, round to nearest (exact for the power-of-two rescale used by the decoders).
QPN_DEV u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// FP16x2 subtract, round to nearest (the INT4 decoder's (1024 + c) - (1024 + z): exact integers).
QPN_DEV u32 hsub2(u32 a, u32 b) {
  u32 d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

QPN_DEV u16 f32_to_f16(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

QPN_DEV float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

QPN_DEV u32 pack_f16x2(float lo, float hi) {
  return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}

// (a & mask) | b, one LOP3.
QPN_DEV u32 and_or(u32 a, u32 mask, u32 b) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(b));
  return d;
}

// e4m3fn byte -> float32, exact (subnormals included; needs no flush-to-zero, which NVRTC does
// not enable by default). The bits are placed into an FP32 pattern whose exponent is 120 too
// small; the caller multiplies by 2^120 (split as 2^60 * 2^60 around the global scale).
QPN_DEV float bits_to_f32(u32 b) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(b));
  return f;
}

QPN_DEV float e4m3_bits_to_f32_scaled_down(u32 b) {
  return bits_to_f32(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20));
}

// 2^60 as float: e4m3 * global = (e4m3 * 2^-120 * 2^60) * (global * 2^60), each factor exact.
#define QPN_TWO_POW_60 1152921504606846976.0f

// Byte permute: result byte i = byte sel_i of the 8-byte pair {b:a} (a = bytes 0-3, b = 4-7).
QPN_DEV u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Streamed once: 16-byte read-only load that does not allocate in L1 (leaves L1 to the
// activations that every warp of the SM re-reads).
QPN_DEV void ldg128_stream(const void* p, u32& a, u32& b, u32& c, u32& d) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}

// Read through L2 only (data written by other SMs in the same launch: L1 is not coherent).
QPN_DEV void ldcg128f(const float* p, float& a, float& b, float& c, float& d) {
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(a), "=f"(b), "=f"(c), "=f"(d) : "l"(p));
}

QPN_DEV void stg128f(float* p, float a, float b, float c, float d) {
  asm volatile("st.global.v4.f32 [%0], {%1,%2,%3,%4};" :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

QPN_DEV float ldcgf(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

QPN_DEV void stgf(float* p, float v) {
  asm volatile("st.global.f32 [%0], %1;" :: "l"(p), "f"(v) : "memory");
}

// Ask L2 to fetch the line holding p (no register, no wait): deepens the memory pipeline beyond
// what the register ring holds.
QPN_DEV void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }


// One-instruction integer operations that NVVM cannot see through. The NVFP4 m8n8k4 decoder
// (DecNVFP4::front_half2) is written with them: from plain C shifts and masks, NVVM moves each
// mask through its shift, and the half-words a code word's four registers share are rebuilt for
// every register (ptxas 12.9, sm_70, qpn2_mt1_m8n8k4: about 20 integer instructions per code word
// instead of 13).
QPN_DEV u32 shl_b32(u32 a, u32 s) {
  u32 d;
  asm("shl.b32 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(s));
  return d;
}
QPN_DEV u32 shr_b32(u32 a, u32 s) {
  u32 d;
  asm("shr.b32 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(s));
  return d;
}
QPN_DEV u32 and_b32(u32 a, u32 m) {
  u32 d;
  asm("and.b32 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(m));
  return d;
}
// (a | b) & m, one LOP3.
QPN_DEV u32 or_and(u32 a, u32 b, u32 m) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xA8;" : "=r"(d) : "r"(a), "r"(b), "r"(m));
  return d;
}
