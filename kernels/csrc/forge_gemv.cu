// SPDX-License-Identifier: Apache-2.0
// Decode GEMV and skinny GEMM for M = 1..16 rows: y = x @ W^T with bf16 W (N, K) row-major, bf16 x (M, K), fp32
// accumulation, bf16 y (M, N); and the fused MLP variant y[m, i] = silu(x.Wg_i) * (x.Wu_i) with
// W = [Wg; Wu] of shape (2*I, K) (vLLM's MergedColumnParallelLinear gate_up layout), y (M, I).
//
// Layout and grid (kernels/NOTES.md, "Decode GEMV"):
//   grid.x = ceil(N_out / ROWS) blocks of BLOCK threads; block b owns output rows [b*ROWS, b*ROWS+ROWS)
//   (the fused variant reads 2*ROWS weight rows: gate rows i and up rows I + i).
//   Split along K, strided: thread t reads the 16-byte vectors t, t + BLOCK, t + 2*BLOCK, ... of each
//   of its block's weight rows, so one wavefront reads WARP*16 contiguous bytes of a row per load and
//   a block sweeps BLOCK*16 contiguous bytes (K = 5120 is one sweep at BLOCK = 640). The ROWS rows are
//   loaded together (independent loads in flight); x is read once per K chunk and reused for all rows.
//   At 3-4 rows of x (four FMAs per weight element) with 1-2 weight rows per thread, the next chunk's
//   weight loads are issued before this chunk's FMAs (software pipeline), x loaded when used; with four
//   or more weight rows per thread the CUDA build gives the compiler a wide register budget (WideRegs).
//   At 5-16 rows of x (MT = 8 or 16) a thread still reads each of its weight vectors once and applies it to
//   all M rows: the rows of x are walked one 16-byte vector at a time (one x vector live, not MT), rows past
//   M are skipped (uniform branch), and the next chunk's weight loads are in flight during the FMAs.
//   Reduction: ROWS*MT partial sums per thread are reduced inside the wavefront with a halving
//   exchange (each xor-shuffle step halves the values a lane keeps: NV-1 shuffles instead of
//   NV*log2(WARP)), then across wavefronts through LDS; one thread per (row, m) writes the output.
//   Bytes moved: N*K*2 (W, read once) + M*K*2 (x, cached) + M*N*2 (y).
// Odd K (K % 8 != 0) or unaligned pointers take the scalar path (2-byte loads, same reduction):
//   correct for any K >= 1, slower; the decode shapes of Qwen3.5-27B all take the vector path.
//
// One source for HIP (wave64 on gfx9/gfx936: FORGE_WARP = 64) and CUDA (warp32): no inline
// assembly; warp shuffles through one macro. No allocation, no host sync (CUDA-graph safe).
//
// Build modes
//   torch extension (default): forge_gemv(out, x, w, block, rows) and forge_gemv_silu_mul(out, x, w,
//     block, rows) (block = rows = 0: the built-in choice for the device). Registered as
//     torch.ops._C.forge_gemv / forge_gemv_silu_mul when built into vLLM's _C (FORGE_IN_VLLM: vLLM's
//     torch_bindings.cpp declares them), else, when TORCH_EXTENSION_NAME is defined
//     (torch.utils.cpp_extension.load(..., is_python_module=False)), as torch.ops.<TORCH_EXTENSION_NAME>.*
//     through TORCH_LIBRARY with the same schemas. No pybind11 module: its exception translation,
//     compiled by nvcc and sharing torch's pybind11 internals, is not the path vLLM uses, and a refused
//     configuration (a TORCH_CHECK) has to reach Python as a RuntimeError through torch's dispatcher.
//   -DFORGE_STANDALONE: no torch headers; exports the C launcher forge_gemv_raw(...) (compile checks).

#include <stdint.h>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
typedef hipStream_t forge_stream_t;
#define FORGE_LAUNCH_ERROR() hipGetLastError()
#define FORGE_SUCCESS hipSuccess
typedef hipError_t forge_err_t;
#define FORGE_ON_AMD 1
#else
#include <cuda_runtime.h>
typedef cudaStream_t forge_stream_t;
#define FORGE_LAUNCH_ERROR() cudaGetLastError()
#define FORGE_SUCCESS cudaSuccess
typedef cudaError_t forge_err_t;
#define FORGE_ON_AMD 0
#endif

