// Fused bias + activation kernels of the MLP (CPU, ATen): tanh-GeLU and SwiGLU, fwd and bwd.
//
// Shapes: x [rows, f] (GeLU) or [rows, 2f] (SwiGLU; any leading dims, the last one is the feature
// dim); bias [f] / [2f] of x's dtype, or an EMPTY tensor (numel 0) for no bias. Math in fp32, one
// rounding to x's dtype at the store.
//
// tanh-GeLU (torch's F.gelu(approximate="tanh")), u = x + bias, k0 = sqrt(2/pi), k1 = 0.044715:
//   y = 0.5 * u * (1 + tanh(z)),  z = k0 * (u + k1 * u^3)
//   gelu'(u) = 0.5 * (1 + t) + 0.5 * u * (1 - t^2) * k0 * (1 + 3 * k1 * u^2),  t = tanh(z)
// Evaluated with one exp through 0.5 * (1 + tanh(z)) = sigmoid(2z) =: s (so 1 - t^2 = 4 s (1 - s)):
//   y = u * s,   gelu'(u) = s * (1 + 2 * u * (1 - s) * (k0 + 3 * k0 * k1 * u^2))
//   bias_gelu_bwd returns {dx = dy * gelu'(u), dbias = sum_rows dx}; bias_gelu_bwd_into_dy writes dx
//   over dy (no new [rows, f] tensor) and returns dbias.
//
// SwiGLU, a = x[:, :f] + bias[:f] (gate), c = x[:, f:] + bias[f:] (up), sg = sigmoid(a):
//   y [rows, f] = silu(a) * c = a * sg * c
//   da = dy * c * sg * (1 + a * (1 - sg)),   dc = dy * a * sg      (dx [rows, 2f] = [da, dc])
//   bias_swiglu_bwd returns {dx, dbias [2f] = sum_rows dx}.
//
// dbias (EMPTY without a bias): the rows are split into at most num_threads contiguous chunks, each
// sums its fp32 dx values (before the rounding to x's dtype) into its own fp32 partial row, the
// partials are added in chunk order (deterministic for a given thread count) and cast to bias's
// dtype: no second pass over dx.
//
// exp is Vectorized::exp_u20 (inline polynomial, measured <= 4 ulp on [-30, 0]; ~1.5x faster here
// than the out-of-line Sleef exp); s and 1 - s inherit that relative error, far inside the 1e-6
// (fp32) error budget of y and dx.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ops.h"
#include "vec_io.h"

namespace trident {
namespace {

using vec_io::Io;
using vec_io::kChunk;
using vec_io::Vec;
// Rows per parallel task so that a task has at least ~32K elements (small inputs: one thread).
int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
}
// Row chunks of a backward that also sums dbias: one per thread at most, >= ~32K elements each.
int64_t num_chunks(int64_t rows, int64_t width) {
  const int64_t by_size = (rows + row_grain(width) - 1) / row_grain(width);
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), by_size));
}

// Loads n (<= kChunk) elements of x (+ bias when bias != nullptr) as two fp32 vectors.
template <typename T>
inline void load_biased(const T* x, const T* bias, int64_t n, Vec& a, Vec& b) {
  if (n == kChunk) {
    Io<T>::load(x, a, b);
  } else {
    Io<T>::load(x, n, a, b);
  }
  if (bias != nullptr) {
    Vec ba, bb;
    if (n == kChunk) {
      Io<T>::load(bias, ba, bb);
    } else {
      Io<T>::load(bias, n, ba, bb);
    }
    a = a + ba;
    b = b + bb;
  }
}

template <typename T>
inline void load_n(const T* p, int64_t n, Vec& a, Vec& b) {
  if (n == kChunk) {
    Io<T>::load(p, a, b);
  } else {
    Io<T>::load(p, n, a, b);
  }
}

template <typename T>
inline void store_n(T* p, int64_t n, const Vec& a, const Vec& b) {
  if (n == kChunk) {
    Io<T>::store(p, a, b);
  } else {
    Io<T>::store(p, n, a, b);
  }
}

