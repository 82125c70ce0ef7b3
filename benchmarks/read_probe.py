"""Read probe: how fast can ONE kernel read a layer's weight bytes, per call, on this GPU, timed the
way kernel_matched_bench.py times the QPN arms (a CUDA graph of back-to-back calls over rotated
copies, so every call streams from DRAM)?

The read ceiling of the matched bench is torch.sum over 2 GiB; a layer is 12-700 MB, read in one
kernel of a few to a few hundred microseconds, so launch, fill and drain are a larger share. This
probe measures, per QPN shape's packed byte count, pure read kernels with nothing computed:

  torch_sum      torch.sum over the same bytes (as float32)
  warp_runs      each warp reads one contiguous run of 512-byte blocks (the QPN work split),
                 16 B per lane per load, D loads in flight per lane, W warps per SM
  grid_stride    warp w reads blocks w, w + nwarps, ... (the whole GPU sweeps one window)
  bulk           each warp's contiguous run copied into shared memory by the bulk-copy engine
                 (cp.async.bulk + mbarrier, sm_90), S slots of C bytes per warp, every lane then
                 reads its bytes from shared memory (what a TMA-fed QPN kernel would do first)

    python -m qpn.benchmarks.read_probe --out results/read_probe_<gpu>_<date>.csv

Prints a table and writes a CSV (provenance header as the matched bench). Read kernels only: no
figure here is a QPN figure; it says how close to the ceiling a kernel of each shape's size can get.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import sys

import torch

from qpn.benchmarks import kernel_matched_bench as kmb
from qpn.kernels import jit, nvrtc

SOURCE = r"""
#include "qpn_ptx.cuh"
#include "qpn_atom_m16n8k16.cuh"

QPN_DEV void sink_out(u32 s, u32* out, int gw) { if (s == 0x9E3779B9u) out[gw] = s; }

// blocks of 512 B; warp gw reads [lo, hi) contiguous, D 16-byte loads in flight per lane
template <int D>
QPN_DEV void warp_runs(const u8* buf, long long nblk, u32* out) {
  const int lane = threadIdx.x & 31;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  const long long gw = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const long long q = nblk / nw, r = nblk % nw;
  const long long lo = gw * q + min(gw, r), hi = lo + q + (gw < r ? 1 : 0);
  u32 s = 0;
  const u8* p = buf + lane * 16;
  long long b = lo;
  for (; b + D <= hi; b += D) {
    u32 w[D][4];
#pragma unroll
    for (int d = 0; d < D; ++d) ldg128_stream(p + (b + d) * 512, w[d][0], w[d][1], w[d][2], w[d][3]);
#pragma unroll
    for (int d = 0; d < D; ++d) s ^= w[d][0] ^ w[d][1] ^ w[d][2] ^ w[d][3];
  }
  for (; b < hi; ++b) { u32 a0, a1, a2, a3; ldg128_stream(p + b * 512, a0, a1, a2, a3); s ^= a0 ^ a1 ^ a2 ^ a3; }
  sink_out(s, out, (int)gw);
}

template <int D>
QPN_DEV void grid_stride(const u8* buf, long long nblk, u32* out) {
  const int lane = threadIdx.x & 31;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  const long long gw = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  u32 s = 0;
  const u8* p = buf + lane * 16;
  long long b = gw;
  for (; b + (D - 1) * nw < nblk; b += D * nw) {
    u32 w[D][4];
#pragma unroll
    for (int d = 0; d < D; ++d) ldg128_stream(p + (b + d * nw) * 512, w[d][0], w[d][1], w[d][2], w[d][3]);
#pragma unroll
    for (int d = 0; d < D; ++d) s ^= w[d][0] ^ w[d][1] ^ w[d][2] ^ w[d][3];
  }
  for (; b < nblk; b += nw) { u32 a0, a1, a2, a3; ldg128_stream(p + b * 512, a0, a1, a2, a3); s ^= a0 ^ a1 ^ a2 ^ a3; }
  sink_out(s, out, (int)gw);
}

