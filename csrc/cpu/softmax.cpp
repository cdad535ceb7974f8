// CPU scaled softmax of attention scores: causal and masked forward, shared backward
// (contract #16).
//
// Rows are the last dim (sk). All math is fp32; bf16/fp16 rows go through a per-thread fp32 buffer.
//
// Forward, over the kept columns K of a row (t_j = scale * x_j):
//   m = max_{j in K} t_j,  e_j = exp(t_j - m),  y_j = e_j / sum_{k in K} e_k,
//   y_j = 0 for j not in K
//   causal (scaled_upper_triang_masked_softmax_fwd, x [B, sq, sq]): K = {j <= i} for query row i.
//     Only the first i + 1 columns are read and exponentiated; the rest of the row is zero-filled.
//   masked (scaled_masked_softmax_fwd, x [b, np, sq, sk], mask [bm, 1, sq, sk] with bm in {1, b}):
//     K = {j : !mask[b or 0, 0, i, j]}. K empty -> the whole row is 0 (no NaN).
//   Non-finite scores follow the reference (torch.softmax after masked_fill): a NaN or +inf in K,
//   or K's scores all -inf, make the sum NaN and give NaN in every column of the row (the masked
//   ones and a causal row's zero-filled part too).
// Backward (both kinds), from y:
//   dx_j = scale * y_j * (dy_j - sum_k dy_k y_k)
//   masked-out entries have y_j = 0 so dx_j = 0; an all-zero row gives dx = 0.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec_io.h"

namespace trident {
namespace {

using vec_io::out_as_float;
using vec_io::row_as_float;
using vec_io::store_row;
using vec_io::Vec;
constexpr int64_t kW = Vec::size();
// About 32K elements per task, so that small inputs stay on one thread.
constexpr int64_t kGrainElems = int64_t{1} << 15;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t grain_rows(int64_t n) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(n, 1));
}

float hsum(const Vec& v) {
  float t[kW];
  v.store(t);
  float s = 0.f;
  for (int64_t i = 0; i < kW; ++i) s += t[i];
  return s;
}

float hmax(const Vec& v) {
  float t[kW];
  v.store(t);
  float s = t[0];
  for (int64_t i = 1; i < kW; ++i) s = std::max(s, t[i]);
  return s;
}

// max_j scale * x_j
float scaled_max(const float* x, float scale, int64_t n) {
  const Vec vs(scale);
  Vec m0(kNegInf), m1(kNegInf);
  int64_t j = 0;
  for (; j + 2 * kW <= n; j += 2 * kW) {
    m0 = at::vec::maximum(m0, Vec::loadu(x + j) * vs);
    m1 = at::vec::maximum(m1, Vec::loadu(x + j + kW) * vs);
  }
  for (; j + kW <= n; j += kW) m0 = at::vec::maximum(m0, Vec::loadu(x + j) * vs);
  float m = hmax(at::vec::maximum(m0, m1));
  for (; j < n; ++j) m = std::max(m, x[j] * scale);
  return m;
}

// y_j = exp(scale * x_j - m) / sum_k exp(scale * x_k - m) over j < n; y may alias x. Returns the
// sum: >= 1 for finite scores (the max term is 1), NaN where a score is NaN or +inf, or m = -inf.
float softmax_row(const float* x, float* y, float scale, float m, int64_t n) {
  const Vec vs(scale), vm(m);
  Vec s0(0.f);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const Vec e = at::vec::fmsub(Vec::loadu(x + j), vs, vm).exp();
    e.store(y + j);
    s0 += e;
  }
  float s = hsum(s0);
  for (; j < n; ++j) {
    y[j] = std::exp(x[j] * scale - m);
    s += y[j];
  }
  const float inv = 1.f / s;
  const Vec vi(inv);
  j = 0;
  for (; j + kW <= n; j += kW) (Vec::loadu(y + j) * vi).store(y + j);
  for (; j < n; ++j) y[j] *= inv;
  return s;
}

// The rest of a row after its kept part: 0, or NaN after a NaN sum (as the reference's softmax).
template <typename T>
void fill_rest(T* y, int64_t n, float sum) {
  if (std::isnan(sum)) {
    std::fill(y, y + n, static_cast<T>(std::numeric_limits<float>::quiet_NaN()));
  } else {
    std::memset(static_cast<void*>(y), 0, sizeof(T) * n);
  }
}