// Wavefront / warp width seen by device code. gfx9 and gfx936 run wave64; a wave32 AMD target
// (gfx10+) reports 32 through the compiler's macro.
#if FORGE_ON_AMD
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define FORGE_WARP __AMDGCN_WAVEFRONT_SIZE
#else
#define FORGE_WARP 64
#endif
#define FORGE_SHFL_XOR(v, m) __shfl_xor((v), (m), FORGE_WARP)
#else
#define FORGE_WARP 32
#define FORGE_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m), 32)
#endif

namespace fgemv {

constexpr int kMaxM = 16;

// bf16 bits -> fp32 (exact)
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float bf16_at(const uint16_t* p) { return __uint_as_float(static_cast<uint32_t>(*p) << 16); }

// fp32 -> bf16 bits, round to nearest even; NaN stays NaN
__device__ __forceinline__ uint16_t to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

struct Params {
  const uint16_t* x;  // (M, K), row stride x_stride (elements)
  const uint16_t* w;  // (N_w, K) contiguous
  uint16_t* out;      // (M, N_out), row stride out_stride (elements)
  int M, K, n_out;    // n_out: N (plain) or I (fused; w has 2*I rows)
  int64_t x_stride, out_stride;
};

// Sum NV values across the lanes of a wavefront. On return lane l < 2^S (S = min(log2 NV,
// log2 WARP)) holds the full sums of values base(l) + i, i < NV >> S, in v[i], where base(l) =
// sum_j bit_j(l) * NV >> (j + 1). Every lane of the wavefront must call it (no divergence).
template <int NV>
__device__ __forceinline__ void warp_reduce(float (&v)[NV], int lane) {
  static_assert((NV & (NV - 1)) == 0, "NV must be a power of two");
#pragma unroll
  for (int st = 0; (1 << st) < FORGE_WARP; ++st) {
    const int off = 1 << st;
    const int h = NV >> (st + 1);  // values handed over at this step (0: plain reduction)
    if (h > 0) {
      const bool upper = (lane & off) != 0;
#pragma unroll
      for (int i = 0; i < (h > 0 ? h : 1); ++i) {
        const float send = upper ? v[i] : v[i + h];
        const float keep = upper ? v[i + h] : v[i];
        v[i] = keep + FORGE_SHFL_XOR(send, off);
      }
    } else {
      v[0] += FORGE_SHFL_XOR(v[0], off);
    }
  }
}

template <int N> struct Log2 { static constexpr int value = 1 + Log2<N / 2>::value; };
template <> struct Log2<1> { static constexpr int value = 0; };

// acc[r * MT + m] += sum_j w_r[j] * x_m[j] over one 16-byte vector (8 bf16) of each row
template <int NWR, int MT>
__device__ __forceinline__ void fma_chunk(float (&acc)[NWR * MT], const uint4 (&wv)[NWR], const uint4 (&xv)[MT]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const uint32_t xq = j == 0 ? xv[m].x : j == 1 ? xv[m].y : j == 2 ? xv[m].z : xv[m].w;
      const float xlo = bf16_lo(xq), xhi = bf16_hi(xq);
#pragma unroll
      for (int r = 0; r < NWR; ++r) {
        const uint32_t wq = j == 0 ? wv[r].x : j == 1 ? wv[r].y : j == 2 ? wv[r].z : wv[r].w;
        acc[r * MT + m] = fmaf(bf16_lo(wq), xlo, acc[r * MT + m]);
        acc[r * MT + m] = fmaf(bf16_hi(wq), xhi, acc[r * MT + m]);
      }
    }
  }
}

// acc[r * MT + m] += sum_j w_r[j] * x_m[j] for MT = 8 or 16 rows of x: m outer, so one x vector is live at a
// time (MT x vectors at once would cost MT*4 registers); rows m >= M are skipped (M is uniform in the block).
template <int NWR, int MT>
__device__ __forceinline__ void fma_chunk_rows(float (&acc)[NWR * MT], const uint4 (&wv)[NWR], const uint16_t* x,
                                               int64_t x_stride, int kv, int M) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m >= M) break;  // uniform in the block; rows past M are never read
    {
      const uint4 xv = reinterpret_cast<const uint4*>(x + m * x_stride)[kv];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t xq = j == 0 ? xv.x : j == 1 ? xv.y : j == 2 ? xv.z : xv.w;
        const float xlo = bf16_lo(xq), xhi = bf16_hi(xq);
#pragma unroll
        for (int r = 0; r < NWR; ++r) {
          const uint32_t wq = j == 0 ? wv[r].x : j == 1 ? wv[r].y : j == 2 ? wv[r].z : wv[r].w;
          acc[r * MT + m] = fmaf(bf16_lo(wq), xlo, acc[r * MT + m]);
          acc[r * MT + m] = fmaf(bf16_hi(wq), xhi, acc[r * MT + m]);
        }
      }
    }
  }
}

