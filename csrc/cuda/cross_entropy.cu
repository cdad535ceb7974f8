// Vocab-parallel cross-entropy, the two local passes over this rank's logits shard [n, vp] (CUDA;
// launchers in kernels.h). The reductions across tensor-parallel ranks happen in Python.
//
// Math (z = logits row in fp32, t = local target column or -1 when another rank owns it):
//   stats:  m = max_j z_j;  se = sum_j exp(z_j - m);  zt = z_t - m (0 if t = -1);
//           sz = sum_j (z_j - m) = sum_j z_j - vp * m;  se and sz accumulate in double.
//           One pass: each thread keeps an online (max m_i, sum s_i of exp(z - m_i)), rescaling
//           s_i by exp(m_old - m_new) when its max grows; the row then takes M = max_i m_i and
//           se = sum_i s_i exp(m_i - M).
//   grad (in place, the backward of the mean-free loss  -(1 - eps) z_t - eps/V sum_j z_j + lse):
//           p_j = exp(z_j - (global_max + log_sum_exp));
//           z_j <- (p_j - (j == t ? 1 - smoothing : 0) - smoothing / vocab_size) * row_scale[row]
//           (row_scale: the upstream grad of the row's loss; nullptr = 1)
//
// Thread mapping: one row per group of `width` threads (row_launch in kernels.h; a block of up to
// 512 threads for real vocabularies), a thread strides over the row by 16-byte vectors (one
// element when vp or the pointer does not allow vectors). Both passes read the row once; the grad
// pass writes it once and allocates nothing.
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
using detail::to_float;

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads)
    ce_stats_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                    float* __restrict__ stats, int64_t rows, int vp, int width) {
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  const RowSlot s = row_slot(width, rows);
  const int64_t row = s.valid ? s.row : 0;
  const T* zr = logits + row * vp;
  const int vecs = s.valid ? vp / kVec : 0;
  float m = -INFINITY;
  double se = 0.0, sum_z = 0.0;
  for (int v = s.lane; v < vecs; v += width) {
    float e[kVec];
    load_vec<T, kVec>(zr + v * kVec, e);
    float vmax = e[0];
#pragma unroll
    for (int k = 1; k < kVec; ++k) vmax = fmaxf(vmax, e[k]);
    if (vmax > m) {
      se *= exp(static_cast<double>(m) - static_cast<double>(vmax));  // m = -inf: se is 0
      m = vmax;
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      se += m == -INFINITY ? 0.0 : static_cast<double>(expf(e[k] - m));
      sum_z += static_cast<double>(e[k]);
    }
  }
  const float row_max = row_reduce(m, MaxOp(), -INFINITY, width, fscratch);
  const double rescale =
      m == row_max ? 1.0 : exp(static_cast<double>(m) - static_cast<double>(row_max));
  const double mine = se == 0.0 ? 0.0 : se * rescale;  // threads without a column: se = 0
  const double row_se = row_reduce(mine, SumOp(), 0.0, width, dscratch);
  const double row_sz = row_reduce(sum_z, SumOp(), 0.0, width, dscratch);
  if (!s.valid || s.lane != 0) return;
  const int64_t t = target[row];
  float* out = stats + row * 4;
  // a NaN logit (fmaxf drops it from the max) still reaches the sum of z: make the row's stats NaN
  const bool nan_row = isnan(row_sz);
  out[0] = nan_row ? NAN : row_max;
  out[1] = nan_row ? NAN : static_cast<float>(row_se);
  out[2] = (t >= 0 && t < vp) ? to_float(zr[t]) - row_max : 0.f;  // -1: another rank owns it
  out[3] = static_cast<float>(row_sz - static_cast<double>(vp) * static_cast<double>(row_max));
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads)
    ce_grad_kernel(T* __restrict__ logits, const int64_t* __restrict__ target,
                   const float* __restrict__ global_max, const float* __restrict__ log_sum_exp,
                   const float* __restrict__ row_scale, int64_t rows, int vp, float on_target,
                   float off_target, int width) {
  const RowSlot s = row_slot(width, rows);
  if (!s.valid) return;  // no reduction in this kernel
  T* zr = logits + s.row * vp;
  // two subtractions, not z - (gm + lse): gm + lse would be rounded once more (~ulp(40) / 2)
  const float gm = global_max[s.row], lse = log_sum_exp[s.row];
  const float scale = row_scale != nullptr ? row_scale[s.row] : 1.f;
  const int64_t t = target[s.row];
  const int vecs = vp / kVec;
  for (int v = s.lane; v < vecs; v += width) {
    float e[kVec];
    load_vec<T, kVec>(zr + v * kVec, e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float p = expf((e[k] - gm) - lse);
      if (v * kVec + k == t) p -= on_target;
      e[k] = (p - off_target) * scale;
    }
    store_vec<T, kVec>(zr + v * kVec, e);
  }
}

template <typename T>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T));
}

}  // namespace

template <typename T>
cudaError_t ce_local_stats(const T* logits, const int64_t* target, float* stats, int64_t n,
                           int64_t vp, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<T>();
  const bool vec = vp % kVec == 0 && detail::aligned16(logits);
  const detail::RowLaunch l = detail::row_launch(n, vec ? vp / kVec : vp);
  if (vec) {
    ce_stats_kernel<T, kVec><<<l.blocks, l.threads, 0, stream>>>(logits, target, stats, n,
                                                                 static_cast<int>(vp), l.width);
  } else {
    ce_stats_kernel<T, 1><<<l.blocks, l.threads, 0, stream>>>(logits, target, stats, n,
                                                              static_cast<int>(vp), l.width);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t ce_grad_inplace(T* logits, const int64_t* target, const float* global_max,
                            const float* log_sum_exp, const float* row_scale, int64_t n, int64_t vp,
                            double smoothing, int64_t vocab_size, cudaStream_t stream) {
  if (n <= 0 || vp <= 0) return cudaSuccess;
  // The same scalars (rounded from double once) as the PyTorch reference subtracts.
  const float on_target = static_cast<float>(1.0 - smoothing);
  const float off_target =
      smoothing > 0.0 ? static_cast<float>(smoothing / static_cast<double>(vocab_size)) : 0.f;
  constexpr int kVec = vec_width<T>();
  const bool vec = vp % kVec == 0 && detail::aligned16(logits);
  const detail::RowLaunch l = detail::row_launch(n, vec ? vp / kVec : vp);
  if (vec) {
    ce_grad_kernel<T, kVec>
        <<<l.blocks, l.threads, 0, stream>>>(logits, target, global_max, log_sum_exp, row_scale, n,
                                             static_cast<int>(vp), on_target, off_target, l.width);
  } else {
    ce_grad_kernel<T, 1>
        <<<l.blocks, l.threads, 0, stream>>>(logits, target, global_max, log_sum_exp, row_scale, n,
                                             static_cast<int>(vp), on_target, off_target, l.width);
  }
  return cudaGetLastError();
}

#define TRIDENT_INSTANTIATE_CE(T)                                                            \
  template cudaError_t ce_local_stats<T>(const T*, const int64_t*, float*, int64_t, int64_t, \
                                         cudaStream_t);                                      \
  template cudaError_t ce_grad_inplace<T>(T*, const int64_t*, const float*, const float*,    \
                                          const float*, int64_t, int64_t, double, int64_t,   \
                                          cudaStream_t);

TRIDENT_INSTANTIATE_CE(float)
TRIDENT_INSTANTIATE_CE(__half)
TRIDENT_INSTANTIATE_CE(__nv_bfloat16)
#undef TRIDENT_INSTANTIATE_CE

}  // namespace gpu
}  // namespace trident