// t_j = scale * x_j, or -inf where mask_j (exp(-inf - m) = 0 later); returns max_j t_j.
float masked_scores(const float* x, const bool* mask, float scale, float* t, int64_t n) {
  int64_t j = 0;
  float m = kNegInf;
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(kNegInf);
  __m256 vm = ninf;
  for (; j + 8 <= n; j += 8) {
    int64_t bytes;  // 8 bools (0 or 1) -> 8 int32 lanes -> all-ones lanes where masked
    std::memcpy(&bytes, mask + j, sizeof(bytes));
    const __m256i mi = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
    const __m256 keep_inf = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mi, _mm256_setzero_si256()));
    const __m256 sx = _mm256_mul_ps(_mm256_loadu_ps(x + j), vs);
    const __m256 v = _mm256_blendv_ps(sx, ninf, keep_inf);
    _mm256_storeu_ps(t + j, v);
    vm = _mm256_max_ps(vm, v);
  }
  m = hmax(Vec(vm));
#elif defined(CPU_CAPABILITY_AVX512)
  const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(kNegInf);
  __m512 vm = ninf;
  for (; j + 16 <= n; j += 16) {
    // 16 bools (0 or 1) -> 16 int32 lanes -> a lane mask set where masked
    const __m512i mi =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mask + j)));
    const __mmask16 masked = _mm512_test_epi32_mask(mi, mi);
    const __m512 v = _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), vs), masked, ninf);
    _mm512_storeu_ps(t + j, v);
    vm = _mm512_max_ps(vm, v);
  }
  m = hmax(Vec(vm));
#endif
  for (; j < n; ++j) {
    t[j] = mask[j] ? kNegInf : x[j] * scale;
    m = std::max(m, t[j]);
  }
  return m;
}

template <typename T>
void causal_fwd_kernel(const T* x, T* y, int64_t batches, int64_t sq, float scale) {
  const int64_t rows = batches * sq;
  at::parallel_for(0, rows, grain_rows(sq / 2 + 1), [&](int64_t r0, int64_t r1) {
    std::vector<float> xbuf(sq), ybuf(sq);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = r % sq + 1;  // kept columns j <= i
      const float* xr = row_as_float(x + r * sq, xbuf.data(), n);
      float* yr = out_as_float(y + r * sq, ybuf.data());
      const float sum = softmax_row(xr, yr, scale, scaled_max(xr, scale, n), n);
      store_row(yr, y + r * sq, n);
      fill_rest(y + r * sq + n, sq - n, sum);
    }
  });
}

template <typename T>
void masked_fwd_kernel(const T* x, const bool* mask, T* y, int64_t rows, int64_t heads_q,
                       int64_t sq, int64_t sk, bool mask_per_batch, float scale) {
  at::parallel_for(0, rows, grain_rows(sk), [&](int64_t r0, int64_t r1) {
    std::vector<float> xbuf(sk), tbuf(sk);
    float* t = tbuf.data();
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t mrow = (mask_per_batch ? (r / heads_q) * sq : 0) + r % sq;
      const bool* mr = mask + mrow * sk;
      const float* xr = row_as_float(x + r * sk, xbuf.data(), sk);
      const float m = masked_scores(xr, mr, scale, t, sk);
      if (m == kNegInf) {
        // Every column masked out: zeros. Else the kept scores are all -inf or NaN (std::max
        // drops a NaN): NaN, as the reference.
        const bool any_kept = std::memchr(mr, 0, sk) != nullptr;
        fill_rest(y + r * sk, sk, any_kept ? std::numeric_limits<float>::quiet_NaN() : 0.f);
        continue;
      }
      float* yr = out_as_float(y + r * sk, t);
      softmax_row(t, yr, 1.f, m, sk);
      store_row(yr, y + r * sk, sk);
    }
  });
}