// block b reads one contiguous run of blocks; its warps interleave inside it (warp i: lo + i,
// lo + i + warps, ...), so the SM's warps read one window at a time instead of W separate streams
template <int D>
QPN_DEV void block_runs(const u8* buf, long long nblk, u32* out) {
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  const long long q = nblk / gridDim.x, r = nblk % gridDim.x;
  const long long b0 = blockIdx.x;
  const long long lo = b0 * q + min(b0, r), hi = lo + q + (b0 < r ? 1 : 0);
  u32 s = 0;
  const u8* p = buf + lane * 16;
  long long b = lo + wib;
  for (; b + (D - 1) * wpb < hi; b += D * wpb) {
    u32 w[D][4];
#pragma unroll
    for (int d = 0; d < D; ++d) ldg128_stream(p + (b + d * wpb) * 512, w[d][0], w[d][1], w[d][2], w[d][3]);
#pragma unroll
    for (int d = 0; d < D; ++d) s ^= w[d][0] ^ w[d][1] ^ w[d][2] ^ w[d][3];
  }
  for (; b < hi; b += wpb) { u32 a0, a1, a2, a3; ldg128_stream(p + b * 512, a0, a1, a2, a3); s ^= a0 ^ a1 ^ a2 ^ a3; }
  sink_out(s, out, (int)(blockIdx.x * wpb + wib));
}

// the QPN register ring's pattern: a warp's run of items (T = 2 tiles, K fastest) over a
// [tile][kblock][512 B] layout of KB k-blocks per tile, D k-blocks in flight per tile, plus each
// tile's 8-byte-per-lane scale stream (1/9 of the bytes, as NVFP4); restarts the ring per segment
template <int D, int KB>
QPN_DEV void qpn_pattern(const u8* buf, long long nblk, u32* out) {
  const int lane = threadIdx.x & 31;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  const long long gw = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  // nblk 512-byte blocks = codes (8/9) then scales (1/9, 64 B per tile-block)
  const long long code_blk = nblk * 8 / 9, tiles = code_blk / KB, groups = tiles / 2;
  const u8* scales = buf + code_blk * 512;
  const long long items = groups * KB, q = items / nw, r = items % nw;
  const long long lo = gw * q + min(gw, r), hi = lo + q + (gw < r ? 1 : 0);
  u32 s = 0;
  for (long long it = lo; it < hi;) {
    const long long g = it / KB, k0 = it % KB, k1 = min((long long)KB, hi - g * KB);
    it = g * KB + k1;
    const u8* c0 = buf + (2 * g * KB) * 512 + lane * 16;
    const u8* c1 = c0 + KB * 512;
    const u8* s0 = scales + (2 * g * KB) * 64 + (lane >> 2) * 8;
    const u8* s1 = s0 + KB * 64;
    for (long long k = k0; k < k1; k += D) {
      u32 w[D][2][4], sc[D][2][2];
#pragma unroll
      for (int d = 0; d < D; ++d) if (k + d < k1) {
        ldg128_stream(c0 + (k + d) * 512, w[d][0][0], w[d][0][1], w[d][0][2], w[d][0][3]);
        ldg128_stream(c1 + (k + d) * 512, w[d][1][0], w[d][1][1], w[d][1][2], w[d][1][3]);
        asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(sc[d][0][0]), "=r"(sc[d][0][1]) : "l"(s0 + (k + d) * 64));
        asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(sc[d][1][0]), "=r"(sc[d][1][1]) : "l"(s1 + (k + d) * 64));
      }
#pragma unroll
      for (int d = 0; d < D; ++d) if (k + d < k1)
        s ^= w[d][0][0] ^ w[d][0][3] ^ w[d][1][1] ^ w[d][1][2] ^ sc[d][0][0] ^ sc[d][1][1];
    }
  }
  sink_out(s, out, (int)gw);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
QPN_DEV void mbar_init(u32 bar) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory"); }
QPN_DEV void mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
QPN_DEV void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
QPN_DEV void mbar_wait(u32 bar, u32 parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
               :: "r"(bar), "r"(parity) : "memory");
}
#endif