// Register budget. At 3-4 rows of x with four or more weight rows per thread the CUDA build lets the
// compiler take the registers it wants (launch bounds (BLOCK, 1): 96 registers at four rows, 164 at
// eight); given only the block size, ptxas keeps 72 there and the four-row launches run 1.5x slower at
// 5120 x 6144 and 5120 x 17408 (H200, reports/kernels/gemv/README.md, "Three and four rows"). Every other
// kernel keeps the compiler's own choice, which was faster for it (the pipelined two-row loop, the one-row
// launches at one or two rows of x). The AMD build is unchanged: HIP's second launch bound means waves per
// execution unit, and no budget has been measured on gfx936.
template <int ROWS, int MT, bool SILU>
struct WideRegs {
  static constexpr bool value = !FORGE_ON_AMD && MT == 4 && (SILU ? 2 : 1) * ROWS >= 4;
};

// BLOCK threads, ROWS output rows per block, MT = x rows computed (M <= MT; rows >= M read as 0 and
// are not stored), SILU: fused gate/up, VEC: 16-byte loads (K % 8 == 0, aligned) or 2-byte loads.
template <int BLOCK, int ROWS, int MT, bool SILU, bool VEC>
__device__ __forceinline__ void gemv_body(const Params& p) {
  constexpr int NWR = SILU ? 2 * ROWS : ROWS;  // weight rows read per block
  constexpr int NV = NWR * MT;                 // partial sums per thread, index r * MT + m
  constexpr int NWARPS = BLOCK / FORGE_WARP;
  constexpr int S = Log2<NV>::value < Log2<FORGE_WARP>::value ? Log2<NV>::value : Log2<FORGE_WARP>::value;
  constexpr int PER_LANE = NV >> S;
  static_assert(BLOCK % FORGE_WARP == 0, "BLOCK must be a multiple of the wavefront width");
  static_assert(NV <= BLOCK, "one thread per output value in the final step");
  __shared__ float red[NWARPS][NV];

  const int tid = threadIdx.x;
  const int lane = tid % FORGE_WARP;
  const int warp = tid / FORGE_WARP;
  const int row0 = blockIdx.x * ROWS;

  // weight row pointers; rows past the end are clamped to a valid row (their sums are not stored)
  const uint16_t* wr[NWR];
#pragma unroll
  for (int r = 0; r < NWR; ++r) {
    const int o = r % ROWS;
    int row = row0 + o < p.n_out ? row0 + o : p.n_out - 1;
    if (SILU && r >= ROWS) row += p.n_out;
    wr[r] = p.w + static_cast<int64_t>(row) * p.K;
  }
  const uint16_t* xr[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) xr[m] = p.x + static_cast<int64_t>(m < p.M ? m : 0) * p.x_stride;

  float acc[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) acc[i] = 0.f;

  if (VEC) {
    const int K8 = p.K >> 3;
    // U chunks per iteration: U*NWR 16-byte weight loads in flight per thread when registers allow
    constexpr int U = (NWR <= 4 && NV <= 8 && MT <= 4) ? 2 : 1;
    int kv = tid;
    // 5-16 x-rows (MT = 8, 16): 8-16 FMAs per weight element. The next chunk's weight vectors are loaded
    // before this chunk's FMAs (as PIPE_W below), and x is walked one row vector at a time (fma_chunk_rows).
    // FORGE_GEMV_ROWS_NOPIPE (a build macro, for an A/B) loads each chunk's weights when used instead.
#if defined(FORGE_GEMV_ROWS_NOPIPE)
    constexpr bool PIPE_ROWS = false;
#else
    constexpr bool PIPE_ROWS = true;
#endif
    if (MT >= 8) {
      if (PIPE_ROWS && kv < K8) {
        uint4 w0[NWR];
#pragma unroll
        for (int r = 0; r < NWR; ++r) w0[r] = reinterpret_cast<const uint4*>(wr[r])[kv];
        for (;;) {
          const int next = kv + BLOCK;
          uint4 wn[NWR];
          if (next < K8) {
#pragma unroll
            for (int r = 0; r < NWR; ++r) wn[r] = reinterpret_cast<const uint4*>(wr[r])[next];
          }
          fma_chunk_rows<NWR, MT>(acc, w0, p.x, p.x_stride, kv, p.M);
          if (next >= K8) break;
#pragma unroll
          for (int r = 0; r < NWR; ++r) w0[r] = wn[r];
          kv = next;
        }
      }
      for (; !PIPE_ROWS && kv < K8; kv += BLOCK) {
        uint4 wv[NWR];
#pragma unroll
        for (int r = 0; r < NWR; ++r) wv[r] = reinterpret_cast<const uint4*>(wr[r])[kv];
        fma_chunk_rows<NWR, MT>(acc, wv, p.x, p.x_stride, kv, p.M);
      }
      kv = K8;  // done; skips the loops below
    }
    // 3-4 x-rows: four FMAs per weight element, so a load-then-compute loop leaves the memory idle while
    // a thread computes. Here the next chunk's weight loads are issued before this chunk's FMAs (a
    // software pipeline); x is loaded when used (an L1 hit), so only weight vectors are buffered. One or
    // two weight rows per thread and blocks up to 512 threads: with four rows the extra registers cost
    // more occupancy than the pipeline gains, and a prefetch distance of 2 was slower (H200,
    // reports/kernels/gemv/README.md).
    constexpr bool PIPE_W = MT == 4 && NWR <= 2 && BLOCK <= 512;
    if (PIPE_W) {
      if (kv < K8) {
        uint4 w0[NWR];
#pragma unroll
        for (int r = 0; r < NWR; ++r) w0[r] = reinterpret_cast<const uint4*>(wr[r])[kv];
        for (;;) {
          const int next = kv + BLOCK;
          uint4 wn[NWR];
          if (next < K8) {
#pragma unroll
            for (int r = 0; r < NWR; ++r) wn[r] = reinterpret_cast<const uint4*>(wr[r])[next];
          }
          uint4 xv[MT];
#pragma unroll
          for (int m = 0; m < MT; ++m)
            xv[m] = m < p.M ? reinterpret_cast<const uint4*>(xr[m])[kv] : make_uint4(0u, 0u, 0u, 0u);
          fma_chunk<NWR, MT>(acc, w0, xv);
          if (next >= K8) break;
#pragma unroll
          for (int r = 0; r < NWR; ++r) w0[r] = wn[r];
          kv = next;
        }
      }
      kv = K8;  // done; skips the loops below
    }
    for (; kv + (U - 1) * BLOCK < K8; kv += U * BLOCK) {
      uint4 wv[U][NWR];
      uint4 xv[U][MT];
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int r = 0; r < NWR; ++r) wv[u][r] = reinterpret_cast<const uint4*>(wr[r])[kv + u * BLOCK];
#pragma unroll
        for (int m = 0; m < MT; ++m)
          xv[u][m] = m < p.M ? reinterpret_cast<const uint4*>(xr[m])[kv + u * BLOCK] : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) fma_chunk<NWR, MT>(acc, wv[u], xv[u]);
    }
    if (U > 1 && kv < K8) {  // the last odd chunk
      uint4 wv[NWR];
      uint4 xv[MT];
#pragma unroll
      for (int r = 0; r < NWR; ++r) wv[r] = reinterpret_cast<const uint4*>(wr[r])[kv];
#pragma unroll
      for (int m = 0; m < MT; ++m)
        xv[m] = m < p.M ? reinterpret_cast<const uint4*>(xr[m])[kv] : make_uint4(0u, 0u, 0u, 0u);
      fma_chunk<NWR, MT>(acc, wv, xv);
    }
  } else {
    for (int k = tid; k < p.K; k += BLOCK) {
      float xs[MT];
#pragma unroll
      for (int m = 0; m < MT; ++m) xs[m] = m < p.M ? bf16_at(xr[m] + k) : 0.f;
#pragma unroll
      for (int r = 0; r < NWR; ++r) {
        const float wk = bf16_at(wr[r] + k);
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[r * MT + m] = fmaf(wk, xs[m], acc[r * MT + m]);
      }
    }
  }

  warp_reduce<NV>(acc, lane);
  if (lane < (1 << S)) {
    int base = 0;
#pragma unroll
    for (int j = 0; j < S; ++j) base += ((lane >> j) & 1) * (NV >> (j + 1));
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) red[warp][base + i] = acc[i];
  }
  __syncthreads();
  if (tid < ROWS * MT) {
    const int r = tid / MT, m = tid % MT;
    const int row = row0 + r;
    float s = 0.f;
#pragma unroll 4
    for (int wi = 0; wi < NWARPS; ++wi) s += red[wi][r * MT + m];
    if (SILU) {
      float u = 0.f;
#pragma unroll 4
      for (int wi = 0; wi < NWARPS; ++wi) u += red[wi][(r + ROWS) * MT + m];
      s = silu(s) * u;
    }
    if (row < p.n_out && m < p.M) p.out[static_cast<int64_t>(m) * p.out_stride + row] = to_bf16(s);
  }
}