template <typename T>
void softmax_bwd_kernel(const T* dy, const T* y, T* dx, int64_t rows, int64_t sk, float scale) {
  at::parallel_for(0, rows, grain_rows(sk), [&](int64_t r0, int64_t r1) {
    std::vector<float> dybuf(sk), ybuf(sk), dxbuf(sk);
    for (int64_t r = r0; r < r1; ++r) {
      const float* dyr = row_as_float(dy + r * sk, dybuf.data(), sk);
      const float* yr = row_as_float(y + r * sk, ybuf.data(), sk);
      float* dxr = out_as_float(dx + r * sk, dxbuf.data());
      Vec d0(0.f), d1(0.f);
      int64_t j = 0;
      for (; j + 2 * kW <= sk; j += 2 * kW) {
        d0 = at::vec::fmadd(Vec::loadu(dyr + j), Vec::loadu(yr + j), d0);
        d1 = at::vec::fmadd(Vec::loadu(dyr + j + kW), Vec::loadu(yr + j + kW), d1);
      }
      for (; j + kW <= sk; j += kW)
        d0 = at::vec::fmadd(Vec::loadu(dyr + j), Vec::loadu(yr + j), d0);
      float dot = hsum(d0 + d1);
      for (; j < sk; ++j) dot += dyr[j] * yr[j];
      const Vec vs(scale), vd(dot);
      j = 0;
      for (; j + kW <= sk; j += kW)
        (vs * Vec::loadu(yr + j) * (Vec::loadu(dyr + j) - vd)).store(dxr + j);
      for (; j < sk; ++j) dxr[j] = scale * yr[j] * (dyr[j] - dot);
      store_row(dxr, dx + r * sk, sk);
    }
  });
}

void check_scores(const char* op, const at::Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": ", name,
              " must be float32, bfloat16 or float16, got ", x.scalar_type());
}

}  // namespace

at::Tensor scaled_upper_triang_masked_softmax_fwd(const at::Tensor& x, double scale) {
  constexpr const char* op = "scaled_upper_triang_masked_softmax_fwd";
  check_scores(op, x, "x", 3);
  TORCH_CHECK(x.size(1) == x.size(2), op, ": x must be [B, sq, sk] with sq == sk, got ", x.sizes());
  at::Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    causal_fwd_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0),
                                x.size(1), static_cast<float>(scale));
  });
  return y;
}

at::Tensor scaled_masked_softmax_fwd(const at::Tensor& x, const at::Tensor& mask, double scale) {
  constexpr const char* op = "scaled_masked_softmax_fwd";
  check_scores(op, x, "x", 4);
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": mask must be bool, got ", mask.scalar_type());
  TORCH_CHECK(mask.is_contiguous(), op, ": mask must be contiguous");
  const int64_t b = x.size(0), np = x.size(1), sq = x.size(2), sk = x.size(3);
  TORCH_CHECK(mask.dim() == 4 && (mask.size(0) == b || mask.size(0) == 1) && mask.size(1) == 1 &&
                  mask.size(2) == sq && mask.size(3) == sk,
              op, ": mask must be [", b, " or 1, 1, ", sq, ", ", sk, "] for x of shape ", x.sizes(),
              ", got ", mask.sizes());
  at::Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  const bool per_batch = mask.size(0) == b && b > 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    masked_fwd_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), mask.const_data_ptr<bool>(),
                                y.data_ptr<scalar_t>(), b * np * sq, np * sq, sq, sk, per_batch,
                                static_cast<float>(scale));
  });
  return y;
}

at::Tensor scaled_masked_softmax_bwd(const at::Tensor& dy, const at::Tensor& y, double scale) {
  constexpr const char* op = "scaled_masked_softmax_bwd";
  TORCH_CHECK(y.dim() >= 1, op, ": y must have at least one dim, got shape ", y.sizes());
  TORCH_CHECK(y.is_contiguous() && dy.is_contiguous(), op, ": dy and y must be contiguous");
  TORCH_CHECK(at::isFloatingType(y.scalar_type()), op,
              ": y must be float32, bfloat16 or float16, got ", y.scalar_type());
  TORCH_CHECK(dy.sizes() == y.sizes(), op, ": dy shape ", dy.sizes(), " must equal y shape ",
              y.sizes());
  TORCH_CHECK(dy.scalar_type() == y.scalar_type(), op, ": dy dtype (", dy.scalar_type(),
              ") must match y dtype (", y.scalar_type(), ")");
  at::Tensor dx = at::empty_like(y);
  if (y.numel() == 0) return dx;
  const int64_t sk = y.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), op, [&] {
    softmax_bwd_kernel<scalar_t>(dy.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(),
                                 dx.data_ptr<scalar_t>(), y.numel() / sk, sk,
                                 static_cast<float>(scale));
  });
  return dx;
}

}  // namespace trident
