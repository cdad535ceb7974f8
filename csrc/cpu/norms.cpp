// CPU LayerNorm and RMSNorm, forward and backward (contract #16, "Norms").
//
// Rows are independent: x is seen as [rows, h] and every row is normalised over its h channels.
// All math is fp32 (bf16/fp16 rows are converted to a per-thread fp32 buffer first).
//
// LayerNorm, forward:
//   mean = (1/h) sum_j x_j,  var = (1/h) sum_j (x_j - mean)^2  (biased, as F.layer_norm; two passes
//   over the cached row, so no catastrophic cancellation), rstd = 1 / sqrt(var + eps)
//   xhat_j = (x_j - mean) * rstd,  y_j = xhat_j * gamma_j + beta_j
// LayerNorm, backward (g_j = dy_j * gamma_j):
//   dx_j = rstd * (g_j - (1/h) sum_k g_k - xhat_j * (1/h) sum_k g_k xhat_k)
//   dgamma_j = sum_rows dy_j xhat_j,  dbeta_j = sum_rows dy_j
// RMSNorm, forward:
//   rstd = 1 / sqrt((1/h) sum_j x_j^2 + eps),  xhat_j = x_j * rstd,
//   y_j = round_to_xdtype(xhat_j) * gamma_j   (the product is rounded to x's dtype once more)
// RMSNorm, backward (g_j = dy_j * gamma_j):
//   dx_j = rstd * (g_j - xhat_j * (1/h) sum_k g_k xhat_k),  dgamma_j = sum_rows dy_j xhat_j
//
// Outputs (y, dx) of vec_io::kStreamBytes and more are written with streaming stores where their pages are
// resident: they go to memory without first being read into the cache (see vec_io.h); on the 2-core box this made
// LayerNorm fwd + bwd at GPT-2 124M shapes ~1.2x ATen's instead of level with it.
//
// dgamma / dbeta: the rows are split into at most num_threads contiguous chunks; each chunk sums
// (in blocks of 4 rows, row order kept; every 64 rows' sum added to the chunk's) into its own fp32
// partial row, the partials are added in chunk order (deterministic for a given thread count) and
// cast to gamma's dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec_io.h"

namespace trident {
namespace {

using vec_io::out_row;
using vec_io::row_as_float;
using vec_io::store_row;
using vec_io::Vec;
using vec_io::write_row;
constexpr int64_t kW = Vec::size();
// About 32K elements per task, so that small inputs stay on one thread.
constexpr int64_t kGrainElems = int64_t{1} << 15;

int64_t grain_rows(int64_t h) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(h, 1));
}

float hsum(const Vec& v) {
  float t[kW];
  v.store(t);
  float s = 0.f;
  for (int64_t i = 0; i < kW; ++i) s += t[i];
  return s;
}

// The row reductions below keep four vector accumulators (four independent add / FMA chains): with
// one or two, a row of 768 floats is bound by the adds' latency, not by the loads.

// sum_j (a_j - m)^2  (m = 0: sum of squares)
float row_sq_dev(const float* a, float m, int64_t n) {
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  const Vec vm(m);
  int64_t j = 0;
  for (; j + 4 * kW <= n; j += 4 * kW) {
    const Vec d0 = Vec::loadu(a + j) - vm, d1 = Vec::loadu(a + j + kW) - vm;
    const Vec d2 = Vec::loadu(a + j + 2 * kW) - vm, d3 = Vec::loadu(a + j + 3 * kW) - vm;
    s0 = at::vec::fmadd(d0, d0, s0);
    s1 = at::vec::fmadd(d1, d1, s1);
    s2 = at::vec::fmadd(d2, d2, s2);
    s3 = at::vec::fmadd(d3, d3, s3);
  }
  for (; j + kW <= n; j += kW) {
    const Vec d = Vec::loadu(a + j) - vm;
    s0 = at::vec::fmadd(d, d, s0);
  }
  float s = hsum((s0 + s1) + (s2 + s3));
  for (; j < n; ++j) s += (a[j] - m) * (a[j] - m);
  return s;
}

