// LayerNorm and RMSNorm, forward and backward, on [rows, h] (CUDA; launchers in kernels.h).
//
// Math (fp32 throughout, h = row length, sums over the row unless said):
//   LayerNorm fwd: mean = sum(x) / h;  var = sum((x - mean)^2) / h (biased; two passes, no
//                  cancellation);  rstd = 1 / sqrt(var + eps);
//                  y = (x - mean) * rstd * gamma + beta
//   RMSNorm fwd:   rstd = 1 / sqrt(sum(x^2) / h + eps);  y = round_to_T(x * rstd) * gamma
//   backward:      xhat = (x - mean) * rstd (mean = 0 for RMSNorm);  g = dy * gamma
//                  LayerNorm: dx = rstd * (g - sum(g) / h - xhat * sum(g * xhat) / h)
//                  RMSNorm:   dx = rstd * (g - xhat * sum(g * xhat) / h)
//                  dgamma = sum_rows(dy * xhat);  dbeta = sum_rows(dy)
//
// Thread mapping:
//   fwd and dx: one row per group of `width` threads (row_launch in kernels.h: a sub-warp for
//   narrow rows, a block of up to 512 threads otherwise); a thread walks its row with a stride of
//   width vectors of 16 bytes (vectorized when h and the pointers allow it, else one element).
//   The row is re-read for each pass: it is small (<= 20 KB at h = 5120 fp32) and stays in L1/L2.
//   dgamma / dbeta: a second kernel with 32 x 8 threads per block; block (cx, cy) owns 32 columns
//   and the cy-th chunk of rows, each thread sums every 8th row of the chunk for its column (fp32),
//   the 8 partials are summed in shared memory and the chunk's partial is written to the fp32
//   workspace [chunks, grads, h]. A last kernel sums the chunks per column, in order
//   (deterministic, no atomics) and casts to gamma's dtype.
#include "kernels.h"