constexpr float kK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kK1 = 0.044715f;

// Returns s = sigmoid(-arg) = 1 / (1 + e) and sets one_minus_s = 1 - s = e * s, with e = exp(arg).
// 1 - s is formed as e * s, not by subtraction, so it keeps full relative precision when s -> 1
// (gelu'(u) overshoots 1 by ~2e-6 near u = 5; 1 - s would lose it). arg is clamped to [-80, 80]:
// e stays finite (e * s -> 1, not inf * 0) and neither e nor s is ever subnormal (exp(-80) and
// sigmoid(-80) are 1.8e-35). Subnormals cost ~100x per operation on x86: pre-activations of size
// ~30 (|u| where GeLU saturates) made the whole kernel 6x slower before the clamp. The clamp changes
// results by < 1e-34 absolute.
inline Vec sigmoid_of_neg(const Vec& arg, Vec& one_minus_s) {
  const Vec one(1.0f);
  const Vec e = at::vec::clamp(arg, Vec(-80.0f), Vec(80.0f)).exp_u20();
  const Vec s = one / (one + e);
  one_minus_s = e * s;
  return s;
}

// s = sigmoid(2 z), z = k0 (u + k1 u^3).
inline Vec gelu_sigmoid(const Vec& u, Vec& one_minus_s) {
  const Vec m2k0(-2.0f * kK0), m2k0k1(-2.0f * kK0 * kK1);
  return sigmoid_of_neg(u * at::vec::fmadd(m2k0k1, u * u, m2k0), one_minus_s);  // arg = -2 z
}

inline Vec gelu_fwd_vec(const Vec& u) {
  Vec unused;
  return u * gelu_sigmoid(u, unused);
}

inline Vec gelu_grad_vec(const Vec& u) {
  const Vec one(1.0f), k0x2(2.0f * kK0), k0k1x6(6.0f * kK0 * kK1);
  Vec one_minus_s;
  const Vec s = gelu_sigmoid(u, one_minus_s);
  // s * (1 + u (1 - s) (2 k0 + 6 k0 k1 u^2))
  const Vec poly = at::vec::fmadd(k0k1x6, u * u, k0x2);
  return s * at::vec::fmadd(u * one_minus_s, poly, one);
}

// Checks shared by all four ops: CPU, supported float dtype, contiguous, bias [width] or empty.
void check_x_bias(const char* op, const at::Tensor& x, const at::Tensor& bias, int64_t width) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dim");
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.device().is_cpu(), op, ": bias must be a CPU tensor");
    TORCH_CHECK(bias.scalar_type() == x.scalar_type(), op, ": bias dtype (", bias.scalar_type(),
                ") must equal x dtype (", x.scalar_type(), ")");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == width, op, ": bias must have shape [", width,
                "] (the last dim of x) or be empty, got ", bias.sizes());
    TORCH_CHECK(bias.is_contiguous(), op, ": bias must be contiguous");
  }
}

void check_dy(const char* op, const at::Tensor& dy, const at::Tensor& x, at::IntArrayRef shape) {
  TORCH_CHECK(dy.device().is_cpu(), op, ": dy must be a CPU tensor");
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), op, ": dy dtype (", dy.scalar_type(),
              ") must equal x dtype (", x.scalar_type(), ")");
  TORCH_CHECK(dy.sizes() == shape, op, ": dy must have shape ", shape, ", got ", dy.sizes());
  TORCH_CHECK(dy.is_contiguous(), op, ": dy must be contiguous");
}

template <typename T>
const T* bias_ptr(const at::Tensor& bias) {
  return bias.defined() && bias.numel() > 0 ? bias.data_ptr<T>() : nullptr;
}

// Adds n (<= kChunk) fp32 values to acc[0, n) (acc == nullptr: no bias grad wanted).
inline void accumulate_n(float* acc, int64_t n, const Vec& a, const Vec& b) {
  if (acc == nullptr) return;
  Vec s0, s1;
  load_n(acc, n, s0, s1);
  store_n(acc, n, s0 + a, s1 + b);
}

