// Bias + tanh-GELU and bias + SwiGLU, forward and backward (CUDA; launchers in kernels.h).
//
// Math (fp32; the bias add u = x + bias is rounded to T first, as the unfused x + bias would be;
// without a bias u = x):
//   GELU fwd:    t = tanh(k0 * (u + k1 * u^3));  y = 0.5 * u * (1 + t)
//                k0 = sqrt(2 / pi) = 0.7978845608028654, k1 = 0.044715 (torch's approximate="tanh")
//   GELU bwd:    dx = dy * (0.5 * (1 + t) + 0.5 * u * (1 - t^2) * k0 * (1 + 3 * k1 * u^2))
//   SwiGLU fwd:  x = [a | c] per row (gate a = first f columns, up c = last f), plus bias halves;
//                sig = 1 / (1 + exp(-a));  y = silu(a) * c,  silu(a) = a * sig
//   SwiGLU bwd:  da = dy * c * sig * (1 + a * (1 - sig));  dc = dy * silu(a);  dx = [da | dc]
// (the bias grads are dx summed over rows; the Python wrapper does that).
//
// Thread mapping: grid-stride loops over 16-byte vectors of the output (one element when f or a
// pointer does not allow vectors); a vector never straddles two rows because f % vector == 0 on
// the vector path. tanhf / expf are the accurate (non-fast-math) versions.
#include <math.h>

#include "kernels.h"

namespace trident {
namespace gpu {
namespace {

using detail::kElementwiseThreads;
using detail::load_vec;
using detail::round_to;
using detail::store_vec;

constexpr float kK0 = 0.7978845608028654f;
constexpr float kK1 = 0.044715f;

__device__ __forceinline__ float gelu(float u) {
  const float t = tanhf(kK0 * (u + kK1 * u * u * u));
  return 0.5f * u * (1.f + t);
}

__device__ __forceinline__ float gelu_grad(float u) {
  const float t = tanhf(kK0 * (u + kK1 * u * u * u));
  return 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * kK0 * (1.f + 3.f * kK1 * u * u);
}

__device__ __forceinline__ float sigmoid(float a) { return 1.f / (1.f + expf(-a)); }

// u = x + bias rounded to T (bias may be nullptr); `col` is the column of x[0] in its row.
template <typename T, int kVec>
__device__ __forceinline__ void load_input(const T* x, const T* bias, int64_t col,
                                           float (&u)[kVec]) {
  load_vec<T, kVec>(x, u);
  if (bias == nullptr) return;
  float b[kVec];
  load_vec<T, kVec>(bias + col, b);
#pragma unroll
  for (int k = 0; k < kVec; ++k) u[k] = round_to<T>(u[k] + b[k]);
}

template <typename T, int kVec, bool kBackward>
__global__ void __launch_bounds__(kElementwiseThreads)
    bias_gelu_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ bias,
                     T* __restrict__ out, int64_t vecs, int f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs;
       v += stride) {
    const int64_t i = v * kVec;
    float u[kVec];
    load_input<T, kVec>(x + i, bias, i % f, u);
    if (kBackward) {
      float d[kVec];
      load_vec<T, kVec>(dy + i, d);
#pragma unroll
      for (int k = 0; k < kVec; ++k) u[k] = d[k] * gelu_grad(u[k]);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) u[k] = gelu(u[k]);
    }
    store_vec<T, kVec>(out + i, u);
  }
}

// Vector v covers outputs [i, i + kVec) of y [rows, f] (i = v * kVec), i.e. gate columns
// [col, col + kVec) and up columns [f + col, f + col + kVec) of x's row.
template <typename T, int kVec, bool kBackward>
__global__ void __launch_bounds__(kElementwiseThreads)
    bias_swiglu_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                       const T* __restrict__ bias, T* __restrict__ out, int64_t vecs, int f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs;
       v += stride) {
    const int64_t i = v * kVec;
    const int64_t row = i / f;
    const int64_t col = i - row * f;
    const T* xr = x + row * 2 * f;
    float a[kVec], c[kVec];
    load_input<T, kVec>(xr + col, bias, col, a);
    load_input<T, kVec>(xr + f + col, bias, f + col, c);
    if (kBackward) {
      float d[kVec];
      load_vec<T, kVec>(dy + i, d);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float sig = sigmoid(a[k]);
        const float silu = a[k] * sig;
        a[k] = d[k] * c[k] * sig * (1.f + a[k] * (1.f - sig));  // da
        c[k] = d[k] * silu;                                     // dc
      }
      T* dxr = out + row * 2 * f;
      store_vec<T, kVec>(dxr + col, a);
      store_vec<T, kVec>(dxr + f + col, c);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) a[k] = a[k] / (1.f + expf(-a[k])) * c[k];
      store_vec<T, kVec>(out + i, a);
    }
  }
}