float row_sum(const float* a, int64_t n) {
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t j = 0;
  for (; j + 4 * kW <= n; j += 4 * kW) {
    s0 += Vec::loadu(a + j);
    s1 += Vec::loadu(a + j + kW);
    s2 += Vec::loadu(a + j + 2 * kW);
    s3 += Vec::loadu(a + j + 3 * kW);
  }
  for (; j + kW <= n; j += kW) s0 += Vec::loadu(a + j);
  float s = hsum((s0 + s1) + (s2 + s3));
  for (; j < n; ++j) s += a[j];
  return s;
}

// {sum_j dy_j g_j, sum_j dy_j g_j (x_j - m)} in one pass, four accumulator chains per sum.
void row_grad_sums(const float* dy, const float* g, const float* x, float m, int64_t n, float* s_g,
                   float* s_gx) {
  Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f), b0(0.f), b1(0.f), b2(0.f), b3(0.f);
  const Vec vm(m);
  int64_t j = 0;
  for (; j + 4 * kW <= n; j += 4 * kW) {
    const Vec g0 = Vec::loadu(dy + j) * Vec::loadu(g + j);
    const Vec g1 = Vec::loadu(dy + j + kW) * Vec::loadu(g + j + kW);
    const Vec g2 = Vec::loadu(dy + j + 2 * kW) * Vec::loadu(g + j + 2 * kW);
    const Vec g3 = Vec::loadu(dy + j + 3 * kW) * Vec::loadu(g + j + 3 * kW);
    a0 += g0;
    a1 += g1;
    a2 += g2;
    a3 += g3;
    b0 = at::vec::fmadd(g0, Vec::loadu(x + j) - vm, b0);
    b1 = at::vec::fmadd(g1, Vec::loadu(x + j + kW) - vm, b1);
    b2 = at::vec::fmadd(g2, Vec::loadu(x + j + 2 * kW) - vm, b2);
    b3 = at::vec::fmadd(g3, Vec::loadu(x + j + 3 * kW) - vm, b3);
  }
  for (; j + kW <= n; j += kW) {
    const Vec gg = Vec::loadu(dy + j) * Vec::loadu(g + j);
    a0 += gg;
    b0 = at::vec::fmadd(gg, Vec::loadu(x + j) - vm, b0);
  }
  float sa = hsum((a0 + a1) + (a2 + a3)), sb = hsum((b0 + b1) + (b2 + b3));
  for (; j < n; ++j) {
    const float gg = dy[j] * g[j];
    sa += gg;
    sb += gg * (x[j] - m);
  }
  *s_g = sa;
  *s_gx = sb;
}

void check_rows(const char* op, const at::Tensor& x, const at::Tensor& gamma, const char* xname) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op, ": ", xname,
              " must have at least one dim and h = size(-1) >= 1, got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), op, ": ", xname, " must be contiguous");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": ", xname,
              " must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(gamma.dim() == 1 && gamma.size(0) == x.size(-1), op,
              ": gamma must have shape [h] = [", x.size(-1), "], got ", gamma.sizes());
  TORCH_CHECK(gamma.scalar_type() == x.scalar_type(), op, ": gamma dtype (", gamma.scalar_type(),
              ") must match ", xname, " dtype (", x.scalar_type(), ")");
  TORCH_CHECK(gamma.is_contiguous(), op, ": gamma must be contiguous");
}

void check_same(const char* op, const at::Tensor& a, const char* aname, const at::Tensor& x) {
  TORCH_CHECK(a.sizes() == x.sizes(), op, ": ", aname, " shape ", a.sizes(), " must equal x shape ",
              x.sizes());
  TORCH_CHECK(a.scalar_type() == x.scalar_type(), op, ": ", aname, " dtype (", a.scalar_type(),
              ") must match x dtype (", x.scalar_type(), ")");
  TORCH_CHECK(a.is_contiguous(), op, ": ", aname, " must be contiguous");
}

void check_stat(const char* op, const at::Tensor& s, const char* sname, int64_t rows) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == rows && s.is_contiguous(), op, ": ",
              sname, " must be a contiguous float32 tensor with rows = ", rows,
              " elements, got dtype ", s.scalar_type(), " and shape ", s.sizes());
}

// Leading-dims shape of x (the shape of mean / rstd).
std::vector<int64_t> stat_shape(const at::Tensor& x) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

// Whether the output out[0, rows x h) is written with streaming stores (see vec_io::worth_streaming).
template <typename T>
bool streamed(const T* out, int64_t rows, int64_t h) {
  return vec_io::worth_streaming(out, rows * h * static_cast<int64_t>(sizeof(T)));
}