namespace trident {
namespace gpu {
namespace {

using detail::from_float;
using detail::kMaxRowThreads;
using detail::load_vec;
using detail::round_to;
using detail::row_reduce;
using detail::row_slot;
using detail::RowSlot;
using detail::store_vec;
using detail::SumOp;
using detail::to_float;

constexpr int kColThreads = 32;  // columns per block of the weight-grad kernel
constexpr int kRowThreads = 8;   // row lanes per block of the weight-grad kernel

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads)
    layer_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ gamma,
                          const T* __restrict__ beta, T* __restrict__ y,
                          float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows,
                          int h, float eps, int width) {
  __shared__ float scratch[32];
  const RowSlot s = row_slot(width, rows);
  const int vecs = s.valid ? h / kVec : 0;
  const T* xr = x + s.row * h;
  float sum = 0.f;
  for (int v = s.lane; v < vecs; v += width) {
    float e[kVec];
    load_vec<T, kVec>(xr + v * kVec, e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) sum += e[k];
  }
  const float mean = row_reduce(sum, SumOp(), 0.f, width, scratch) / static_cast<float>(h);
  float sq = 0.f;
  for (int v = s.lane; v < vecs; v += width) {
    float e[kVec];
    load_vec<T, kVec>(xr + v * kVec, e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) sq += (e[k] - mean) * (e[k] - mean);
  }
  const float var = row_reduce(sq, SumOp(), 0.f, width, scratch) / static_cast<float>(h);
  const float rstd = 1.f / sqrtf(var + eps);
  if (!s.valid) return;  // no collective operation below
  if (s.lane == 0) {
    mean_out[s.row] = mean;
    rstd_out[s.row] = rstd;
  }
  T* yr = y + s.row * h;
  for (int v = s.lane; v < vecs; v += width) {
    float e[kVec], g[kVec], b[kVec];
    load_vec<T, kVec>(xr + v * kVec, e);
    load_vec<T, kVec>(gamma + v * kVec, g);
    load_vec<T, kVec>(beta + v * kVec, b);
#pragma unroll
    for (int k = 0; k < kVec; ++k) e[k] = (e[k] - mean) * rstd * g[k] + b[k];
    store_vec<T, kVec>(yr + v * kVec, e);
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxRowThreads)
    rms_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ gamma, T* __restrict__ y,
                        float* __restrict__ rstd_out, int64_t rows, int h, float eps, int width) {
  __shared__ float scratch[32];
  const RowSlot s = row_slot(width, rows);
  const int vecs = s.valid ? h / kVec : 0;
  const T* xr = x + s.row * h;
  float sq = 0.f;
  for (int v = s.lane; v < vecs; v += width) {
    float e[kVec];
    load_vec<T, kVec>(xr + v * kVec, e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) sq += e[k] * e[k];
  }
  const float ms = row_reduce(sq, SumOp(), 0.f, width, scratch) / static_cast<float>(h);
  const float rstd = 1.f / sqrtf(ms + eps);
  if (!s.valid) return;
  if (s.lane == 0) rstd_out[s.row] = rstd;
  T* yr = y + s.row * h;
  for (int v = s.lane; v < vecs; v += width) {
    float e[kVec], g[kVec];
    load_vec<T, kVec>(xr + v * kVec, e);
    load_vec<T, kVec>(gamma + v * kVec, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) e[k] = round_to<T>(e[k] * rstd) * g[k];
    store_vec<T, kVec>(yr + v * kVec, e);
  }
}

// dx of both norms; kLayerNorm adds the mean terms.
template <typename T, int kVec, bool kLayerNorm>
__global__ void __launch_bounds__(kMaxRowThreads)
    norm_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                       const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                       const T* __restrict__ gamma, T* __restrict__ dx, int64_t rows, int h,
                       int width) {
  __shared__ float scratch[32];
  const RowSlot s = row_slot(width, rows);
  const int vecs = s.valid ? h / kVec : 0;
  const int64_t off = s.row * h;
  const float mean = (kLayerNorm && s.valid) ? mean_in[s.row] : 0.f;
  const float rstd = s.valid ? rstd_in[s.row] : 0.f;
  float sum_g = 0.f, sum_gx = 0.f;
  for (int v = s.lane; v < vecs; v += width) {
    float d[kVec], e[kVec], g[kVec];
    load_vec<T, kVec>(dy + off + v * kVec, d);
    load_vec<T, kVec>(x + off + v * kVec, e);
    load_vec<T, kVec>(gamma + v * kVec, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float gk = d[k] * g[k];
      sum_g += gk;
      sum_gx += gk * ((e[k] - mean) * rstd);
    }
  }
  const float inv_h = 1.f / static_cast<float>(h);
  const float mean_g = kLayerNorm ? row_reduce(sum_g, SumOp(), 0.f, width, scratch) * inv_h : 0.f;
  const float mean_gx = row_reduce(sum_gx, SumOp(), 0.f, width, scratch) * inv_h;
  if (!s.valid) return;
  for (int v = s.lane; v < vecs; v += width) {
    float d[kVec], e[kVec], g[kVec];
    load_vec<T, kVec>(dy + off + v * kVec, d);
    load_vec<T, kVec>(x + off + v * kVec, e);
    load_vec<T, kVec>(gamma + v * kVec, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float xhat = (e[k] - mean) * rstd;
      d[k] = rstd * (d[k] * g[k] - mean_g - xhat * mean_gx);
    }
    store_vec<T, kVec>(dx + off + v * kVec, d);
  }
}

// Partial weight grads of one chunk of rows: workspace[chunk, 0, col] = sum(dy * xhat) and, for
// LayerNorm, workspace[chunk, 1, col] = sum(dy).
template <typename T, bool kLayerNorm>
__global__ void __launch_bounds__(kColThreads* kRowThreads)
    norm_weight_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                               const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                               float* __restrict__ workspace, int64_t rows, int h,
                               int64_t rows_per_chunk) {
  constexpr int kGrads = kLayerNorm ? 2 : 1;
  __shared__ float part[kGrads][kRowThreads][kColThreads + 1];
  const int col = blockIdx.x * kColThreads + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  float acc_g = 0.f, acc_b = 0.f;
  if (col < h) {
    for (int64_t r = begin + threadIdx.y; r < end; r += kRowThreads) {
      const float d = to_float(dy[r * h + col]);
      const float mean = kLayerNorm ? mean_in[r] : 0.f;
      acc_g += d * ((to_float(x[r * h + col]) - mean) * rstd_in[r]);
      acc_b += d;
    }
  }
  part[0][threadIdx.y][threadIdx.x] = acc_g;
  if (kLayerNorm) part[kGrads - 1][threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y < kGrads && col < h) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kRowThreads; ++i) total += part[threadIdx.y][i][threadIdx.x];
    workspace[(static_cast<int64_t>(blockIdx.y) * kGrads + threadIdx.y) * h + col] = total;
  }
}