template <typename T>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T));
}

template <typename T, bool kBackward>
cudaError_t launch_gelu(const T* dy, const T* x, const T* bias, T* out, int64_t rows, int64_t f,
                        cudaStream_t stream) {
  const int64_t n = rows * f;
  if (n <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<T>();
  const bool vec = f % kVec == 0 && detail::all_aligned16(dy, x, bias, out);
  const int64_t vecs = vec ? n / kVec : n;
  const unsigned int blocks = detail::elementwise_blocks(vecs);
  if (vec) {
    bias_gelu_kernel<T, kVec, kBackward>
        <<<blocks, kElementwiseThreads, 0, stream>>>(dy, x, bias, out, vecs, static_cast<int>(f));
  } else {
    bias_gelu_kernel<T, 1, kBackward>
        <<<blocks, kElementwiseThreads, 0, stream>>>(dy, x, bias, out, vecs, static_cast<int>(f));
  }
  return cudaGetLastError();
}

template <typename T, bool kBackward>
cudaError_t launch_swiglu(const T* dy, const T* x, const T* bias, T* out, int64_t rows, int64_t f,
                          cudaStream_t stream) {
  const int64_t n = rows * f;
  if (n <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<T>();
  const bool vec = f % kVec == 0 && detail::all_aligned16(dy, x, bias, out);
  const int64_t vecs = vec ? n / kVec : n;
  const unsigned int blocks = detail::elementwise_blocks(vecs);
  if (vec) {
    bias_swiglu_kernel<T, kVec, kBackward>
        <<<blocks, kElementwiseThreads, 0, stream>>>(dy, x, bias, out, vecs, static_cast<int>(f));
  } else {
    bias_swiglu_kernel<T, 1, kBackward>
        <<<blocks, kElementwiseThreads, 0, stream>>>(dy, x, bias, out, vecs, static_cast<int>(f));
  }
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t bias_gelu_fwd(const T* x, const T* bias, T* y, int64_t rows, int64_t f,
                          cudaStream_t stream) {
  return launch_gelu<T, false>(nullptr, x, bias, y, rows, f, stream);
}

template <typename T>
cudaError_t bias_gelu_bwd(const T* dy, const T* x, const T* bias, T* dx, int64_t rows, int64_t f,
                          cudaStream_t stream) {
  return launch_gelu<T, true>(dy, x, bias, dx, rows, f, stream);
}

template <typename T>
cudaError_t bias_swiglu_fwd(const T* x, const T* bias, T* y, int64_t rows, int64_t f,
                            cudaStream_t stream) {
  return launch_swiglu<T, false>(nullptr, x, bias, y, rows, f, stream);
}

template <typename T>
cudaError_t bias_swiglu_bwd(const T* dy, const T* x, const T* bias, T* dx, int64_t rows, int64_t f,
                            cudaStream_t stream) {
  return launch_swiglu<T, true>(dy, x, bias, dx, rows, f, stream);
}

#define TRIDENT_INSTANTIATE_ACTIVATIONS(T)                                                         \
  template cudaError_t bias_gelu_fwd<T>(const T*, const T*, T*, int64_t, int64_t, cudaStream_t);   \
  template cudaError_t bias_gelu_bwd<T>(const T*, const T*, const T*, T*, int64_t, int64_t,        \
                                        cudaStream_t);                                             \
  template cudaError_t bias_swiglu_fwd<T>(const T*, const T*, T*, int64_t, int64_t, cudaStream_t); \
  template cudaError_t bias_swiglu_bwd<T>(const T*, const T*, const T*, T*, int64_t, int64_t,      \
                                          cudaStream_t);

TRIDENT_INSTANTIATE_ACTIVATIONS(float)
TRIDENT_INSTANTIATE_ACTIVATIONS(__half)
TRIDENT_INSTANTIATE_ACTIVATIONS(__nv_bfloat16)
#undef TRIDENT_INSTANTIATE_ACTIVATIONS

}  // namespace gpu
}  // namespace trident