// Row chunks for a backward with a cross-row reduction: one per thread at most.
int64_t num_chunks(int64_t rows, int64_t h) {
  const int64_t by_size = (rows + grain_rows(h) - 1) / grain_rows(h);
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), by_size));
}

// to[j] += from[j], then from[j] = 0.
void add_and_clear(float* from, float* to, int64_t n) {
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    (Vec::loadu(to + j) + Vec::loadu(from + j)).store(to + j);
    Vec(0.f).store(from + j);
  }
  for (; j < n; ++j) {
    to[j] += from[j];
    from[j] = 0.f;
  }
}

// Sum the [chunks, h] fp32 partials in chunk order into out[h].
void sum_partials(const float* part, int64_t chunks, int64_t h, float* out) {
  std::memcpy(out, part, sizeof(float) * h);
  for (int64_t c = 1; c < chunks; ++c) {
    const float* p = part + c * h;
    int64_t j = 0;
    for (; j + kW <= h; j += kW) (Vec::loadu(out + j) + Vec::loadu(p + j)).store(out + j);
    for (; j < h; ++j) out[j] += p[j];
  }
}

template <typename T>
void layer_norm_fwd_kernel(const T* x, const float* gamma, const float* beta, T* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps) {
  const bool stream = streamed(y, rows, h);
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t r0, int64_t r1) {
    std::vector<float> xbuf(h), ybuf(h);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = row_as_float(x + r * h, xbuf.data(), h);
      const float m = row_sum(xr, h) / static_cast<float>(h);
      const float rs = 1.f / std::sqrt(row_sq_dev(xr, m, h) / static_cast<float>(h) + eps);
      float* yr = out_row(y + r * h, ybuf.data(), stream);
      const Vec vm(m), vr(rs);
      int64_t j = 0;
      for (; j + kW <= h; j += kW) {
        const Vec xh = (Vec::loadu(xr + j) - vm) * vr;
        at::vec::fmadd(xh, Vec::loadu(gamma + j), Vec::loadu(beta + j)).store(yr + j);
      }
      for (; j < h; ++j) yr[j] = (xr[j] - m) * rs * gamma[j] + beta[j];
      write_row(yr, y + r * h, h, stream);
      mean[r] = m;
      rstd[r] = rs;
    }
    if (stream) vec_io::stream_fence();
  });
}