template <int BLOCK, int ROWS, int MT, bool SILU, bool VEC>
__global__ void __launch_bounds__(BLOCK) gemv_kernel(const Params p) {
  gemv_body<BLOCK, ROWS, MT, SILU, VEC>(p);
}
template <int BLOCK, int ROWS, int MT, bool SILU, bool VEC>
__global__ void __launch_bounds__(BLOCK, 1) gemv_kernel_wide(const Params p) {
  gemv_body<BLOCK, ROWS, MT, SILU, VEC>(p);
}
// the entry point for a configuration: its register budget (WideRegs) picks the launch bounds
template <int BLOCK, int ROWS, int MT, bool SILU, bool VEC, bool WIDE = WideRegs<ROWS, MT, SILU>::value>
struct Entry {
  static void go(dim3 grid, const Params& p, forge_stream_t s) {
    gemv_kernel<BLOCK, ROWS, MT, SILU, VEC><<<grid, BLOCK, 0, s>>>(p);
  }
};
template <int BLOCK, int ROWS, int MT, bool SILU, bool VEC>
struct Entry<BLOCK, ROWS, MT, SILU, VEC, true> {
  static void go(dim3 grid, const Params& p, forge_stream_t s) {
    gemv_kernel_wide<BLOCK, ROWS, MT, SILU, VEC><<<grid, BLOCK, 0, s>>>(p);
  }
};

