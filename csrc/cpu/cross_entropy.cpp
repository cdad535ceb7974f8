// Vocab-parallel cross-entropy, the two local passes over this rank's logits (CPU, ATen). The TP
// all-reduces between them happen in Python (megatron/mpu).
//
// logits z [N, vp] (this rank's vocab columns), local_target t [N] (column in [0, vp) when this
// rank owns the row's target, -1 otherwise).
//
// ce_local_stats -> stats [N, 4] fp32, one pass over each row:
//   m  = max_j z_j
//   se = sum_j exp(z_j - m)
//   zt = z_t - m                 (0 when t = -1)
//   sz = sum_j (z_j - m)         (= sum_j z_j - vp * m)
// The row is read once from memory in blocks of kBlock columns that stay in L1: a block's max b
// first, then sum_j exp(z_j - b) over the block, folded into the running (M, S) by
//   M' = max(M, b),  S' = S * exp(M - M') + S_block * exp(b - M')
// so there is one exp per element (Vectorized::exp_u20, measured <= 4 ulp; se is a sum of positive
// terms, so its relative error stays below that). Partial sums are fp32 over at most kFlush
// elements per lane, then accumulated in double.
//
// Python then forms, over all ranks, M = max m, SE = sum se * exp(m - M), the loss
//   loss = log SE - (z_t - M),   and with label smoothing a':
//   loss = (1 - a') * loss - a' * (sum_j (z_j - M) - v * log SE) / v.
//
// ce_grad_inplace overwrites z with d loss / d z, with gm = global_max, lse = log_sum_exp = log SE,
// a' = smoothing, v = vocab_size (global), s = row_scale[r] (the upstream grad of the row's loss; 1
// when row_scale is EMPTY):
//   g_j = s * (exp(z_j - gm - lse) - a' / v - (j == t ? 1 - a' : 0))
// computed in fp32 (exp_u20 again: p_j off by <= ~4 ulp relative, i.e. <= 3e-7 of max |g|) and
// stored in the logits' dtype; nothing of size [N, vp] is allocated.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "ops.h"
#include "vec_io.h"

