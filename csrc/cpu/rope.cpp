// Rotary position embedding (half-split, GPT-NeoX / HF LLaMA convention), CPU (ATen), fwd + bwd.
//
// x [s, b, n, hn]; cos, sin [s, b, d] (x's dtype, d even, d <= hn); h = d / 2. Per head, with
// x1 = x[:h], x2 = x[h:d] and c1, c2, s1, s2 the matching halves of cos and sin:
//   forward  (y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]):
//     y[:h]  = x1 * c1 - x2 * s1
//     y[h:d] = x2 * c2 + x1 * s2
//     y[d:]  = x[d:]                       (partial rotary: copied unchanged)
//   backward (the transpose of that linear map):
//     dx[:h]  = dy1 * c1 + dy2 * s2
//     dx[h:d] = dy2 * c2 - dy1 * s1
//     dx[d:]  = dy[d:]
// The backward is the forward with (s1, s2) replaced by (-s2, -s1). Products and sums in fp32, one
// rounding to the output dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "ops.h"
#include "vec_io.h"

namespace trident {
namespace {

using vec_io::Io;
using vec_io::kChunk;
using vec_io::Vec;

// out1 = a1 * c1 - a2 * s1, out2 = a2 * c2 + a1 * s2 on one kChunk-wide slice (two fp32 halves).
template <bool kBwd, typename T>
inline void rotate_chunk(const T* a1p, const T* a2p, const T* c1p, const T* c2p, const T* s1p,
                         const T* s2p, T* o1p, T* o2p) {
  Vec a1[2], a2[2], c1[2], c2[2], s1[2], s2[2], o1[2], o2[2];
  Io<T>::load(a1p, a1[0], a1[1]);
  Io<T>::load(a2p, a2[0], a2[1]);
  Io<T>::load(c1p, c1[0], c1[1]);
  Io<T>::load(c2p, c2[0], c2[1]);
  Io<T>::load(s1p, s1[0], s1[1]);
  Io<T>::load(s2p, s2[0], s2[1]);
  for (int k = 0; k < 2; ++k) {
    if (kBwd) {  // (s1, s2) -> (-s2, -s1)
      o1[k] = at::vec::fmadd(a1[k], c1[k], a2[k] * s2[k]);
      o2[k] = at::vec::fmsub(a2[k], c2[k], a1[k] * s1[k]);
    } else {
      o1[k] = at::vec::fmsub(a1[k], c1[k], a2[k] * s1[k]);
      o2[k] = at::vec::fmadd(a2[k], c2[k], a1[k] * s2[k]);
    }
  }
  Io<T>::store(o1p, o1[0], o1[1]);
  Io<T>::store(o2p, o2[0], o2[1]);
}

// Applies the rotation (kBwd = false) or its transpose (kBwd = true) to every head of rows
// [r0, r1) of in [rows, n, hn], writing out; cos/sin are [rows, d].
template <bool kBwd, typename T>
void rope_rows(const T* in, const T* cs, const T* sn, T* out, int64_t r0, int64_t r1, int64_t n,
               int64_t hn, int64_t d) {
  const int64_t h = d / 2;
  const int64_t hv = h - h % kChunk;  // vectorized part of each half
  for (int64_t r = r0; r < r1; ++r) {
    const T* c = cs + r * d;
    const T* s = sn + r * d;
    for (int64_t k = 0; k < n; ++k) {
      const T* a = in + (r * n + k) * hn;
      T* o = out + (r * n + k) * hn;
      for (int64_t i = 0; i < hv; i += kChunk) {
        rotate_chunk<kBwd>(a + i, a + h + i, c + i, c + h + i, s + i, s + h + i, o + i, o + h + i);
      }
      for (int64_t i = hv; i < h; ++i) {  // scalar tail (h not a multiple of kChunk)
        const float a1 = a[i], a2 = a[h + i];
        const float s1 = s[i], s2 = s[h + i];
        if (kBwd) {
          o[i] = static_cast<T>(a1 * float(c[i]) + a2 * s2);
          o[h + i] = static_cast<T>(a2 * float(c[h + i]) - a1 * s1);
        } else {
          o[i] = static_cast<T>(a1 * float(c[i]) - a2 * s1);
          o[h + i] = static_cast<T>(a2 * float(c[h + i]) + a1 * s2);
        }
      }
      if (d < hn) std::memcpy(o + d, a + d, sizeof(T) * (hn - d));
    }
  }
}

at::Tensor rope_impl(const char* op, const char* xname, const at::Tensor& x, const at::Tensor& cos,
                     const at::Tensor& sin, bool bwd) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), op, ": ",
              xname, ", cos and sin must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              op, ": ", xname, " must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), op,
              ": cos (", cos.scalar_type(), ") and sin (", sin.scalar_type(),
              ") must have the dtype of ", xname, " (", x.scalar_type(), ")");
  TORCH_CHECK(x.dim() == 4, op, ": ", xname, " must be [s, b, n, hn], got ", x.sizes());
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes(), op,
              ": cos and sin must both be [s, b, d], got ", cos.sizes(), " and ", sin.sizes());
  const int64_t s = x.size(0), b = x.size(1), n = x.size(2), hn = x.size(3), d = cos.size(2);
  TORCH_CHECK(cos.size(0) == s && cos.size(1) == b, op, ": cos/sin [s, b, d] = ", cos.sizes(),
              " must match the [s, b] = [", s, ", ", b, "] of ", xname);
  TORCH_CHECK(d % 2 == 0 && d <= hn, op, ": the rotary dim d = ", d,
              " must be even and <= the head dim hn = ", hn);
  TORCH_CHECK(x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), op, ": ", xname,
              ", cos and sin must be contiguous");
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const int64_t rows = s * b;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n * hn, 1));
  TRIDENT_DISPATCH_FLOATS(x.scalar_type(), "rope", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      if (bwd) {
        rope_rows<true>(xp, cp, sp, op_, r0, r1, n, hn, d);
      } else {
        rope_rows<false>(xp, cp, sp, op_, r0, r1, n, hn, d);
      }
    });
  });
  return out;
}

}  // namespace

at::Tensor rope_fwd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_impl("rope_fwd", "x", x, cos, sin, /*bwd=*/false);
}

at::Tensor rope_bwd(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_impl("rope_bwd", "dy", dy, cos, sin, /*bwd=*/true);
}

}  // namespace trident