// ---------------------------------------------------------------------------------------------
// Launch menu. block in {64, 128, 256, 512, 640, 768}, rows in {1, 2, 4, 8} (fused: {1, 2, 4}) (see Built);
// (0, 0) = the built-in choice below. Returns 0, -2 for a config outside the menu, or a CUDA/HIP
// error code.

inline bool divides(int a, int b) { return b > 0 && a % b == 0; }

// Built-in choice. NVIDIA: at the Qwen3.5-27B decode shapes, the fastest (block, rows) the benchmark
// found on an H200 (kernels/bench/bench_gemv.py, 2026-12-02, the run with the pipelined loop at 3-4
// rows, 64-thread blocks and the wide register budget: reports/kernels/gemv/bench_gemv.json); M = 3 takes
// M = 4's entry (the same MT = 4 kernel). Elsewhere: 256 threads when it divides K/8, else 128, and 4
// rows per block (fused: 2). AMD (wave64): one block covers a whole row of 16-byte vectors when K/8 is
// a block size of the menu (K = 5120: 640 threads, as measured fastest on gfx936; K = 6144: 768); else
// the largest of 512/256/128 dividing K/8 (K = 17408: 128). Few output rows (in_proj_ba: 96): one row
// per block for more blocks.
// Rows of x 5-16 (MT = 8, 16) have no tuned entry yet (0: the generic choice below).
struct TunedConfig {
  int n_out, K;
  bool silu;
  short block[3], rows[3];  // M = 1, 2, 3..4
};
constexpr TunedConfig kTunedCuda[] = {
    {14336, 5120, false, {640, 64, 64}, {4, 4, 2}},     // full-attention qkv + gate
    {5120, 6144, false, {128, 64, 64}, {1, 4, 4}},      // o_proj, GDN out_proj
    {16384, 5120, false, {640, 128, 64}, {4, 4, 2}},    // GDN in_proj_qkvz
    {96, 5120, false, {640, 640, 512}, {4, 4, 2}},      // GDN in_proj_ba
    {34816, 5120, false, {640, 128, 64}, {4, 4, 2}},    // MLP gate_up (unfused)
    {5120, 17408, false, {128, 64, 64}, {1, 4, 4}},     // MLP down
    {248320, 5120, false, {128, 128, 64}, {1, 4, 2}},   // LM head
    {17408, 5120, true, {128, 128, 64}, {1, 2, 1}},     // fused gate_up + SiLU-and-mul (I = 17408)
};