// Runs row_fn(r, acc) for every row r in parallel. Without a bias acc is nullptr and the result is
// EMPTY; with one, every chunk of rows (num_chunks) adds its fp32 dx into its own zeroed partial
// row acc[width], and the result is the partials summed in chunk order, cast to bias's dtype.
template <typename RowFn>
at::Tensor rows_with_dbias(int64_t rows, int64_t width, const at::Tensor& bias,
                           const RowFn& row_fn) {
  if (!(bias.defined() && bias.numel() > 0)) {
    at::parallel_for(0, rows, row_grain(width), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) row_fn(r, nullptr);
    });
    return at::empty({0}, bias.defined() ? bias.options() : at::TensorOptions());
  }
  const int64_t chunks = num_chunks(rows, width);
  std::vector<float> part(static_cast<size_t>(chunks * width), 0.0f);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* acc = part.data() + c * width;
      for (int64_t r = rows * c / chunks; r < rows * (c + 1) / chunks; ++r) row_fn(r, acc);
    }
  });
  at::Tensor sum = at::empty({width}, bias.options().dtype(at::kFloat));
  float* out = sum.data_ptr<float>();
  std::copy(part.begin(), part.begin() + width, out);
  for (int64_t c = 1; c < chunks; ++c) {
    const float* p = part.data() + c * width;
    for (int64_t j = 0; j < width; ++j) out[j] += p[j];
  }
  return sum.to(bias.scalar_type());
}

}  // namespace

at::Tensor bias_gelu_fwd(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1, "bias_gelu_fwd: x must have at least one dim");
  const int64_t f = x.size(-1);
  check_x_bias("bias_gelu_fwd", x, bias, f);
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  const int64_t rows = x.numel() / f;
  TRIDENT_DISPATCH_FLOATS(x.scalar_type(), "bias_gelu_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* bp = bias_ptr<scalar_t>(bias);
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(f), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j = 0; j < f; j += kChunk) {
          const int64_t n = std::min(kChunk, f - j);
          Vec u0, u1;
          load_biased(xp + r * f + j, bp ? bp + j : nullptr, n, u0, u1);
          store_n(yp + r * f + j, n, gelu_fwd_vec(u0), gelu_fwd_vec(u1));
        }
      }
    });
  });
  return y;
}

namespace {

// dx into `dx` (a new tensor, or dy itself: every element is read before its own slot is written).
at::Tensor bias_gelu_bwd_into(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& bias,
                              at::Tensor& dx) {
  const int64_t f = x.size(-1);
  const int64_t rows = f == 0 ? 0 : x.numel() / f;
  at::Tensor dbias;
  TRIDENT_DISPATCH_FLOATS(x.scalar_type(), "bias_gelu_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = dy.data_ptr<scalar_t>();
    const scalar_t* bp = bias_ptr<scalar_t>(bias);
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    dbias = rows_with_dbias(rows, f, bias, [&](int64_t r, float* acc) {
      for (int64_t j = 0; j < f; j += kChunk) {
        const int64_t n = std::min(kChunk, f - j), o = r * f + j;
        Vec u0, u1, g0, g1;
        load_biased(xp + o, bp ? bp + j : nullptr, n, u0, u1);
        load_n(gp + o, n, g0, g1);
        const Vec d0 = g0 * gelu_grad_vec(u0), d1 = g1 * gelu_grad_vec(u1);
        store_n(dxp + o, n, d0, d1);
        accumulate_n(acc ? acc + j : nullptr, n, d0, d1);
      }
    });
  });
  return dbias;
}

void check_gelu_bwd(const char* op, const at::Tensor& dy, const at::Tensor& x,
                    const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dim");
  check_x_bias(op, x, bias, x.size(-1));
  check_dy(op, dy, x, x.sizes());
}

}  // namespace

std::vector<at::Tensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                      const at::Tensor& bias) {
  check_gelu_bwd("bias_gelu_bwd", dy, x, bias);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dbias = bias_gelu_bwd_into(dy, x, bias, dx);
  return {dx, dbias};
}