namespace trident {
namespace {

using vec_io::Io;
using vec_io::kChunk;
using vec_io::Vec;
// Columns per L1-resident block (8 KiB of fp32); a multiple of kChunk.
constexpr int64_t kBlock = 2048;
// Chunks summed in fp32 before the partial sums move to double (kFlush elements per lane).
constexpr int64_t kFlush = 16;
// Software prefetch distance (elements) of the streaming loops: with the hardware prefetcher alone
// the grad pass stalled on loads (~60% of its cycles; 4x slower than with this prefetch).
constexpr int64_t kPrefetch = 1024;

inline float hmax(const Vec& v) {
  float buf[Vec::size()];
  v.store(buf);
  float m = buf[0];
  for (int64_t i = 1; i < Vec::size(); ++i) m = std::max(m, buf[i]);
  return m;
}

inline double hsum(const Vec& v) {
  float buf[Vec::size()];
  v.store(buf);
  double s = 0.0;
  for (int64_t i = 0; i < Vec::size(); ++i) s += buf[i];
  return s;
}

// Running per-row statistics; max_ = -inf and sums 0 before the first block.
struct RowStats {
  float max_ = -std::numeric_limits<float>::infinity();
  double sum_exp = 0.0;  // sum exp(z - max_)
  double sum_z = 0.0;    // plain sum of z (sz = sum_z - vp * m at the end)
};

// Folds columns [j0, j0 + len) of row z into st. len is a multiple of kChunk except for the row's
// last block, whose last (len % kChunk) columns are handled in scalar code.
// `ahead` = elements readable after z (for the software prefetch, which stays in bounds).
template <typename T>
void fold_block(const T* z, int64_t len, int64_t ahead, RowStats& st) {
  const int64_t lv = len - len % kChunk;
  // Pass 1 (from memory): block max and block sum of z.
  Vec mx0(-std::numeric_limits<float>::infinity()), mx1 = mx0;
  double bsum_z = 0.0;
  for (int64_t c0 = 0; c0 < lv; c0 += kFlush * kChunk) {
    const int64_t c1 = std::min(lv, c0 + kFlush * kChunk);
    Vec s0(0.0f), s1(0.0f);
    for (int64_t c = c0; c < c1; c += kChunk) {
      if (c + kPrefetch < ahead) __builtin_prefetch(z + c + kPrefetch);
      Vec a, b;
      Io<T>::load(z + c, a, b);
      mx0 = at::vec::maximum(mx0, a);
      mx1 = at::vec::maximum(mx1, b);
      s0 = s0 + a;
      s1 = s1 + b;
    }
    bsum_z += hsum(s0) + hsum(s1);
  }
  float bmax = hmax(at::vec::maximum(mx0, mx1));
  for (int64_t c = lv; c < len; ++c) {
    const float v = z[c];
    bmax = std::isnan(v) ? v : std::max(bmax, v);
    bsum_z += v;
  }
  st.sum_z += bsum_z;
  if (std::isnan(bsum_z) || bsum_z == std::numeric_limits<double>::infinity()) {
    // A NaN (or +inf) logit: the horizontal max may have dropped it, the sum of z did not. The
    // row's max and sum of exp become NaN so that the loss is NaN, as in the unfused path.
    st.max_ = std::numeric_limits<float>::quiet_NaN();
    st.sum_exp = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  if (bmax == -std::numeric_limits<float>::infinity()) return;  // all -inf: adds exp(-inf) = 0
  // Pass 2 (from L1): sum exp(z - bmax).
  const Vec vb(bmax);
  double bsum_e = 0.0;
  for (int64_t c0 = 0; c0 < lv; c0 += kFlush * kChunk) {
    const int64_t c1 = std::min(lv, c0 + kFlush * kChunk);
    Vec e0(0.0f), e1(0.0f);
    for (int64_t c = c0; c < c1; c += kChunk) {
      Vec a, b;
      Io<T>::load(z + c, a, b);
      e0 = e0 + (a - vb).exp_u20();
      e1 = e1 + (b - vb).exp_u20();
    }
    bsum_e += hsum(e0) + hsum(e1);
  }
  for (int64_t c = lv; c < len; ++c) bsum_e += std::exp(float(z[c]) - bmax);
  // Merge into the running (max, sum).
  if (bmax > st.max_) {
    st.sum_exp = st.sum_exp * std::exp(double(st.max_) - double(bmax)) + bsum_e;
    st.max_ = bmax;
  } else {
    st.sum_exp += bsum_e * std::exp(double(bmax) - double(st.max_));
  }
}

void check_logits_target(const char* op, const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(logits.device().is_cpu() && target.device().is_cpu(), op,
              ": logits and local_target must be CPU tensors");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              op, ": logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [N, vp], got ", logits.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": local_target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), op,
              ": local_target must be [N] with N = ", logits.size(0), ", got ", target.sizes());
  TORCH_CHECK(logits.is_contiguous() && target.is_contiguous(), op,
              ": logits and local_target must be contiguous");
}

inline void check_target_value(const char* op, int64_t t, int64_t vp, int64_t row) {
  TORCH_CHECK(t >= -1 && t < vp, op, ": local_target[", row, "] = ", t,
              " must be -1 (not owned) or a column in [0, ", vp, ")");
}

}  // namespace

at::Tensor ce_local_stats(const at::Tensor& logits, const at::Tensor& local_target) {
  check_logits_target("ce_local_stats", logits, local_target);
  const int64_t rows = logits.size(0), vp = logits.size(1);
  TORCH_CHECK(vp >= 1, "ce_local_stats: logits must have at least one vocab column");
  at::Tensor stats = at::empty({rows, 4}, logits.options().dtype(at::kFloat));
  if (rows == 0) return stats;
  const int64_t grain = std::max<int64_t>(1, 32768 / vp);
  TRIDENT_DISPATCH_FLOATS(logits.scalar_type(), "ce_local_stats", [&] {
    const scalar_t* zp = logits.data_ptr<scalar_t>();
    const int64_t* tp = local_target.data_ptr<int64_t>();
    float* out = stats.data_ptr<float>();
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* z = zp + r * vp;
        const int64_t t = tp[r];
        check_target_value("ce_local_stats", t, vp, r);
        RowStats st;
        for (int64_t j = 0; j < vp; j += kBlock) {
          fold_block(z + j, std::min(kBlock, vp - j), (r1 - r) * vp - j, st);
        }
        const float m = st.max_;
        out[4 * r + 0] = m;
        out[4 * r + 1] = static_cast<float>(st.sum_exp);
        out[4 * r + 2] = t >= 0 ? float(z[t]) - m : 0.0f;
        out[4 * r + 3] = static_cast<float>(st.sum_z - double(vp) * double(m));
      }
    });
  });
  return stats;
}