// Shared by LayerNorm (has_beta: mean subtracted, dbeta produced) and RMSNorm (mean = 0).
template <typename T, bool kLayer>
void norm_bwd_kernel(const T* dy, const T* x, const float* mean, const float* rstd,
                     const float* gamma, T* dx, float* dgamma_part, float* dbeta_part, int64_t rows,
                     int64_t h, int64_t chunks) {
  // Rows go in blocks of kB: the dgamma / dbeta partial rows are loaded and stored once per block.
  constexpr int64_t kB = 4;
  // Two-level sums: kInner rows into a running row (zeroed after), that into the chunk's partial. A single running
  // fp32 sum over thousands of rows (one thread) drifted 1.2e-6 from float64; this keeps it well below 1e-6.
  constexpr int64_t kInner = 64;
  const bool stream = streamed(dx, rows, h);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> xbuf(kB * h), dybuf(kB * h), dxbuf(kB * h);
    std::vector<float> inner(kLayer ? 2 * h : h);
    const float inv_h = 1.f / static_cast<float>(h);
    for (int64_t c = c0; c < c1; ++c) {
      float* const part_g = dgamma_part + c * h;
      float* const part_b = kLayer ? dbeta_part + c * h : nullptr;
      std::fill(part_g, part_g + h, 0.f);
      if (kLayer) std::fill(part_b, part_b + h, 0.f);
      std::fill(inner.begin(), inner.end(), 0.f);
      float* dg = inner.data();
      float* db = kLayer ? inner.data() + h : nullptr;
      const int64_t ra = rows * c / chunks, rb = rows * (c + 1) / chunks;
      for (int64_t r0 = ra; r0 < rb; r0 += kB) {
        const int64_t nb = std::min(kB, rb - r0);
        const float *xr[kB], *dyr[kB];
        float* dxr[kB];
        float m[kB], rs[kB], c1[kB], c2[kB];
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t r = r0 + i;
          xr[i] = row_as_float(x + r * h, xbuf.data() + i * h, h);
          dyr[i] = row_as_float(dy + r * h, dybuf.data() + i * h, h);
          dxr[i] = out_row(dx + r * h, dxbuf.data() + i * h, stream);
          m[i] = kLayer ? mean[r] : 0.f;
          rs[i] = rstd[r];
          float s_g = 0.f, s_gx = 0.f;
          row_grad_sums(dyr[i], gamma, xr[i], m[i], h, &s_g, &s_gx);
          // dx = rstd * (g - c1 - xhat * c2), c1 = mean_h(g), c2 = mean_h(g * xhat). The
          // difference is formed before the (possibly large) rstd factor: for h = 1 LayerNorm
          // it is exactly 0.
          c1[i] = kLayer ? s_g * inv_h : 0.f;
          c2[i] = rs[i] * s_gx * inv_h;
        }
        int64_t j = 0;
        for (; j + kW <= h; j += kW) {
          const Vec gam = Vec::loadu(gamma + j);
          Vec vdg = Vec::loadu(dg + j), vdb = kLayer ? Vec::loadu(db + j) : Vec(0.f);
          for (int64_t i = 0; i < nb; ++i) {
            const Vec dyv = Vec::loadu(dyr[i] + j), vr(rs[i]);
            const Vec xh = (Vec::loadu(xr[i] + j) - Vec(m[i])) * vr;
            (vr * (dyv * gam - Vec(c1[i]) - xh * Vec(c2[i]))).store(dxr[i] + j);
            vdg = at::vec::fmadd(dyv, xh, vdg);
            if (kLayer) vdb = vdb + dyv;
          }
          vdg.store(dg + j);
          if (kLayer) vdb.store(db + j);
        }
        for (; j < h; ++j) {
          for (int64_t i = 0; i < nb; ++i) {
            const float xh = (xr[i][j] - m[i]) * rs[i];
            dxr[i][j] = rs[i] * (dyr[i][j] * gamma[j] - c1[i] - xh * c2[i]);
            dg[j] += dyr[i][j] * xh;
            if (kLayer) db[j] += dyr[i][j];
          }
        }
        for (int64_t i = 0; i < nb; ++i) {
          // LayerNorm over one channel is constant (y = beta): dx is exactly 0, whatever
          // the compiler's FMA contraction did to g - c1 above.
          if (kLayer && h == 1) dxr[i][0] = 0.f;
          write_row(dxr[i], dx + (r0 + i) * h, h, stream);
        }
        if ((r0 + nb - ra) % kInner == 0 || r0 + nb == rb) {
          add_and_clear(dg, part_g, h);
          if (kLayer) add_and_clear(db, part_b, h);
        }
      }
    }
    if (stream) vec_io::stream_fence();
  });
}

template <typename T>
void rms_norm_fwd_kernel(const T* x, const float* gamma, T* y, float* rstd, int64_t rows, int64_t h,
                         float eps) {
  const bool stream = streamed(y, rows, h);
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t r0, int64_t r1) {
    std::vector<float> xbuf(h), ybuf(h);
    std::vector<T> tbuf(stream && !std::is_same_v<T, float> ? h : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = row_as_float(x + r * h, xbuf.data(), h);
      const float rs = 1.f / std::sqrt(row_sq_dev(xr, 0.f, h) / static_cast<float>(h) + eps);
      float* yr = out_row(y + r * h, ybuf.data(), stream);
      T* yt = stream ? tbuf.data() : y + r * h;  // where the 16-bit xhat is rounded
      const Vec vr(rs);
      int64_t j = 0;
      if constexpr (std::is_same_v<T, float>) {
        for (; j + kW <= h; j += kW)
          (Vec::loadu(xr + j) * vr * Vec::loadu(gamma + j)).store(yr + j);
        for (; j < h; ++j) yr[j] = xr[j] * rs * gamma[j];
      } else {
        // Round xhat to T (written to y), read it back, multiply by gamma, round again.
        for (; j + kW <= h; j += kW) (Vec::loadu(xr + j) * vr).store(yr + j);
        for (; j < h; ++j) yr[j] = xr[j] * rs;
        store_row(yr, yt, h);
        row_as_float(yt, yr, h);
        j = 0;
        for (; j + kW <= h; j += kW) (Vec::loadu(yr + j) * Vec::loadu(gamma + j)).store(yr + j);
        for (; j < h; ++j) yr[j] *= gamma[j];
        if (!stream) store_row(yr, yt, h);
      }
      if (stream) vec_io::stream_row(yr, y + r * h, h);
      rstd[r] = rs;
    }
    if (stream) vec_io::stream_fence();
  });
}

}  // namespace