inline void default_config(int M, int K, int n_out, bool silu, bool on_amd, int* block, int* rows) {
  const int k8 = K / 8;
  if (!on_amd && M <= 4) {
    const int mi = M <= 1 ? 0 : M == 2 ? 1 : 2;
    for (const TunedConfig& t : kTunedCuda) {
      if (t.n_out == n_out && t.K == K && t.silu == silu) {
        *block = t.block[mi];
        *rows = t.rows[mi];
        return;
      }
    }
  }
  int b;
  if (on_amd) {
    if (k8 == 256 || k8 == 512 || k8 == 640 || k8 == 768) b = k8;
    else if (divides(k8, 512)) b = 512;
    else if (divides(k8, 256)) b = 256;
    else b = 128;
  } else {
    b = M > 4 ? 128 : divides(k8, 256) ? 256 : 128;
  }
  // 5-16 rows of x: the most partial sums per thread built (Built): 32 on NVIDIA (MT = 8: 4 weight rows,
  // MT = 16: 2), 16 on AMD; the fused kernel at 9-16 rows is not built on AMD (refused)
  const int nv_max = on_amd ? 16 : 32;
  int r = M > 4 ? nv_max / ((M > 8 ? 16 : 8) * (silu ? 2 : 1)) : silu ? 2 : 4;
  if (r < 1) r = 1;
  // few output rows (in_proj_ba: 96): fewer rows per block for more blocks
  if (n_out / r < 64) r = 1;
  *block = b;
  *rows = r;
}

// Configurations built. MT <= 4: every (block, rows, M) except 32 partial sums per thread (8 weight rows at
// M = 3..4) on AMD, or with blocks of 640 threads or more on NVIDIA: those spill registers (or use
// scratch memory on gfx9). MT = 8, 16 (5-16 rows of x, one x vector live at a time): at most 16 partial
// sums per thread, and 32 on NVIDIA in blocks of up to 256 threads (larger blocks cap ptxas at 96 or 80
// registers: spills; 64 sums went to local memory on sm_90 with nvcc 13.0; 32 go to scratch on gfx90a, as
// at M = 3..4). So on AMD the fused kernel (2 weight rows per output row) stops at M = 8.
template <int BLOCK, int ROWS, int MT, bool SILU>
struct Built {
  static constexpr int NV = (SILU ? 2 : 1) * ROWS * MT;
  static constexpr bool value = MT <= 4 ? ((!FORGE_ON_AMD && BLOCK < 640) || NV <= 16)
                                        : (NV <= 16 || (!FORGE_ON_AMD && BLOCK <= 256 && NV <= 32));
};

template <int BLOCK, int ROWS, int MT, bool SILU, bool VEC, bool OK = Built<BLOCK, ROWS, MT, SILU>::value>
struct Launcher {
  static int go(const Params& p, forge_stream_t stream) {
    const dim3 grid((p.n_out + ROWS - 1) / ROWS);
    Entry<BLOCK, ROWS, MT, SILU, VEC>::go(grid, p, stream);
    return 0;
  }
};
template <int BLOCK, int ROWS, int MT, bool SILU, bool VEC>
struct Launcher<BLOCK, ROWS, MT, SILU, VEC, false> {
  static int go(const Params&, forge_stream_t) { return -2; }
};

template <int BLOCK, int ROWS, bool SILU, bool VEC>
inline int launch_mt(const Params& p, forge_stream_t stream) {
  if (p.M <= 1) return Launcher<BLOCK, ROWS, 1, SILU, VEC>::go(p, stream);
  if (p.M <= 2) return Launcher<BLOCK, ROWS, 2, SILU, VEC>::go(p, stream);
  if (p.M <= 4) return Launcher<BLOCK, ROWS, 4, SILU, VEC>::go(p, stream);
  if (p.M <= 8) return Launcher<BLOCK, ROWS, 8, SILU, VEC>::go(p, stream);
  return Launcher<BLOCK, ROWS, 16, SILU, VEC>::go(p, stream);
}

template <int BLOCK, bool SILU>
inline int launch_rows(const Params& p, int rows, forge_stream_t stream) {
  switch (rows) {
    case 1: return launch_mt<BLOCK, 1, SILU, true>(p, stream);
    case 2: return launch_mt<BLOCK, 2, SILU, true>(p, stream);
    case 4: return launch_mt<BLOCK, 4, SILU, true>(p, stream);
    case 8: return SILU ? -2 : launch_mt<BLOCK, SILU ? 4 : 8, SILU, true>(p, stream);
    default: return -2;
  }
}

