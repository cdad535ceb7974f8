// Shared helpers of the CPU kernels: the dtype dispatch, fp32 vector loads/stores of float, bfloat16
// and float16 data, and fp32 views of rows. Header-only (templates and inline functions).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>  // convert_{to,from}_float for bfloat16 / half (AVX512 too)
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#if defined(__linux__)
#include <sys/mman.h>  // mincore
#include <unistd.h>    // sysconf

#include <vector>
#define TRIDENT_STREAMING_STORES 1
#endif
#endif

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

// Converts n fp32 values to T and stores them plainly.
template <typename T>
inline void store_plain(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else {
    at::vec::convert(src, dst, n);
  }
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, float>)
    store_plain(src, dst, n);  // fp32: src is dst (out_as_float)
}

// Non-temporal ("streaming") row stores. A plain store first reads every cache line it writes (the line is
// allocated in the cache), so a kernel that reads one row and writes one moves three rows through memory; a
// streaming store writes the line to memory without that read. Worth it only for an output far bigger than the
// caches of the cores writing it (its reader fetches it from memory either way), and only into memory that is
// already there: a page the output faults in is zero-filled by the kernel, into the cache, and plain stores then
// hit it. Measured on this project's 2-core AVX512 box, writing 24 MB of fp32: into reused memory whose lines were
// evicted, 2.2-2.5 ms plain, 1.7 ms streamed; into fresh pages, 7.8 ms plain, 10.2 ms streamed. So an output is
// streamed when it has kStreamBytes or more and most of its pages are resident (mincore); where that cannot be
// asked (not Linux, or the default flavour), never.
constexpr int64_t kStreamBytes = int64_t{8} << 20;

// Whether to write the output [p, p + bytes) with stream_row (see above). $TRIDENT_STREAMING_STORES overrides the
// residency test: "0" never streams, "1" streams every output of kStreamBytes or more (read on every call).
inline bool worth_streaming(const void* p, int64_t bytes) {
#if defined(TRIDENT_STREAMING_STORES)
  if (bytes < kStreamBytes) return false;
  const char* mode = std::getenv("TRIDENT_STREAMING_STORES");
  if (mode != nullptr && std::strcmp(mode, "0") == 0) return false;
  if (mode != nullptr && std::strcmp(mode, "1") == 0) return true;
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(p) / page * page;
  const auto end = reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>(bytes);
  std::vector<unsigned char> resident((end - begin + page - 1) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, resident.data()) != 0) return false;
  std::size_t in = 0;
  for (const unsigned char r : resident) in += r & 1u;
  return 2 * in >= resident.size();
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

// The dtypes stream_row streams (others, e.g. double, are stored plainly).
template <typename T>
constexpr bool kStreamable =
    std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

// Converts the fp32 row src[0, n) to T and writes it to dst with streaming stores where the flavour has them (the
// unaligned head and the tail of the row are stored plainly). Call stream_fence() before other threads read dst.
template <typename T>
inline void stream_row(const float* src, T* dst, int64_t n) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (kStreamable<T>) {
    // one streamed vector: Vec::size() floats, or kChunk 16-bit values
    constexpr int64_t kBytes = sizeof(Vec);
    constexpr int64_t kElems = kBytes / sizeof(T);
    const auto addr = reinterpret_cast<std::uintptr_t>(dst);
    // plain stores up to the first vector boundary (all of them for a misaligned dst: never a tensor's data)
    const int64_t head =
        addr % sizeof(T) != 0 ? n : ((kBytes - addr % kBytes) % kBytes) / sizeof(T);
    j = std::min<int64_t>(n, head);
    store_plain(src, dst, j);
    for (; j + kElems <= n; j += kElems) {
      if constexpr (std::is_same_v<T, float>) {
#if defined(CPU_CAPABILITY_AVX512)
        _mm512_stream_ps(dst + j, Vec::loadu(src + j));
#else
        _mm256_stream_ps(dst + j, Vec::loadu(src + j));
#endif
      } else {
        const auto v =
            at::vec::convert_from_float<T>(Vec::loadu(src + j), Vec::loadu(src + j + Vec::size()));
#if defined(CPU_CAPABILITY_AVX512)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j), v);
#else
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j), v);
#endif
      }
    }
  }
#endif
  store_plain(src + j, dst + j, n - j);
}

// Orders this thread's streaming stores before what follows (they are weakly ordered).
inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// Writes an fp32 result row computed in `row` to dst: streamed, or else stored plainly (for fp32, `row` is dst
// itself when not streaming: see out_row).
template <typename T>
inline void write_row(const float* row, T* dst, int64_t n, bool stream) {
  if (stream) {
    stream_row(row, dst, n);
  } else {
    store_row(row, dst, n);
  }
}

// Where to compute an fp32 result row that write_row then writes: buf when streaming, else out_as_float.
template <typename T>
inline float* out_row(T* dst, float* buf, bool stream) {
  return stream ? buf : out_as_float(dst, buf);
}

}  // namespace vec_io
}  // namespace trident