// dgamma[col] (and dbeta[col]) = sum over chunks of the partials, cast to T.
template <typename T>
__global__ void norm_weight_final_kernel(const float* __restrict__ workspace,
                                         T* __restrict__ dgamma, T* __restrict__ dbeta,
                                         int64_t chunks, int h) {
  const int grads = dbeta != nullptr ? 2 : 1;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= h) return;
  float sum_g = 0.f, sum_b = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    sum_g += workspace[(c * grads) * h + col];
    if (dbeta != nullptr) sum_b += workspace[(c * grads + 1) * h + col];
  }
  dgamma[col] = from_float<T>(sum_g);
  if (dbeta != nullptr) dbeta[col] = from_float<T>(sum_b);
}

int64_t num_chunks(int64_t rows, int64_t h) {
  const int64_t col_blocks = (h + kColThreads - 1) / kColThreads;
  const int64_t target_blocks = static_cast<int64_t>(detail::sm_count()) * 8;
  int64_t chunks = (target_blocks + col_blocks - 1) / col_blocks;
  const int64_t max_chunks = (rows + 31) / 32;  // at least 32 rows (4 per thread) per chunk
  if (chunks > max_chunks) chunks = max_chunks;
  if (chunks > 65535) chunks = 65535;  // gridDim.y limit
  return chunks < 1 ? 1 : chunks;
}

template <typename T>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T));
}

// Weight grads: partial sums per chunk of rows, then the per-column total.
template <typename T, bool kLayerNorm>
cudaError_t launch_weight_grads(const T* dy, const T* x, const float* mean, const float* rstd,
                                T* dgamma, T* dbeta, float* workspace, int64_t rows, int64_t h,
                                cudaStream_t stream) {
  const int64_t chunks = num_chunks(rows, h);
  const int64_t rows_per_chunk = rows > 0 ? (rows + chunks - 1) / chunks : 1;
  const dim3 grid(static_cast<unsigned int>((h + kColThreads - 1) / kColThreads),
                  static_cast<unsigned int>(chunks));
  norm_weight_partial_kernel<T, kLayerNorm><<<grid, dim3(kColThreads, kRowThreads), 0, stream>>>(
      dy, x, mean, rstd, workspace, rows, static_cast<int>(h), rows_per_chunk);
  const unsigned int final_blocks = static_cast<unsigned int>((h + 255) / 256);
  norm_weight_final_kernel<T>
      <<<final_blocks, 256, 0, stream>>>(workspace, dgamma, dbeta, chunks, static_cast<int>(h));
  return cudaGetLastError();
}

