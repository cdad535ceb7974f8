// Declarations of the CPU fused kernels of megatron.fused_kernels._cpu (contract: issue #16).
//
// Every function takes CONTIGUOUS tensors (the Python wrapper guarantees it), supports float32,
// bfloat16 and float16 activations, accumulates in fp32 and raises TORCH_CHECK errors that name the
// op and the argument. "rows" is the product of all leading dims: kernels see [rows, h] views.
//
// Build flags (megatron/fused_kernels/loader.py: cpu_cflags, used by setup.py and the JIT build):
//   x86-64 host with AVX512 F/BW/VL/DQ where torch's own kernels use AVX512 too:
//     -O3 -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
//     -DCPU_CAPABILITY_AVX512 -DCPU_CAPABILITY=AVX512  (Vectorized<float> 16-wide)
//   else x86-64 host with AVX2 + FMA:
//     -O3 -fopenmp -mavx2 -mfma -mf16c -DCPU_CAPABILITY_AVX2 -DCPU_CAPABILITY=AVX2
//     (at::vec::Vectorized<float> is then 8-wide AVX2 and uses torch's Sleef exp/tanh)
//   any other host:
//     -O3 -fopenmp
//     (Vectorized<float> emulates with scalar loops; results are the same up to rounding)
//   -fopenmp (also at link time) makes at::parallel_for parallel, on torch's own libgomp; the C++
//   standard is the one torch.utils.cpp_extension picks.
//
// Only binding.cpp includes <torch/extension.h>; kernel files include ATen headers only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace trident {

// ---- Norms (norms.cpp) ----
// {y [rows, h] x.dtype, mean [rows] fp32, rstd [rows] fp32}
std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& gamma,
                                       const at::Tensor& beta, double eps);
// {dx [rows, h] x.dtype, dgamma [h] gamma.dtype, dbeta [h] gamma.dtype}
std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& mean, const at::Tensor& rstd,
                                       const at::Tensor& gamma);
// {y [rows, h] x.dtype, rstd [rows] fp32}
std::vector<at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& gamma, double eps);
// {dx [rows, h] x.dtype, dgamma [h] gamma.dtype}
std::vector<at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                     const at::Tensor& rstd, const at::Tensor& gamma);

// ---- Softmax of attention scores (softmax.cpp) ----
// x [B, sq, sk], sq == sk: causal (j <= i kept) softmax of scale * x.
at::Tensor scaled_upper_triang_masked_softmax_fwd(const at::Tensor& x, double scale);
// x [b, np, sq, sk], mask bool [bm, 1, sq, sk] (bm == b or 1, True = masked out).
at::Tensor scaled_masked_softmax_fwd(const at::Tensor& x, const at::Tensor& mask, double scale);
// dx = scale * y * (dy - sum_j(dy * y)); for both forward kinds.
at::Tensor scaled_masked_softmax_bwd(const at::Tensor& dy, const at::Tensor& y, double scale);

// ---- Bias + activation (activations.cpp) ----
at::Tensor bias_gelu_fwd(const at::Tensor& x, const at::Tensor& bias);
// {dx [rows, f], dbias [f] (sum_rows dx in fp32, cast to bias's dtype; EMPTY without a bias)}
std::vector<at::Tensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                      const at::Tensor& bias);
// dx written over dy (CPU only; the caller owns dy) -> dbias (EMPTY without bias)
at::Tensor bias_gelu_bwd_into_dy(at::Tensor dy, const at::Tensor& x, const at::Tensor& bias);
at::Tensor bias_swiglu_fwd(const at::Tensor& x, const at::Tensor& bias);
// {dx [rows, 2f], dbias [2f] (as bias_gelu_bwd)}
std::vector<at::Tensor> bias_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                        const at::Tensor& bias);
// ---- Rotary embedding (rope.cpp) ----
at::Tensor rope_fwd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rope_bwd(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin);

// ---- Vocab-parallel cross-entropy, local passes (cross_entropy.cpp) ----
at::Tensor ce_local_stats(const at::Tensor& logits, const at::Tensor& local_target);
// row_scale: fp32 [N], the upstream grad per row, or EMPTY for 1
void ce_grad_inplace(at::Tensor logits, const at::Tensor& local_target,
                     const at::Tensor& global_max, const at::Tensor& log_sum_exp, double smoothing,
                     int64_t vocab_size, const at::Tensor& row_scale);

}  // namespace trident
