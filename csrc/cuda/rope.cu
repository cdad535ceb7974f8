// Rotary position embedding, half-split (GPT-NeoX / HF LLaMA) convention, forward and backward
// (CUDA; launchers in kernels.h).
//
// Math: x [s, b, n, hn] seen as [sb, n, hn]; cos, sin [sb, d] shared by the n heads; d even,
// d <= hn, half = d / 2. For channel i of a head (fp32 product, rounded once to T):
//   forward:  y_i = x_i cos_i - x_{i+half} sin_i          (i < half)
//             y_i = x_i cos_i + x_{i-half} sin_i          (half <= i < d)
//             y_i = x_i                                   (i >= d: partial rotary, copied)
//   backward (the transpose of that rotation):
//             dx_j = dy_j cos_j + dy_{j+half} sin_{j+half}  (j < half)
//             dx_j = dy_j cos_j - dy_{j-half} sin_{j-half}  (half <= j < d)
//             dx_j = dy_j                                   (j >= d)
//
// Thread mapping: grid-stride loop over 16-byte vectors of channels of [sb, n, hn] (one channel
// when hn or half is not a multiple of the vector, or a pointer is unaligned). A vector lies in one
// region (first half, second half, pass-through) because half and hn are multiples of it; the
// partner channel (i +- half) is loaded as a second vector from the same head (an L1 hit).
#include "kernels.h"

namespace trident {
namespace gpu {
namespace {

using detail::kElementwiseThreads;
using detail::load_vec;
using detail::store_vec;

template <typename T, int kVec, bool kBackward>
__global__ void __launch_bounds__(kElementwiseThreads)
    rope_kernel(const T* __restrict__ in, const T* __restrict__ cos, const T* __restrict__ sin,
                T* __restrict__ out, int64_t vecs, int n, int hn, int d) {
  const int half = d / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs;
       v += stride) {
    const int64_t i = v * kVec;
    const int64_t head = i / hn;  // index over [sb, n]
    const int c = static_cast<int>(i - head * hn);
    float e[kVec];
    load_vec<T, kVec>(in + i, e);
    if (c < d) {
      const bool first = c < half;
      const int partner = first ? c + half : c - half;
      const T* table = cos + (head / n) * d;  // [sb, d] row of this token
      const T* sin_row = sin + (head / n) * d;
      float p[kVec], co[kVec], si[kVec];
      load_vec<T, kVec>(in + i - c + partner, p);
      load_vec<T, kVec>(table + c, co);
      // forward: sin at the channel itself; backward: sin at the partner channel.
      load_vec<T, kVec>(sin_row + (kBackward ? partner : c), si);
      // forward: -x_{i+half} for the first half; backward: +dy_{j+half} for the first half.
      const float sign = (first != kBackward) ? -1.f : 1.f;
#pragma unroll
      for (int k = 0; k < kVec; ++k) e[k] = e[k] * co[k] + sign * p[k] * si[k];
    }
    store_vec<T, kVec>(out + i, e);
  }
}

template <typename T>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T));
}

template <typename T, bool kBackward>
cudaError_t launch_rope(const T* in, const T* cos, const T* sin, T* out, int64_t sb, int64_t n,
                        int64_t hn, int64_t d, cudaStream_t stream) {
  const int64_t total = sb * n * hn;
  if (total <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<T>();
  const bool vec =
      hn % kVec == 0 && (d / 2) % kVec == 0 && detail::all_aligned16(in, cos, sin, out);
  const int64_t vecs = vec ? total / kVec : total;
  const unsigned int blocks = detail::elementwise_blocks(vecs);
  const int in_ = static_cast<int>(n), ihn = static_cast<int>(hn), id = static_cast<int>(d);
  if (vec) {
    rope_kernel<T, kVec, kBackward>
        <<<blocks, kElementwiseThreads, 0, stream>>>(in, cos, sin, out, vecs, in_, ihn, id);
  } else {
    rope_kernel<T, 1, kBackward>
        <<<blocks, kElementwiseThreads, 0, stream>>>(in, cos, sin, out, vecs, in_, ihn, id);
  }
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t rope_fwd(const T* x, const T* cos, const T* sin, T* y, int64_t sb, int64_t n,
                     int64_t hn, int64_t d, cudaStream_t stream) {
  return launch_rope<T, false>(x, cos, sin, y, sb, n, hn, d, stream);
}

template <typename T>
cudaError_t rope_bwd(const T* dy, const T* cos, const T* sin, T* dx, int64_t sb, int64_t n,
                     int64_t hn, int64_t d, cudaStream_t stream) {
  return launch_rope<T, true>(dy, cos, sin, dx, sb, n, hn, d, stream);
}

#define TRIDENT_INSTANTIATE_ROPE(T)                                                             \
  template cudaError_t rope_fwd<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, \
                                   int64_t, cudaStream_t);                                      \
  template cudaError_t rope_bwd<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, \
                                   int64_t, cudaStream_t);

TRIDENT_INSTANTIATE_ROPE(float)
TRIDENT_INSTANTIATE_ROPE(__half)
TRIDENT_INSTANTIATE_ROPE(__nv_bfloat16)
#undef TRIDENT_INSTANTIATE_ROPE

}  // namespace gpu
}  // namespace trident
