// Launchers of the CUDA fused kernels of megatron.fused_kernels._cuda (contract: issue #16).
//
// Plain CUDA types only (raw pointers, int64_t sizes, float scalars, cudaStream_t): no torch header
// here or in any .cu file. binding.cpp checks and allocates the tensors, then calls these on the
// current stream. Every launcher is a template over T in {float, __half, __nv_bfloat16}, explicitly
// instantiated in its .cu file, and returns the first CUDA error of its launches (cudaSuccess if
// none). All arrays are contiguous; "rows" is the product of the leading dims, so a kernel sees a
// [rows, h] view. Math is in fp32 (double where noted); sizes other than rows must be < 2^31.
//
// The second half of this file (only seen by nvcc) holds the device helpers the .cu files share:
// dtype conversion, 16-byte vector loads, warp / block reductions and the row-to-thread mapping.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace trident {
namespace gpu {

// ---- Norms (norms.cu) ----
// y = (x - mean) * rstd * gamma + beta; writes mean [rows], rstd [rows] (fp32).
template <typename T>
cudaError_t layer_norm_fwd(const T* x, const T* gamma, const T* beta, T* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, cudaStream_t stream);
// y = round_to_T(x * rstd) * gamma; writes rstd [rows] (fp32).
template <typename T>
cudaError_t rms_norm_fwd(const T* x, const T* gamma, T* y, float* rstd, int64_t rows, int64_t h,
                         float eps, cudaStream_t stream);
// fp32 workspace (in floats) the backward launchers need: per-chunk partial sums of the weight
// grads, `grads` of them (2 for LayerNorm: dgamma, dbeta; 1 for RMSNorm).
int64_t norm_bwd_workspace_floats(int64_t rows, int64_t h, int grads);
template <typename T>
cudaError_t layer_norm_bwd(const T* dy, const T* x, const float* mean, const float* rstd,
                           const T* gamma, T* dx, T* dgamma, T* dbeta, float* workspace,
                           int64_t rows, int64_t h, cudaStream_t stream);
template <typename T>
cudaError_t rms_norm_bwd(const T* dy, const T* x, const float* rstd, const T* gamma, T* dx,
                         T* dgamma, float* workspace, int64_t rows, int64_t h, cudaStream_t stream);

// ---- Softmax of attention scores (softmax.cu) ----
// x, y [batches, sq, sq]: causal softmax of scale * x (y = 0 above the diagonal).
template <typename T>
cudaError_t causal_softmax_fwd(const T* x, T* y, int64_t batches, int64_t sq, float scale,
                               cudaStream_t stream);
// x, y [b, np, sq, sk]; mask [mask_b, 1, sq, sk] with mask_b == b or 1 (true = masked out).
template <typename T>
cudaError_t masked_softmax_fwd(const T* x, const bool* mask, T* y, int64_t b, int64_t np,
                               int64_t sq, int64_t sk, int64_t mask_b, float scale,
                               cudaStream_t stream);
// dx = scale * y * (dy - sum_j dy * y) over rows of length sk.
template <typename T>
cudaError_t softmax_bwd(const T* dy, const T* y, T* dx, int64_t rows, int64_t sk, float scale,
                        cudaStream_t stream);

// ---- Bias + activation (activations.cu); bias may be nullptr (no bias) ----
// x, y [rows, f]
template <typename T>
cudaError_t bias_gelu_fwd(const T* x, const T* bias, T* y, int64_t rows, int64_t f,
                          cudaStream_t stream);
template <typename T>
cudaError_t bias_gelu_bwd(const T* dy, const T* x, const T* bias, T* dx, int64_t rows, int64_t f,
                          cudaStream_t stream);
// x, dx [rows, 2f] (gate | up), y, dy [rows, f], bias [2f]
template <typename T>
cudaError_t bias_swiglu_fwd(const T* x, const T* bias, T* y, int64_t rows, int64_t f,
                            cudaStream_t stream);
template <typename T>
cudaError_t bias_swiglu_bwd(const T* dy, const T* x, const T* bias, T* dx, int64_t rows, int64_t f,
                            cudaStream_t stream);

// ---- Rotary embedding (rope.cu) ----
// x, y [sb, n, hn] (sb = s * b); cos, sin [sb, d], d even, d <= hn.
template <typename T>
cudaError_t rope_fwd(const T* x, const T* cos, const T* sin, T* y, int64_t sb, int64_t n,
                     int64_t hn, int64_t d, cudaStream_t stream);
template <typename T>
cudaError_t rope_bwd(const T* dy, const T* cos, const T* sin, T* dx, int64_t sb, int64_t n,
                     int64_t hn, int64_t d, cudaStream_t stream);

// ---- Vocab-parallel cross-entropy, local passes (cross_entropy.cu) ----
// logits [n, vp], target [n] (-1 = not owned) -> stats [n, 4] = {m, se, zt, sz} (fp32).
template <typename T>
cudaError_t ce_local_stats(const T* logits, const int64_t* target, float* stats, int64_t n,
                           int64_t vp, cudaStream_t stream);
// logits <- row_scale * (exp(z - (global_max + log_sum_exp)) - (1 - smoothing) [target]
//           - smoothing / vocab), row_scale the upstream grad per row (nullptr: 1).
template <typename T>
cudaError_t ce_grad_inplace(T* logits, const int64_t* target, const float* global_max,
                            const float* log_sum_exp, const float* row_scale, int64_t n, int64_t vp,
                            double smoothing, int64_t vocab_size, cudaStream_t stream);

}  // namespace gpu
}  // namespace trident