// vec: 16-byte path; otherwise the scalar path (block 256, one row per block; config ignored).
inline int launch(const Params& p, bool silu, bool vec, int block, int rows, bool on_amd, forge_stream_t stream) {
  if (p.M < 1 || p.M > kMaxM || p.K < 1) return -3;
  if (p.n_out <= 0) return 0;
  if (block == 0 || rows == 0) {
    int b, r;
    default_config(p.M, p.K, p.n_out, silu, on_amd, &b, &r);
    if (block == 0) block = b;
    if (rows == 0) rows = r;
  }
  int rc = 0;
  if (!vec) {
    rc = silu ? launch_mt<256, 1, true, false>(p, stream) : launch_mt<256, 1, false, false>(p, stream);
  } else {
#define FORGE_GEMV_BLOCK_CASE(B) \
  case B: rc = silu ? launch_rows<B, true>(p, rows, stream) : launch_rows<B, false>(p, rows, stream); break;
    switch (block) {
      FORGE_GEMV_BLOCK_CASE(64)
      FORGE_GEMV_BLOCK_CASE(128)
      FORGE_GEMV_BLOCK_CASE(256)
      FORGE_GEMV_BLOCK_CASE(512)
      FORGE_GEMV_BLOCK_CASE(640)
      FORGE_GEMV_BLOCK_CASE(768)
      default: rc = -2;
    }
#undef FORGE_GEMV_BLOCK_CASE
  }
  if (rc != 0) return rc;
  forge_err_t e = FORGE_LAUNCH_ERROR();
  return e == FORGE_SUCCESS ? 0 : static_cast<int>(e);
}

// Text of a launch result (negative: this file's codes; positive: the CUDA/HIP error).
inline const char* launch_error_text(int rc) {
  if (rc == -2) return "configuration not built";
  if (rc == -3) return "M outside 1..16 or K < 1";
#if FORGE_ON_AMD
  return hipGetErrorString(static_cast<hipError_t>(rc));
#else
  return cudaGetErrorString(static_cast<cudaError_t>(rc));
#endif
}

inline bool vec_ok(const void* x, int64_t x_stride, const void* w, int K) {
  return K % 8 == 0 && x_stride % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15u) == 0 &&
         (reinterpret_cast<uintptr_t>(w) & 15u) == 0;
}

}  // namespace fgemv

#ifdef FORGE_STANDALONE
// C launcher (compile checks; ctypes). x (M, K) bf16 row stride x_stride, w (N_w, K) bf16 contiguous,
// out (M, n_out) bf16 row stride out_stride; silu: w has 2*n_out rows. Returns 0 on success,
// -2 for a block/rows outside the menu, -3 for M outside 1..16 or K < 1, else a CUDA/HIP error code.
extern "C" int forge_gemv_raw(const void* x, const void* w, void* out, int M, int K, int n_out,
                              int64_t x_stride, int64_t out_stride, int silu, int block, int rows, void* stream) {
  fgemv::Params p;
  p.x = static_cast<const uint16_t*>(x); p.w = static_cast<const uint16_t*>(w);
  p.out = static_cast<uint16_t*>(out);
  p.M = M; p.K = K; p.n_out = n_out; p.x_stride = x_stride; p.out_stride = out_stride;
  return fgemv::launch(p, silu != 0, fgemv::vec_ok(x, x_stride, w, K), block, rows, FORGE_ON_AMD,
                            static_cast<forge_stream_t>(stream));
}
#else
// The torch glue is written as vLLM's own csrc/activation_kernels.cu and csrc/cache_kernels.cu write
// theirs (the current stream from ATen/cuda/CUDAContext.h, the device guard from c10/cuda/CUDAGuard.h),
// so the hipify step of vLLM's ROCm build meets only names it already maps for vLLM's own kernels.
// Built as a torch extension of its own (tests, benchmark, the GPU harness), the stream comes from
// c10/cuda/CUDAStream.h instead: the same names, without the cuBLAS/cuSPARSE/cuSOLVER headers
// CUDAContext.h pulls in, which a CUDA install with nvcc alone lacks.
#if defined(FORGE_IN_VLLM)
#include <ATen/cuda/CUDAContext.h>
#else
#include <c10/cuda/CUDAStream.h>
#endif
#include <torch/all.h>
#if !defined(FORGE_IN_VLLM) && defined(TORCH_EXTENSION_NAME)
#include <torch/library.h>
#endif
#include <c10/cuda/CUDAGuard.h>

