// SPDX-License-Identifier: Apache-2.0
// Quantize-on-write of K/V into the int8 paged KV cache: the HIP/CUDA twin of
// kernels/forge_triton/int8_kv_write.py (same layout, same numerics).
//
// Cache planes (views of one (nb, 2, bs, H, D+4) int8 page tensor):
//   k_data/v_data   (nb, bs, H, D) int8, token-major (NHD)
//   k_scale/v_scale (nb, H, bs)    fp32, head-major (tail of each K/V plane)
// Per (token, head): scale = max(max|x|/127, SCALE_FLOOR); q = clamp(round_half_away(x/scale), -127, 127).
// slot < 0 (padding) leaves the cache untouched.
//
// Launch: grid (num_tokens, H), block FORGE_THREADS (= 128) threads; each block reduces max|x| of one
// K row and one V row of D elements with a shared-memory tree (no warp shuffles, no assumption on the
// warp/wavefront width: correct for warp32 and wave64), then writes D int8 + one fp32 per plane.
// Bytes per token: read 2*H*D*elt, write 2*H*(D+4). No allocation, no host sync (CUDA-graph safe).
//
// Build modes
//   torch extension (default): defines forge_int8_kv_write(key, value, k_data, v_data, k_scale, v_scale,
//     slot_mapping) (all torch::Tensor&, as vLLM's cache ops); registered as
//     torch.ops._C_cache_ops.forge_int8_kv_write when built into vLLM's _C (FORGE_IN_VLLM), else a
//     pybind module when TORCH_EXTENSION_NAME is defined.
//   -DFORGE_STANDALONE: no torch headers; exports the C launcher forge_int8_kv_write_raw(...) for ctypes.
// Portable CUDA C++: hipify-able, no inline PTX.

#include <stdint.h>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
typedef hipStream_t forge_stream_t;
#define FORGE_LAUNCH_ERROR() hipGetLastError()
#define FORGE_SUCCESS hipSuccess
typedef hipError_t forge_err_t;
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
typedef cudaStream_t forge_stream_t;
#define FORGE_LAUNCH_ERROR() cudaGetLastError()
#define FORGE_SUCCESS cudaSuccess
typedef cudaError_t forge_err_t;
#endif

#ifndef FORGE_THREADS
#define FORGE_THREADS 128
#endif
#define FORGE_SCALE_FLOOR 1.0e-10f

