// Scaled softmax of attention scores (causal or with a boolean mask), forward and backward (CUDA;
// launchers in kernels.h).
//
// Math (fp32; a row has sk columns, v_j = scale * x_j):
//   forward:  kept(j) = j <= i (causal, i the query index) or !mask[j] (masked; true = masked out)
//             m = max_{kept} v_j;  s = sum_{kept} exp(v_j - m);  y_j = exp(v_j - m) / s if kept(j),
//             else 0; a row with no kept column gives y = 0, not NaN. Non-finite scores follow the
//             reference (reference.py: torch.softmax after masked_fill): a kept NaN or +inf score,
//             or kept scores that are all -inf, give NaN in every column of the row (masked ones
//             and a causal row's upper part too), so a diverged run's NaN is never hidden.
//   backward: dx_j = scale * y_j * (dy_j - sum_k dy_k * y_k)  (same for both forward kinds; rows of
//             y that are all 0 give 0).
//
// Thread mapping: one row per group of `width` threads (row_launch in kernels.h: a sub-warp for
// short rows, a block of up to 512 threads for long ones), a thread strides over its row by width
// vectors of 16 bytes (when sk and the pointers allow it, else one element). The forward reads the
// row twice: pass 1 keeps an online (max, rescaled sum of exp) pair per thread, merged across the
// group (max, then the sums rescaled to the common max); pass 2 writes y. A causal row only reads
// its first i + 1 columns and writes zeros after them. The backward reads dy and y twice (dot
// product, then dx).
#include <float.h>
#include <math.h>

#include "kernels.h"

namespace trident {
namespace gpu {
namespace {

using detail::kMaxRowThreads;
using detail::load_vec;
using detail::MaxOp;
using detail::row_reduce;
using detail::row_slot;
using detail::RowSlot;
using detail::store_vec;
using detail::SumOp;

// Bit k set where column v * kVec + k of the row is kept. The masked kind reads the vector's kVec
// mask bytes as one integer load (the launcher checks the mask row is kVec-byte aligned): kVec
// byte loads held in registers across the unrolled loop made ptxas spill under the 512-thread
// bound (sm_80, 16-bit types).
template <int kVec, bool kCausal>
__device__ __forceinline__ unsigned kept_bits(const bool* mrow, int v, int limit) {
  unsigned bits = 0;
  if (kCausal) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) bits |= (v * kVec + k < limit ? 1u : 0u) << k;
    return bits;
  }
  uint64_t word;
  if (kVec == 8) {
    word = *reinterpret_cast<const uint64_t*>(mrow + v * kVec);
  } else if (kVec == 4) {
    word = *reinterpret_cast<const uint32_t*>(mrow + v * kVec);
  } else {
    word = 0;
#pragma unroll
    for (int k = 0; k < kVec; ++k) word |= static_cast<uint64_t>(mrow[v * kVec + k]) << (8 * k);
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) bits |= (((word >> (8 * k)) & 0xffu) == 0 ? 1u : 0u) << k;
  return bits;
}

// Forward of both kinds. Causal: mask == nullptr and row r keeps columns j <= r % sq. Masked: the
// row's mask row is mask[(mb * sq + r % sq) * sk] with mb = 0 (shared mask) or the batch index.
template <typename T, int kVec, bool kCausal>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_fwd_kernel(const T* __restrict__ x, const bool* __restrict__ mask, T* __restrict__ y,
                       int64_t rows, int sq, int sk, int64_t rows_per_batch, bool shared_mask,
                       float scale, int width) {
  __shared__ float scratch[32];
  const RowSlot s = row_slot(width, rows);
  const int64_t row = s.valid ? s.row : 0;
  const int qi = static_cast<int>(row % sq);
  const int limit = kCausal ? qi + 1 : sk;  // columns at or past `limit` are masked
  const bool* mrow = nullptr;
  if (!kCausal) {
    const int64_t mb = shared_mask ? 0 : row / rows_per_batch;
    mrow = mask + (mb * sq + qi) * static_cast<int64_t>(sk);
  }
  const T* xr = x + row * sk;
  const int vecs = s.valid ? (limit + kVec - 1) / kVec : 0;

  // Pass 1: per-thread online max and sum of exp(v - max) over the kept columns. A kept score
  // enters the max as at least -FLT_MAX (fmaxf also turns NaN into -FLT_MAX there), so the row max
  // is -inf only for a row with no kept column; a NaN or +inf score makes the sum NaN.
  float m = -INFINITY, sum = 0.f;
  for (int v = s.lane; v < vecs; v += width) {
    float e[kVec];
    load_vec<T, kVec>(xr + v * kVec, e);
    const unsigned keep = kept_bits<kVec, kCausal>(mrow, v, limit);
    float vmax = -INFINITY;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const bool kept = (keep >> k) & 1u;
      e[k] = kept ? __fmul_rn(e[k], scale) : -INFINITY;  // no FMA: as in pass 2
      vmax = kept ? fmaxf(vmax, fmaxf(e[k], -FLT_MAX)) : vmax;
    }
    if (vmax == -INFINITY) continue;  // nothing kept: adds 0
    if (vmax > m) {
      sum *= expf(m - vmax);  // m = -inf: sum is 0 and stays 0
      m = vmax;
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) sum += expf(e[k] - m);  // exp(-inf) = 0 for masked columns
  }
  const float row_max = row_reduce(m, MaxOp(), -INFINITY, width, scratch);
  const float mine = m == -INFINITY ? 0.f : sum * expf(m - row_max);
  const float row_sum = row_reduce(mine, SumOp(), 0.f, width, scratch);
  if (!s.valid) return;