namespace fgemv {
inline void run_op(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w, int64_t block, int64_t rows,
                   bool silu, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              name, ": x, w and out must be bfloat16 (got ", x.scalar_type(), ", ", w.scalar_type(), ", ",
              out.scalar_type(), ")");
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && out.is_cuda(), name, ": tensors must be on the GPU");
  TORCH_CHECK(x.device() == w.device() && x.device() == out.device(), name, ": tensors on different devices");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, name, ": x (M, K), w (N, K), out (M, N) expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxM, name, ": M = ", M, " rows; this kernel handles 1..", kMaxM);
  TORCH_CHECK(w.size(1) == K && K >= 1, name, ": w has K = ", w.size(1), ", x has K = ", K);
  TORCH_CHECK(w.is_contiguous(), name, ": w must be contiguous (row-major (N, K))");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, name, ": x and out need a contiguous last dimension");
  int64_t n_out = w.size(0);
  if (silu) {
    TORCH_CHECK(n_out % 2 == 0, name, ": w must have 2*I rows ([gate; up]), got ", n_out);
    n_out /= 2;
  }
  TORCH_CHECK(out.size(0) == M && out.size(1) == n_out, name, ": out must be (", M, ", ", n_out, "), got (",
              out.size(0), ", ", out.size(1), ")");
  TORCH_CHECK(w.size(0) < (int64_t(1) << 31) && K < (int64_t(1) << 31), name, ": shape too large");
  const at::cuda::OptionalCUDAGuard device_guard(device_of(x));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  Params p;
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  p.w = reinterpret_cast<const uint16_t*>(w.data_ptr());
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  p.M = static_cast<int>(M); p.K = static_cast<int>(K); p.n_out = static_cast<int>(n_out);
  // a single row's stride is meaningless (torch may report any value for a size-1 dimension)
  p.x_stride = M == 1 ? K : x.stride(0);
  p.out_stride = M == 1 ? n_out : out.stride(0);
  const bool vec = vec_ok(p.x, p.x_stride, p.w, p.K);
  const int rc = launch(p, silu, vec, static_cast<int>(block), static_cast<int>(rows), FORGE_ON_AMD, stream);
  TORCH_CHECK(rc != -2, name, ": block = ", block, ", rows = ", rows,
              " is not built for M = ", M, " (block 0/64/128/256/512/640/768, rows 0/1/2/4/8, fused rows 0/1/2/4;",
              " partial sums per thread (fused: 2) x rows x (M rounded up to 1/2/4/8/16): at most 16 at M 3-4 on",
              " AMD or block >= 640, at most 32 at M 5-16 (NVIDIA blocks <= 256: 64))");
  TORCH_CHECK(rc == 0, name, ": launch failed with error ", rc, " (", launch_error_text(rc), ") for M = ", M,
              ", K = ", K, ", N = ", n_out, ", block = ", block, ", rows = ", rows);
}
}  // namespace fgemv

// out (M, N) = x (M, K) @ w (N, K)^T, bf16, M = 1..16. block/rows: 0 = built-in choice.
void forge_gemv(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w, int64_t block, int64_t rows) {
  fgemv::run_op(out, x, w, block, rows, false, "forge_gemv");
}

// out (M, I) = silu(x @ w[:I]^T) * (x @ w[I:]^T), w (2*I, K) = [gate; up], bf16, M = 1..16.
void forge_gemv_silu_mul(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w, int64_t block,
                         int64_t rows) {
  fgemv::run_op(out, x, w, block, rows, true, "forge_gemv_silu_mul");
}

#if defined(TORCH_EXTENSION_NAME) && !defined(FORGE_IN_VLLM)
// Standalone build (tests, benchmark, the GPU harness): the schemas of vLLM's _C registration.
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("forge_gemv(Tensor! out, Tensor x, Tensor w, int block=0, int rows=0) -> ()");
  m.impl("forge_gemv", torch::kCUDA, &forge_gemv);
  m.def("forge_gemv_silu_mul(Tensor! out, Tensor x, Tensor w, int block=0, int rows=0) -> ()");
  m.impl("forge_gemv_silu_mul", torch::kCUDA, &forge_gemv_silu_mul);
}
#endif
#endif  // FORGE_STANDALONE
