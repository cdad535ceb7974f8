// Shared helpers of the CPU kernels: the dtype dispatch, fp32 vector loads/stores of float, bfloat16
// and float16 data, and fp32 views of rows. Header-only (templates and inline functions).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>  // convert_{to,from}_float for bfloat16 / half (AVX512 too)
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

// float32 / bfloat16 / float16 only (the contract's dtypes; others are rejected by the checks, so
// double is not instantiated).
#define TRIDENT_DISPATCH_FLOATS(TYPE, NAME, ...)                                 \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                 \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE( \
                         at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace trident {
namespace vec_io {

using Vec = at::vec::Vectorized<float>;

// Elements per chunk: two fp32 vectors, i.e. one vector of a 16-bit dtype.
constexpr int64_t kChunk = 2 * Vec::size();

// Loads/stores kChunk elements of T as two fp32 vectors; the `n` overloads handle a tail of
// n < kChunk elements (missing lanes read as 0, only n elements are written).
template <typename T>
struct Io {
  using VT = at::vec::Vectorized<T>;
  static void load(const T* p, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(VT::loadu(p));
  }
  static void load(const T* p, int64_t n, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(VT::loadu(p, n));
  }
  static void store(T* p, const Vec& a, const Vec& b) {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
  static void store(T* p, int64_t n, const Vec& a, const Vec& b) {
    at::vec::convert_from_float<T>(a, b).store(p, n);
  }
};

template <>
struct Io<float> {
  static void load(const float* p, Vec& a, Vec& b) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + Vec::size());
  }
  static void load(const float* p, int64_t n, Vec& a, Vec& b) {
    a = Vec::loadu(p, std::min<int64_t>(n, Vec::size()));
    b = n > Vec::size() ? Vec::loadu(p + Vec::size(), n - Vec::size()) : Vec(0.0f);
  }
  static void store(float* p, const Vec& a, const Vec& b) {
    a.store(p);
    b.store(p + Vec::size());
  }
  static void store(float* p, int64_t n, const Vec& a, const Vec& b) {
    a.store(p, std::min<int64_t>(n, Vec::size()));
    if (n > Vec::size()) b.store(p + Vec::size(), n - Vec::size());
  }
};

// fp32 view of a row: the row itself for fp32, else the row converted into buf.
template <typename T>
inline const float* row_as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
    using VecT = at::vec::Vectorized<T>;
    static_assert(VecT::size() == 2 * Vec::size(),
                  "reduced-float vector must hold two float vectors");
    int64_t j = 0;
    for (; j + VecT::size() <= n; j += VecT::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(VecT::loadu(src + j));
      lo.store(buf + j);
      hi.store(buf + j + Vec::size());
    }
    for (; j < n; ++j) buf[j] = static_cast<float>(src[j]);
    return buf;
  } else {
    for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<float>(src[j]);
    return buf;
  }
}

// Where to write an fp32 result row: straight into dst for fp32, else into buf (then store_row).
template <typename T>
inline float* out_as_float(T* dst, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    return buf;
  }
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) at::vec::convert(src, dst, n);
}

}  // namespace vec_io
}  // namespace trident