  // Pass 2: y over the whole row. No kept column: zeros. A NaN or +inf kept score (row_sum NaN),
  // or only -inf kept scores (row_sum 0): NaN in every column, masked ones included, as the
  // reference's softmax gives. Else the probabilities, 0 in the masked columns.
  const bool empty = row_max == -INFINITY;
  const bool nan_row = !empty && !(row_sum > 0.f);
  const float fill = nan_row ? NAN : 0.f;
  T* yr = y + row * sk;
  const int all_vecs = sk / kVec;
  for (int v = s.lane; v < all_vecs; v += width) {
    float e[kVec] = {};
    const bool any = !empty && !nan_row && v * kVec < limit;
    const unsigned keep = any ? kept_bits<kVec, kCausal>(mrow, v, limit) : 0u;
    if (any) load_vec<T, kVec>(xr + v * kVec, e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const bool kept = (keep >> k) & 1u;
      e[k] = kept ? expf(__fmul_rn(e[k], scale) - row_max) / row_sum : fill;
    }
    store_vec<T, kVec>(yr + v * kVec, e);
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                       int64_t rows, int sk, float scale, int width) {
  __shared__ float scratch[32];
  const RowSlot s = row_slot(width, rows);
  const int64_t off = (s.valid ? s.row : 0) * sk;
  const int vecs = s.valid ? sk / kVec : 0;
  float dot = 0.f;
  for (int v = s.lane; v < vecs; v += width) {
    float d[kVec], p[kVec];
    load_vec<T, kVec>(dy + off + v * kVec, d);
    load_vec<T, kVec>(y + off + v * kVec, p);
#pragma unroll
    for (int k = 0; k < kVec; ++k) dot += d[k] * p[k];
  }
  dot = row_reduce(dot, SumOp(), 0.f, width, scratch);
  if (!s.valid) return;
  for (int v = s.lane; v < vecs; v += width) {
    float d[kVec], p[kVec];
    load_vec<T, kVec>(dy + off + v * kVec, d);
    load_vec<T, kVec>(y + off + v * kVec, p);
#pragma unroll
    for (int k = 0; k < kVec; ++k) d[k] = p[k] * (d[k] - dot) * scale;
    store_vec<T, kVec>(dx + off + v * kVec, d);
  }
}

template <typename T>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T));
}

template <typename T, bool kCausal>
cudaError_t launch_fwd(const T* x, const bool* mask, T* y, int64_t rows, int64_t sq, int64_t sk,
                       int64_t rows_per_batch, bool shared_mask, float scale, cudaStream_t stream) {
  if (rows <= 0 || sk <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<T>();
  // x and y are read as 16-byte vectors, the mask as kVec-byte words (kept_bits).
  const bool vec = sk % kVec == 0 && detail::all_aligned16(x, y) &&
                   reinterpret_cast<uintptr_t>(mask) % kVec == 0;
  const detail::RowLaunch l = detail::row_launch(rows, vec ? sk / kVec : sk);
  const int isq = static_cast<int>(sq), isk = static_cast<int>(sk);
  if (vec) {
    softmax_fwd_kernel<T, kVec, kCausal><<<l.blocks, l.threads, 0, stream>>>(
        x, mask, y, rows, isq, isk, rows_per_batch, shared_mask, scale, l.width);
  } else {
    softmax_fwd_kernel<T, 1, kCausal><<<l.blocks, l.threads, 0, stream>>>(
        x, mask, y, rows, isq, isk, rows_per_batch, shared_mask, scale, l.width);
  }
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t causal_softmax_fwd(const T* x, T* y, int64_t batches, int64_t sq, float scale,
                               cudaStream_t stream) {
  return launch_fwd<T, true>(x, nullptr, y, batches * sq, sq, sq, sq, true, scale, stream);
}

template <typename T>
cudaError_t masked_softmax_fwd(const T* x, const bool* mask, T* y, int64_t b, int64_t np,
                               int64_t sq, int64_t sk, int64_t mask_b, float scale,
                               cudaStream_t stream) {
  return launch_fwd<T, false>(x, mask, y, b * np * sq, sq, sk, np * sq, mask_b == 1, scale, stream);
}

template <typename T>
cudaError_t softmax_bwd(const T* dy, const T* y, T* dx, int64_t rows, int64_t sk, float scale,
                        cudaStream_t stream) {
  if (rows <= 0 || sk <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<T>();
  const bool vec = sk % kVec == 0 && detail::all_aligned16(dy, y, dx);
  const detail::RowLaunch l = detail::row_launch(rows, vec ? sk / kVec : sk);
  if (vec) {
    softmax_bwd_kernel<T, kVec>
        <<<l.blocks, l.threads, 0, stream>>>(dy, y, dx, rows, static_cast<int>(sk), scale, l.width);
  } else {
    softmax_bwd_kernel<T, 1>
        <<<l.blocks, l.threads, 0, stream>>>(dy, y, dx, rows, static_cast<int>(sk), scale, l.width);
  }
  return cudaGetLastError();
}

#define TRIDENT_INSTANTIATE_SOFTMAX(T)                                                             \
  template cudaError_t causal_softmax_fwd<T>(const T*, T*, int64_t, int64_t, float, cudaStream_t); \
  template cudaError_t masked_softmax_fwd<T>(const T*, const bool*, T*, int64_t, int64_t, int64_t, \
                                             int64_t, int64_t, float, cudaStream_t);               \
  template cudaError_t softmax_bwd<T>(const T*, const T*, T*, int64_t, int64_t, float,             \
                                      cudaStream_t);

TRIDENT_INSTANTIATE_SOFTMAX(float)
TRIDENT_INSTANTIATE_SOFTMAX(__half)
TRIDENT_INSTANTIATE_SOFTMAX(__nv_bfloat16)
#undef TRIDENT_INSTANTIATE_SOFTMAX

}  // namespace gpu
}  // namespace trident