void ce_grad_inplace(at::Tensor logits, const at::Tensor& local_target,
                     const at::Tensor& global_max, const at::Tensor& log_sum_exp, double smoothing,
                     int64_t vocab_size, const at::Tensor& row_scale) {
  const char* op = "ce_grad_inplace";
  check_logits_target(op, logits, local_target);
  const int64_t rows = logits.size(0), vp = logits.size(1);
  for (const auto* p : {&global_max, &log_sum_exp}) {
    const char* name = p == &global_max ? "global_max" : "log_sum_exp";
    TORCH_CHECK(p->device().is_cpu() && p->scalar_type() == at::kFloat && p->dim() == 1 &&
                    p->size(0) == rows && p->is_contiguous(),
                op, ": ", name, " must be a contiguous fp32 CPU tensor [N] with N = ", rows,
                ", got ", p->scalar_type(), " ", p->sizes());
  }
  const bool scaled = row_scale.defined() && row_scale.numel() > 0;
  TORCH_CHECK(
      !scaled || (row_scale.device().is_cpu() && row_scale.scalar_type() == at::kFloat &&
                  row_scale.dim() == 1 && row_scale.size(0) == rows && row_scale.is_contiguous()),
      op, ": row_scale must be empty or a contiguous fp32 CPU tensor [N] with N = ", rows, ", got ",
      row_scale.scalar_type(), " ", row_scale.sizes());
  TORCH_CHECK(vocab_size >= vp && vocab_size >= 1, op, ": vocab_size (", vocab_size,
              ") must be >= the local vocab columns (", vp, ")");
  TORCH_CHECK(smoothing >= 0.0 && smoothing <= 1.0, op, ": smoothing (", smoothing,
              ") must be in [0, 1]");
  if (logits.numel() == 0) return;
  const float eps = static_cast<float>(smoothing / double(vocab_size));
  const float on_target = static_cast<float>(1.0 - smoothing);
  const int64_t grain = std::max<int64_t>(1, 32768 / vp);
  TRIDENT_DISPATCH_FLOATS(logits.scalar_type(), "ce_grad_inplace", [&] {
    scalar_t* zp = logits.data_ptr<scalar_t>();
    const int64_t* tp = local_target.data_ptr<int64_t>();
    const float* gmp = global_max.data_ptr<float>();
    const float* lsep = log_sum_exp.data_ptr<float>();
    const float* scp = scaled ? row_scale.data_ptr<float>() : nullptr;
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* z = zp + r * vp;
        const int64_t last = (r1 - r) * vp;  // prefetch only inside this task's rows
        const int64_t t = tp[r];
        check_target_value(op, t, vp, r);
        const float gm = gmp[r], lse = lsep[r], sc = scp ? scp[r] : 1.0f;
        // (z - gm) - lse as two fp32 subtractions, like the reference's (z - max) then
        // exp / sum: the rounding error then scales with the (small) exponent of the
        // large probabilities, not with |gm + lse|.
        const float zt = t >= 0 ? float(z[t]) : 0.0f;
        const Vec vgm(gm), vlse(lse), veps(eps), vsc(sc);
        for (int64_t j = 0; j < vp; j += kChunk) {
          const int64_t n = std::min(kChunk, vp - j);
          if (j + kPrefetch < last) __builtin_prefetch(z + j + kPrefetch, 1);
          Vec a, b;
          if (n == kChunk) {
            Io<scalar_t>::load(z + j, a, b);
          } else {
            Io<scalar_t>::load(z + j, n, a, b);
          }
          a = (((a - vgm) - vlse).exp_u20() - veps) * vsc;
          b = (((b - vgm) - vlse).exp_u20() - veps) * vsc;
          if (n == kChunk) {
            Io<scalar_t>::store(z + j, a, b);
          } else {
            Io<scalar_t>::store(z + j, n, a, b);
          }
        }
        if (t >= 0) {
          z[t] = static_cast<scalar_t>((std::exp((zt - gm) - lse) - eps - on_target) * sc);
        }
      }
    });
  });
}

}  // namespace trident