namespace forge {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

template <int DT>
__device__ __forceinline__ float load_as_float(const void* base, int64_t idx) {
  if (DT == kFloat32) {
    return static_cast<const float*>(base)[idx];
  } else if (DT == kFloat16) {
    const __half h = static_cast<const __half*>(base)[idx];
    return __half2float(h);
  } else {
    // bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits
    const uint16_t b = static_cast<const uint16_t*>(base)[idx];
    return __uint_as_float(static_cast<uint32_t>(b) << 16);
  }
}

__device__ __forceinline__ int8_t quantize(float x, float inv) {
  float y = x * inv;
  // round half away from zero, then clamp (same as the Triton kernel)
  int r = static_cast<int>(y >= 0.f ? y + 0.5f : y - 0.5f);
  r = r > 127 ? 127 : (r < -127 ? -127 : r);
  return static_cast<int8_t>(r);
}

struct WriteParams {
  const void* key; const void* value;
  int8_t* k_data; int8_t* v_data; float* k_scale; float* v_scale;
  const void* slot_mapping; int slot_is_int64;
  int num_tokens, num_heads, head_size, block_size;
  int64_t sk_t, sk_h, sk_d, sv_t, sv_h, sv_d;
  int64_t skd_b, skd_o, skd_h, skd_d, svd_b, svd_o, svd_h, svd_d;
  int64_t sks_b, sks_h, sks_o, svs_b, svs_h, svs_o;
};

template <int DT>
__global__ void __launch_bounds__(FORGE_THREADS) int8_kv_write_kernel(const WriteParams p) {
  __shared__ float red_k[FORGE_THREADS];
  __shared__ float red_v[FORGE_THREADS];
  const int tok = blockIdx.x;
  const int h = blockIdx.y;
  const int tid = threadIdx.x;
  const int64_t slot = p.slot_is_int64 ? static_cast<const int64_t*>(p.slot_mapping)[tok]
                                       : static_cast<int64_t>(static_cast<const int32_t*>(p.slot_mapping)[tok]);
  if (slot < 0) return;  // whole block exits together: no barrier is skipped by part of it
  // slots index tokens of the cache (num_blocks * block_size < 2^31): 32-bit division
  const int32_t s32 = static_cast<int32_t>(slot);
  const int64_t blk = s32 / p.block_size;
  const int64_t off = s32 % p.block_size;
  const int64_t kbase = static_cast<int64_t>(tok) * p.sk_t + static_cast<int64_t>(h) * p.sk_h;
  const int64_t vbase = static_cast<int64_t>(tok) * p.sv_t + static_cast<int64_t>(h) * p.sv_h;

  float amax_k = 0.f, amax_v = 0.f;
  for (int d = tid; d < p.head_size; d += FORGE_THREADS) {
    amax_k = fmaxf(amax_k, fabsf(load_as_float<DT>(p.key, kbase + d * p.sk_d)));
    amax_v = fmaxf(amax_v, fabsf(load_as_float<DT>(p.value, vbase + d * p.sv_d)));
  }
  red_k[tid] = amax_k;
  red_v[tid] = amax_v;
  __syncthreads();
  // tree reduction over the whole block (FORGE_THREADS is a power of two)
  for (int s = FORGE_THREADS / 2; s > 0; s >>= 1) {
    if (tid < s) {
      red_k[tid] = fmaxf(red_k[tid], red_k[tid + s]);
      red_v[tid] = fmaxf(red_v[tid], red_v[tid + s]);
    }
    __syncthreads();
  }
  const float ks = fmaxf(red_k[0] / 127.f, FORGE_SCALE_FLOOR);
  const float vs = fmaxf(red_v[0] / 127.f, FORGE_SCALE_FLOOR);
  const float kinv = 1.f / ks, vinv = 1.f / vs;

  int8_t* kd = p.k_data + blk * p.skd_b + off * p.skd_o + static_cast<int64_t>(h) * p.skd_h;
  int8_t* vd = p.v_data + blk * p.svd_b + off * p.svd_o + static_cast<int64_t>(h) * p.svd_h;
  for (int d = tid; d < p.head_size; d += FORGE_THREADS) {
    kd[d * p.skd_d] = quantize(load_as_float<DT>(p.key, kbase + d * p.sk_d), kinv);
    vd[d * p.svd_d] = quantize(load_as_float<DT>(p.value, vbase + d * p.sv_d), vinv);
  }
  if (tid == 0) {
    p.k_scale[blk * p.sks_b + static_cast<int64_t>(h) * p.sks_h + off * p.sks_o] = ks;
    p.v_scale[blk * p.svs_b + static_cast<int64_t>(h) * p.svs_h + off * p.svs_o] = vs;
  }
}

inline int launch(const WriteParams& p, int dtype, forge_stream_t stream) {
  if (p.num_tokens <= 0) return 0;
  dim3 grid(p.num_tokens, p.num_heads);
  dim3 block(FORGE_THREADS);
  switch (dtype) {
    case kFloat32: int8_kv_write_kernel<kFloat32><<<grid, block, 0, stream>>>(p); break;
    case kFloat16: int8_kv_write_kernel<kFloat16><<<grid, block, 0, stream>>>(p); break;
    case kBFloat16: int8_kv_write_kernel<kBFloat16><<<grid, block, 0, stream>>>(p); break;
    default: return -1;
  }
  forge_err_t e = FORGE_LAUNCH_ERROR();
  return e == FORGE_SUCCESS ? 0 : static_cast<int>(e);
}

}  // namespace forge