template <typename T, bool kLayerNorm>
cudaError_t launch_norm_bwd(const T* dy, const T* x, const float* mean, const float* rstd,
                            const T* gamma, T* dx, T* dgamma, T* dbeta, float* workspace,
                            int64_t rows, int64_t h, cudaStream_t stream) {
  if (h <= 0) return cudaSuccess;
  if (rows > 0) {
    constexpr int kVec = vec_width<T>();
    const bool vec = h % kVec == 0 && detail::all_aligned16(dy, x, gamma, dx);
    const detail::RowLaunch l = detail::row_launch(rows, vec ? h / kVec : h);
    if (vec) {
      norm_bwd_dx_kernel<T, kVec, kLayerNorm><<<l.blocks, l.threads, 0, stream>>>(
          dy, x, mean, rstd, gamma, dx, rows, static_cast<int>(h), l.width);
    } else {
      norm_bwd_dx_kernel<T, 1, kLayerNorm><<<l.blocks, l.threads, 0, stream>>>(
          dy, x, mean, rstd, gamma, dx, rows, static_cast<int>(h), l.width);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return launch_weight_grads<T, kLayerNorm>(dy, x, mean, rstd, dgamma, dbeta, workspace, rows, h,
                                            stream);
}

}  // namespace

int64_t norm_bwd_workspace_floats(int64_t rows, int64_t h, int grads) {
  return num_chunks(rows, h) * grads * h;
}

template <typename T>
cudaError_t layer_norm_fwd(const T* x, const T* gamma, const T* beta, T* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, cudaStream_t stream) {
  if (rows <= 0 || h <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<T>();
  const bool vec = h % kVec == 0 && detail::all_aligned16(x, gamma, beta, y);
  const detail::RowLaunch l = detail::row_launch(rows, vec ? h / kVec : h);
  if (vec) {
    layer_norm_fwd_kernel<T, kVec><<<l.blocks, l.threads, 0, stream>>>(
        x, gamma, beta, y, mean, rstd, rows, static_cast<int>(h), eps, l.width);
  } else {
    layer_norm_fwd_kernel<T, 1><<<l.blocks, l.threads, 0, stream>>>(
        x, gamma, beta, y, mean, rstd, rows, static_cast<int>(h), eps, l.width);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t rms_norm_fwd(const T* x, const T* gamma, T* y, float* rstd, int64_t rows, int64_t h,
                         float eps, cudaStream_t stream) {
  if (rows <= 0 || h <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<T>();
  const bool vec = h % kVec == 0 && detail::all_aligned16(x, gamma, y);
  const detail::RowLaunch l = detail::row_launch(rows, vec ? h / kVec : h);
  if (vec) {
    rms_norm_fwd_kernel<T, kVec><<<l.blocks, l.threads, 0, stream>>>(
        x, gamma, y, rstd, rows, static_cast<int>(h), eps, l.width);
  } else {
    rms_norm_fwd_kernel<T, 1><<<l.blocks, l.threads, 0, stream>>>(
        x, gamma, y, rstd, rows, static_cast<int>(h), eps, l.width);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t layer_norm_bwd(const T* dy, const T* x, const float* mean, const float* rstd,
                           const T* gamma, T* dx, T* dgamma, T* dbeta, float* workspace,
                           int64_t rows, int64_t h, cudaStream_t stream) {
  return launch_norm_bwd<T, true>(dy, x, mean, rstd, gamma, dx, dgamma, dbeta, workspace, rows, h,
                                  stream);
}

template <typename T>
cudaError_t rms_norm_bwd(const T* dy, const T* x, const float* rstd, const T* gamma, T* dx,
                         T* dgamma, float* workspace, int64_t rows, int64_t h,
                         cudaStream_t stream) {
  return launch_norm_bwd<T, false>(dy, x, nullptr, rstd, gamma, dx, dgamma, nullptr, workspace,
                                   rows, h, stream);
}

#define TRIDENT_INSTANTIATE_NORMS(T)                                                               \
  template cudaError_t layer_norm_fwd<T>(const T*, const T*, const T*, T*, float*, float*,         \
                                         int64_t, int64_t, float, cudaStream_t);                   \
  template cudaError_t rms_norm_fwd<T>(const T*, const T*, T*, float*, int64_t, int64_t, float,    \
                                       cudaStream_t);                                              \
  template cudaError_t layer_norm_bwd<T>(const T*, const T*, const float*, const float*, const T*, \
                                         T*, T*, T*, float*, int64_t, int64_t, cudaStream_t);      \
  template cudaError_t rms_norm_bwd<T>(const T*, const T*, const float*, const T*, T*, T*, float*, \
                                       int64_t, int64_t, cudaStream_t);

TRIDENT_INSTANTIATE_NORMS(float)
TRIDENT_INSTANTIATE_NORMS(__half)
TRIDENT_INSTANTIATE_NORMS(__nv_bfloat16)
#undef TRIDENT_INSTANTIATE_NORMS

}  // namespace gpu
}  // namespace trident