// chunks of C bytes; warp gw reads its contiguous run of chunks through S shared-memory slots
template <int S, int C>
QPN_DEV void bulk(const u8* buf, long long nblk, u32* out, u8* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  const long long gw = (long long)blockIdx.x * (blockDim.x >> 5) + wib;
  const long long nch = nblk * 512 / C;
  const long long q = nch / nw, r = nch % nw;
  const long long lo = gw * q + min(gw, r), hi = lo + q + (gw < r ? 1 : 0);
  const u32 ring = smem_addr(smem) + wib * (S * C + 8 * S);
  const u32 bars = ring + S * C;
  if (lane == 0) {
    for (int i = 0; i < S; ++i) mbar_init(bars + 8 * i);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  long long issued = lo;
  if (lane == 0) {
    for (int i = 0; i < S && issued < hi; ++i, ++issued) {
      mbar_expect(bars + 8 * i, C);
      bulk_g2s(ring + i * C, buf + issued * C, C, bars + 8 * i);
    }
  }
  u32 s = 0;
  for (long long c = lo; c < hi; ++c) {
    const int slot = (int)((c - lo) % S);
    const u32 par = (u32)(((c - lo) / S) & 1);
    mbar_wait(bars + 8 * slot, par);
#pragma unroll
    for (int o = 0; o < C; o += 512) {
      u32 a0, a1, a2, a3;
      lds128(ring + slot * C + o + lane * 16, a0, a1, a2, a3);
      s ^= a0 ^ a1 ^ a2 ^ a3;
    }
    __syncwarp();
    if (lane == 0 && issued < hi) {
      mbar_expect(bars + 8 * slot, C);
      bulk_g2s(ring + slot * C, buf + issued * C, C, bars + 8 * slot);
      ++issued;
    }
    issued = __shfl_sync(0xffffffffu, issued, 0);
  }
  sink_out(s, out, (int)gw);
#endif
}

#define WR(D) extern "C" __global__ void warp_runs_d##D(const u8* b, long long n, u32* o) { warp_runs<D>(b, n, o); }
#define GS(D) extern "C" __global__ void grid_stride_d##D(const u8* b, long long n, u32* o) { grid_stride<D>(b, n, o); }
#define BK(S, C) extern "C" __global__ void bulk_s##S##_c##C(const u8* b, long long n, u32* o) { \
  extern __shared__ __align__(128) u8 sm[]; bulk<S, C>(b, n, o, sm); }