#if defined(__CUDACC__)
// ============================== device helpers (nvcc only) ==============================
namespace trident {
namespace gpu {
namespace detail {

constexpr int kMaxRowThreads = 512;  // threads working on one row (norms, softmax, CE)
constexpr int kElementwiseThreads = 256;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// No bf16 kernels before sm_80 (Volta: fp32/fp16 only; the binding refuses bf16 there). The bf16 templates
// are still instantiated, as CUDA requires the same __global__ instantiations in every pass, but their
// bodies reduce to a trap: no bf16 code is generated for these targets.
__device__ __forceinline__ float to_float(__nv_bfloat16) {
  __trap();
  return 0.f;
}
#else
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
#endif

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // see to_float(__nv_bfloat16)
#endif
  return __float2bfloat16_rn(v);
}
// v rounded to T's precision and back (the identity for float).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// N consecutive T as one aligned load / store (16 bytes when N = 16 / sizeof(T)).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_float(pk.v[k]);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int k = 0; k < N; ++k) pk.v[k] = from_float<T>(in[k]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return a + b;
  }
};
struct MaxOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return a > b ? a : b;
  }
};

// Butterfly reduction over aligned groups of `width` lanes (a power of two <= 32); every lane of
// the warp must call it, and every lane of a group gets the group's result.
template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op, int width) {
  for (int offset = width >> 1; offset > 0; offset >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Whole-block reduction (blockDim.x a multiple of 32, every thread calls it); `scratch` is
// __shared__ with >= 32 slots. Every thread gets the result. The leading __syncthreads makes
// back-to-back calls with the same scratch safe.
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, V identity, V* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = warp_reduce(v, op, 32);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : identity;
  v = warp_reduce(v, op, 32);  // every warp reduces the partials: no second broadcast needed
  return v;
}

// Reduction over the threads of one row: a sub-warp group when width <= 32, else the block.
template <typename V, typename Op>
__device__ __forceinline__ V row_reduce(V v, Op op, V identity, int width, V* scratch) {
  if (width <= 32) return warp_reduce(v, op, width);
  return block_reduce(v, op, identity, scratch);
}

// Row-to-thread mapping of the row kernels: `width` threads (a power of two) per row, so one
// block holds blockDim.x / width rows (width <= 32) or one row (width = blockDim.x > 32).
struct RowSlot {
  int64_t row;
  int lane;
  bool valid;  // false for the spare groups of the last block: they still join the reductions
};

__device__ __forceinline__ RowSlot row_slot(int width, int64_t rows) {
  RowSlot s;
  const int rows_per_block = blockDim.x / width;
  s.row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / width;
  s.lane = threadIdx.x % width;
  s.valid = s.row < rows;
  return s;
}

struct RowLaunch {
  int width;
  int threads;
  unsigned int blocks;
};

// Threads per row: the power of two covering `row_vecs` vectors, capped at kMaxRowThreads; narrow
// rows share 128-thread blocks.
inline RowLaunch row_launch(int64_t rows, int64_t row_vecs) {
  RowLaunch l;
  l.width = 1;
  while (l.width < row_vecs && l.width < kMaxRowThreads) l.width <<= 1;
  l.threads = l.width <= 32 ? 128 : l.width;
  const int64_t per_block = l.threads / l.width;
  l.blocks = static_cast<unsigned int>((rows + per_block - 1) / per_block);
  return l;
}

inline int sm_count() {
  int device = 0;
  int count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 108;
  }
  return count;
}

// Grid of a grid-stride elementwise kernel over `work` items: enough blocks to fill the GPU a few
// times over, no more.
inline unsigned int elementwise_blocks(int64_t work) {
  const int64_t needed = (work + kElementwiseThreads - 1) / kElementwiseThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * 16;
  return static_cast<unsigned int>(needed < cap ? needed : cap);
}

// True when every pointer is 16-byte aligned (nullptr counts as aligned).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
template <typename... P>
inline bool all_aligned16(const P*... ptrs) {
  return (aligned16(ptrs) && ...);
}

}  // namespace detail
}  // namespace gpu
}  // namespace trident
#endif  // __CUDACC__