#ifdef FORGE_STANDALONE
// C launcher for ctypes. strides: 20 int64 in the order
// key(t,h,d) value(t,h,d) k_data(b,o,h,d) v_data(b,o,h,d) k_scale(b,h,o) v_scale(b,h,o).
// Returns 0 on success, a CUDA/HIP error code otherwise (-1: bad dtype).
extern "C" int forge_int8_kv_write_raw(const void* key, const void* value, void* k_data, void* v_data,
                                       void* k_scale, void* v_scale, const void* slot_mapping,
                                       int slot_is_int64, int dtype, int num_tokens, int num_heads,
                                       int head_size, int block_size, const int64_t* strides,
                                       void* stream) {
  forge::WriteParams p;
  p.key = key; p.value = value;
  p.k_data = static_cast<int8_t*>(k_data); p.v_data = static_cast<int8_t*>(v_data);
  p.k_scale = static_cast<float*>(k_scale); p.v_scale = static_cast<float*>(v_scale);
  p.slot_mapping = slot_mapping; p.slot_is_int64 = slot_is_int64;
  p.num_tokens = num_tokens; p.num_heads = num_heads; p.head_size = head_size; p.block_size = block_size;
  const int64_t* s = strides;
  p.sk_t = s[0]; p.sk_h = s[1]; p.sk_d = s[2]; p.sv_t = s[3]; p.sv_h = s[4]; p.sv_d = s[5];
  p.skd_b = s[6]; p.skd_o = s[7]; p.skd_h = s[8]; p.skd_d = s[9];
  p.svd_b = s[10]; p.svd_o = s[11]; p.svd_h = s[12]; p.svd_d = s[13];
  p.sks_b = s[14]; p.sks_h = s[15]; p.sks_o = s[16]; p.svs_b = s[17]; p.svs_h = s[18]; p.svs_o = s[19];
  return forge::launch(p, dtype, static_cast<forge_stream_t>(stream));
}
#else
// The torch glue is written as vLLM's own csrc/cache_kernels.cu and csrc/activation_kernels.cu write
// theirs (the current stream from ATen/cuda/CUDAContext.h, the device guard from c10/cuda/CUDAGuard.h),
// so the hipify step of vLLM's ROCm build meets only names it already maps for vLLM's own kernels.
// Built as a torch extension of its own (tests, benchmarks), the stream comes from c10/cuda/CUDAStream.h
// instead: the same names, without the cuBLAS/cuSPARSE/cuSOLVER headers CUDAContext.h pulls in, which
// a CUDA install with nvcc alone lacks.
#if defined(FORGE_IN_VLLM)
#include <ATen/cuda/CUDAContext.h>
#include <torch/all.h>
#else
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#endif
#include <c10/cuda/CUDAGuard.h>

void forge_int8_kv_write(torch::Tensor& key, torch::Tensor& value, torch::Tensor& k_data, torch::Tensor& v_data,
                         torch::Tensor& k_scale, torch::Tensor& v_scale, torch::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be (T, H, D) and alike");
  TORCH_CHECK(k_data.scalar_type() == at::kChar && v_data.scalar_type() == at::kChar, "int8 data planes");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat, "fp32 scales");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping int32/int64");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key/value dtype");
  int dtype;
  switch (key.scalar_type()) {
    case at::kFloat: dtype = forge::kFloat32; break;
    case at::kHalf: dtype = forge::kFloat16; break;
    case at::kBFloat16: dtype = forge::kBFloat16; break;
    default: TORCH_CHECK(false, "unsupported key dtype");
  }
  const at::cuda::OptionalCUDAGuard device_guard(device_of(key));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  forge::WriteParams p;
  p.key = key.data_ptr(); p.value = value.data_ptr();
  p.k_data = k_data.data_ptr<int8_t>(); p.v_data = v_data.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>(); p.v_scale = v_scale.data_ptr<float>();
  p.slot_mapping = slot_mapping.data_ptr(); p.slot_is_int64 = slot_mapping.scalar_type() == at::kLong;
  p.num_tokens = static_cast<int>(key.size(0)); p.num_heads = static_cast<int>(key.size(1));
  p.head_size = static_cast<int>(key.size(2)); p.block_size = static_cast<int>(k_data.size(1));
  p.sk_t = key.stride(0); p.sk_h = key.stride(1); p.sk_d = key.stride(2);
  p.sv_t = value.stride(0); p.sv_h = value.stride(1); p.sv_d = value.stride(2);
  p.skd_b = k_data.stride(0); p.skd_o = k_data.stride(1); p.skd_h = k_data.stride(2); p.skd_d = k_data.stride(3);
  p.svd_b = v_data.stride(0); p.svd_o = v_data.stride(1); p.svd_h = v_data.stride(2); p.svd_d = v_data.stride(3);
  p.sks_b = k_scale.stride(0); p.sks_h = k_scale.stride(1); p.sks_o = k_scale.stride(2);
  p.svs_b = v_scale.stride(0); p.svs_h = v_scale.stride(1); p.svs_o = v_scale.stride(2);
  const int rc = forge::launch(p, dtype, stream);
  TORCH_CHECK(rc == 0, "forge_int8_kv_write launch failed: ", rc);
}

// Built into vLLM's _C (csrc/forge/ via the overlay) the op is registered in torch_bindings.cpp and
// FORGE_IN_VLLM is defined; a standalone torch extension gets its own pybind module.
#if defined(TORCH_EXTENSION_NAME) && !defined(FORGE_IN_VLLM)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forge_int8_kv_write", &forge_int8_kv_write, "int8 quantize-on-write into the paged KV cache");
}
#endif
#endif  // FORGE_STANDALONE