#define BR(D) extern "C" __global__ void block_runs_d##D(const u8* b, long long n, u32* o) { block_runs<D>(b, n, o); }
#define QP(D) extern "C" __global__ void qpn_pattern_d##D(const u8* b, long long n, u32* o) { qpn_pattern<D, 80>(b, n, o); }
WR(4) WR(8) WR(16) BR(4) BR(8) QP(4) QP(8)
GS(4) GS(8) GS(16)
BK(4, 2048) BK(4, 4096) BK(8, 2048) BK(4, 8192)
"""

KERNELS = {
    "warp_runs": [("warp_runs_d4", 4), ("warp_runs_d8", 8), ("warp_runs_d16", 16)],
    "grid_stride": [("grid_stride_d4", 4), ("grid_stride_d8", 8), ("grid_stride_d16", 16)],
    "block_runs": [("block_runs_d4", 4), ("block_runs_d8", 8)],
}
# the register ring's own access pattern (K = 5120: 80 k-blocks per tile; NVFP4 shapes only)
QPN_PATTERN = [("qpn_pattern_d4", 4), ("qpn_pattern_d8", 8)]
BULK = [("bulk_s4_c2048", 4, 2048), ("bulk_s8_c2048", 8, 2048), ("bulk_s4_c4096", 4, 4096),
        ("bulk_s4_c8192", 4, 8192)]
COLS = ["shape", "bytes", "arm", "kernel", "warps_per_sm", "graph_us", "gbps", "pct_read"]


def shape_bytes(fmt: str, n: int, k: int) -> int:
    """Packed bytes of one QPN weight (NVFP4: codes + e4m3 group scales; FP8: codes), rounded to
    whole 8 KB chunks (the probe kernels read whole chunks)."""
    nb = n * k // 2 + n * k // 16 if fmt == "nvfp4" else n * k
    return -(-nb // 8192) * 8192


def build(arch: int) -> jit.LoadedModule:
    nv = jit.nvrtc_for_arch(arch)
    res = nv.compile(SOURCE, "read_probe.cu", arch, list(jit.COMPILE_FLAGS), want_cubin=True)
    return jit.LoadedModule(res.cubin, "read_probe", arch)


# The pure-read configurations that came out best on the H200 (results/read_probe_h200_20261201.csv):
# (kernel, blocks of 256 threads per SM). kernel_matched_bench's read_limit arm takes the fastest.
LIMIT_CONFIGS = (("grid_stride_d4", 8), ("grid_stride_d8", 8), ("grid_stride_d4", 4), ("block_runs_d4", 8),
                 ("warp_runs_d16", 8), ("warp_runs_d8", 4))


class ReadProbe:
    """The probe kernels, built for this GPU; ``best``: the fastest single kernel that only reads a
    given number of bytes (no compute), over rotated copies -- how close to the read ceiling any
    kernel of a layer's size gets, timed like the arms."""

    def __init__(self):
        cap = torch.cuda.get_device_capability(0)
        self.arch = cap[0] * 10 + cap[1]
        self.mod = build(self.arch)
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.out = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")

    def call(self, bufs, kernel: str, grid: int, block: int = 256, smem: int = 0):
        """fn(i): one launch of ``kernel`` reading bufs[i % len(bufs)] (uint8, whole 8 KB chunks)."""
        if smem > 48 * 1024:
            jit.allow_dynamic_smem(self.mod, kernel, smem)
        nblk = ctypes.c_longlong(bufs[0].numel() // 512)
        optr = ctypes.c_void_p(self.out.data_ptr())
        ptrs = [ctypes.c_void_p(b.data_ptr()) for b in bufs]

        def fn(i):
            jit.launch(self.mod, kernel, grid, block, smem, torch.cuda.current_stream().cuda_stream,
                       [ptrs[i % len(ptrs)], nblk, optr])
        return fn

    def best(self, bufs, timer) -> tuple[str, object]:
        """(description, fn) of the fastest LIMIT_CONFIGS entry on these buffers under ``timer``."""
        timed = []
        for kernel, bps in LIMIT_CONFIGS:
            fn = self.call(bufs, kernel, self.sms * bps)
            timed.append((timer(fn), f"{kernel} {8 * bps} warps/SM", fn))
        t, desc, fn = min(timed, key=lambda x: x[0])
        return desc, fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(kmb.SHAPES))
    ap.add_argument("--commit", default="")
    ap.add_argument("--no-bulk", action="store_true", help="skip the bulk-copy arm")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("read_probe: no CUDA device", file=sys.stderr)
        return 2
    torch.cuda.current_stream().synchronize()
    probe = ReadProbe()
    sms = probe.sms
    read, _copy = kmb.ceilings()
    print(f"read ceiling {read:.1f} GB/s", flush=True)
    rows = []

    def add(shape, nbytes, arm, kernel, wps, ms):
        gbps = nbytes / (ms * 1e-3) / 1e9
        rows.append(dict(shape=shape, bytes=nbytes, arm=arm, kernel=kernel, warps_per_sm=wps,
                         graph_us=round(ms * 1e3, 2), gbps=round(gbps, 1), pct_read=round(100 * gbps / read, 2)))
        print(f"{shape:22s} {nbytes / 1e6:8.1f} MB {arm:12s} {kernel:18s} w/SM {wps:3d} "
              f"{ms * 1e3:9.2f} us {100 * gbps / read:6.1f}%", flush=True)

    for shape in args.shapes.split(","):
        fmt, n, k = kmb.SHAPES[shape]
        nbytes = shape_bytes(fmt, n, k)
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
                for _ in range(kmb._copies(nbytes))]
        f32 = [b.view(torch.float32) for b in bufs]
        add(shape, nbytes, "torch_sum", "-", 0, kmb.time_graph(lambda i: f32[i % len(f32)].sum()))
        for arm, ks in KERNELS.items():
            for name, _d in ks:
                for bps in (2, 4, 8):  # blocks of 256 threads per SM: 16 / 32 / 64 warps per SM
                    add(shape, nbytes, arm, name, 8 * bps, kmb.time_graph(probe.call(bufs, name, sms * bps)))
        if fmt == "nvfp4" and k == 5120:
            for name, _d in QPN_PATTERN:
                for bps in (2, 4):
                    add(shape, nbytes, "qpn_pattern", name, 8 * bps,
                        kmb.time_graph(probe.call(bufs, name, sms * bps)))
        if probe.arch >= 90 and not args.no_bulk:
            for name, s, c in BULK:
                for warps in (4, 8):  # warps per block, one block per SM unless two fit
                    smem = warps * (s * c + 8 * s)
                    if smem > jit.max_smem_optin(0):
                        continue
                    add(shape, nbytes, "bulk", name, warps,
                        kmb.time_graph(probe.call(bufs, name, sms, 32 * warps, smem)))
                    if 2 * smem <= 227 * 1024:
                        add(shape, nbytes, "bulk", name, 2 * warps,
                            kmb.time_graph(probe.call(bufs, name, 2 * sms, 32 * warps, smem)))
        del bufs, f32
        torch.cuda.empty_cache()

    header = [ln if not ln.startswith("# command:") else
              "# command: " + kmb._command("qpn.benchmarks.read_probe")
              for ln in kmb.provenance(argparse.Namespace(commit=args.commit), "none")
              if not ln.startswith(("# qpn atom", "# *_gbps"))]
    header.append(f"# read_ceiling_gbps: {read:.1f}")
    with open(args.out, "w", newline="") as f:
        f.write("\n".join(header) + "\n")
        w = csv.DictWriter(f, fieldnames=COLS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