std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& gamma,
                                       const at::Tensor& beta, double eps) {
  constexpr const char* op = "layer_norm_fwd";
  check_rows(op, x, gamma, "x");
  TORCH_CHECK(beta.sizes() == gamma.sizes() && beta.scalar_type() == gamma.scalar_type() &&
                  beta.is_contiguous(),
              op, ": beta must be a contiguous [", x.size(-1), "] tensor of dtype ",
              x.scalar_type(), ", got ", beta.scalar_type(), " ", beta.sizes());
  const int64_t h = x.size(-1), rows = x.numel() / h;
  const at::Tensor gf = gamma.to(at::kFloat).contiguous(), bf = beta.to(at::kFloat).contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor mean = at::empty(stat_shape(x), x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty(stat_shape(x), x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    layer_norm_fwd_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), gf.const_data_ptr<float>(),
                                    bf.const_data_ptr<float>(), y.data_ptr<scalar_t>(),
                                    mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, h,
                                    static_cast<float>(eps));
  });
  return {y, mean, rstd};
}

std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& mean, const at::Tensor& rstd,
                                       const at::Tensor& gamma) {
  constexpr const char* op = "layer_norm_bwd";
  check_rows(op, x, gamma, "x");
  check_same(op, dy, "dy", x);
  const int64_t h = x.size(-1), rows = x.numel() / h;
  check_stat(op, mean, "mean", rows);
  check_stat(op, rstd, "rstd", rows);
  const at::Tensor gf = gamma.to(at::kFloat).contiguous();
  const int64_t chunks = num_chunks(rows, h);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor part = at::empty({2, chunks, h}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    norm_bwd_kernel<scalar_t, true>(
        dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), mean.const_data_ptr<float>(),
        rstd.const_data_ptr<float>(), gf.const_data_ptr<float>(), dx.data_ptr<scalar_t>(),
        part[0].data_ptr<float>(), part[1].data_ptr<float>(), rows, h, chunks);
  });
  at::Tensor sums = at::empty({2, h}, x.options().dtype(at::kFloat));
  sum_partials(part[0].const_data_ptr<float>(), chunks, h, sums[0].data_ptr<float>());
  sum_partials(part[1].const_data_ptr<float>(), chunks, h, sums[1].data_ptr<float>());
  return {dx, sums[0].to(gamma.scalar_type()), sums[1].to(gamma.scalar_type())};
}

std::vector<at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& gamma, double eps) {
  constexpr const char* op = "rms_norm_fwd";
  check_rows(op, x, gamma, "x");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  const at::Tensor gf = gamma.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty(stat_shape(x), x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    rms_norm_fwd_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), gf.const_data_ptr<float>(),
                                  y.data_ptr<scalar_t>(), rstd.data_ptr<float>(), rows, h,
                                  static_cast<float>(eps));
  });
  return {y, rstd};
}

std::vector<at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                     const at::Tensor& rstd, const at::Tensor& gamma) {
  constexpr const char* op = "rms_norm_bwd";
  check_rows(op, x, gamma, "x");
  check_same(op, dy, "dy", x);
  const int64_t h = x.size(-1), rows = x.numel() / h;
  check_stat(op, rstd, "rstd", rows);
  const at::Tensor gf = gamma.to(at::kFloat).contiguous();
  const int64_t chunks = num_chunks(rows, h);
  at::Tensor dx = at::empty_like(x);
  at::Tensor part = at::empty({chunks, h}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    norm_bwd_kernel<scalar_t, false>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                     nullptr, rstd.const_data_ptr<float>(),
                                     gf.const_data_ptr<float>(), dx.data_ptr<scalar_t>(),
                                     part.data_ptr<float>(), nullptr, rows, h, chunks);
  });
  at::Tensor dgamma = at::empty({h}, x.options().dtype(at::kFloat));
  sum_partials(part.const_data_ptr<float>(), chunks, h, dgamma.data_ptr<float>());
  return {dx, dgamma.to(gamma.scalar_type())};
}

}  // namespace trident