at::Tensor bias_gelu_bwd_into_dy(at::Tensor dy, const at::Tensor& x, const at::Tensor& bias) {
  check_gelu_bwd("bias_gelu_bwd_into_dy", dy, x, bias);
  return bias_gelu_bwd_into(dy, x, bias, dy);
}

at::Tensor bias_swiglu_fwd(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1, "bias_swiglu_fwd: x must have at least one dim");
  const int64_t f2 = x.size(-1);
  TORCH_CHECK(f2 % 2 == 0, "bias_swiglu_fwd: the last dim of x (", f2,
              ") must be even: [gate, up] halves");
  check_x_bias("bias_swiglu_fwd", x, bias, f2);
  const int64_t f = f2 / 2;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = f;
  at::Tensor y = at::empty(shape, x.options());
  if (x.numel() == 0) return y;
  const int64_t rows = x.numel() / f2;
  TRIDENT_DISPATCH_FLOATS(x.scalar_type(), "bias_swiglu_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* bp = bias_ptr<scalar_t>(bias);
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(f2), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xa = xp + r * f2;  // gate half
        const scalar_t* xc = xa + f;       // up half
        for (int64_t j = 0; j < f; j += kChunk) {
          const int64_t n = std::min(kChunk, f - j);
          Vec a0, a1, c0, c1;
          load_biased(xa + j, bp ? bp + j : nullptr, n, a0, a1);
          load_biased(xc + j, bp ? bp + f + j : nullptr, n, c0, c1);
          Vec unused;
          const Vec y0 = a0 * sigmoid_of_neg(a0.neg(), unused) * c0;
          const Vec y1 = a1 * sigmoid_of_neg(a1.neg(), unused) * c1;
          store_n(yp + r * f + j, n, y0, y1);
        }
      }
    });
  });
  return y;
}

std::vector<at::Tensor> bias_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                        const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1, "bias_swiglu_bwd: x must have at least one dim");
  const int64_t f2 = x.size(-1);
  TORCH_CHECK(f2 % 2 == 0, "bias_swiglu_bwd: the last dim of x (", f2,
              ") must be even: [gate, up] halves");
  check_x_bias("bias_swiglu_bwd", x, bias, f2);
  const int64_t f = f2 / 2;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = f;
  check_dy("bias_swiglu_bwd", dy, x, shape);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const int64_t rows = f2 == 0 ? 0 : x.numel() / f2;
  at::Tensor dbias;
  TRIDENT_DISPATCH_FLOATS(x.scalar_type(), "bias_swiglu_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = dy.data_ptr<scalar_t>();
    const scalar_t* bp = bias_ptr<scalar_t>(bias);
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    const Vec one(1.0f);
    dbias = rows_with_dbias(rows, f2, bias, [&](int64_t r, float* acc) {
      const int64_t ra = r * f2;
      for (int64_t j = 0; j < f; j += kChunk) {
        const int64_t n = std::min(kChunk, f - j);
        Vec a[2], c[2], g[2], da[2], dc[2];
        load_biased(xp + ra + j, bp ? bp + j : nullptr, n, a[0], a[1]);
        load_biased(xp + ra + f + j, bp ? bp + f + j : nullptr, n, c[0], c[1]);
        load_n(gp + r * f + j, n, g[0], g[1]);
        for (int k = 0; k < 2; ++k) {
          Vec one_minus_sg;
          const Vec sg = sigmoid_of_neg(a[k].neg(), one_minus_sg);
          const Vec gsg = g[k] * sg;
          dc[k] = gsg * a[k];
          da[k] = gsg * c[k] * at::vec::fmadd(a[k], one_minus_sg, one);
        }
        store_n(dxp + ra + j, n, da[0], da[1]);
        store_n(dxp + ra + f + j, n, dc[0], dc[1]);
        accumulate_n(acc ? acc + j : nullptr, n, da[0], da[1]);
        accumulate_n(acc ? acc + f + j : nullptr, n, dc[0], dc[1]);
      }
    });
  });
  return {dx, dbias};
}

}  // namespace trident
