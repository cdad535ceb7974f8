// pybind11 binding of the CUDA fused kernels (module megatron.fused_kernels._cuda, contract #16).
// The only CUDA-side file with torch headers: argument checks (errors name the op and argument),
// output allocation, dtype dispatch to the kernels.h launchers on the current stream, launch checks,
// and the dbias of bias_*_bwd (dx summed over rows in fp32). Math: top comment of each .cu file.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <climits>
#include <string>
#include <vector>

#include "kernels.h"

namespace trident {
namespace {

template <typename T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>{}) with T the CUDA type of `dtype` (float, __half, __nv_bfloat16).
template <typename Fn>
void dispatch(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(Tag<float>{});
    case at::kHalf:
      return fn(Tag<__half>{});
    case at::kBFloat16: {
      // Volta builds (sm_70) carry no bf16 kernels (kernels.h): refuse before launching a trap.
      const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
      TORCH_CHECK(prop->major >= 8, op, ": bf16 needs a GPU of compute capability >= 8.0; ",
                  prop->name, " is ", prop->major, ".", prop->minor, ": use float16 or float32");
      return fn(Tag<__nv_bfloat16>{});
    }
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype,
                  " (expected float32, bfloat16 or float16)");
  }
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return t.numel() == 0 ? nullptr : reinterpret_cast<T*>(t.data_ptr());
}

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream().stream(); }

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void check_tensor(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// A floating-point activation tensor (float32 / bfloat16 / float16).
void check_float(const at::Tensor& t, const char* op, const char* name) {
  check_tensor(t, op, name);
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op, ": ", name,
              " must be float32, bfloat16 or float16, got ", dt);
}

// `t` has the dtype of `ref` and lives on the same device.
void check_like(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                const char* ref_name) {
  check_tensor(t, op, name);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " dtype ", t.scalar_type(),
              " must match ", ref_name, " dtype ", ref.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device());
}

void check_fp32(const at::Tensor& t, const at::Tensor& ref, int64_t numel, const char* op,
                const char* name) {
  check_tensor(t, op, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " not ",
              ref.device());
  TORCH_CHECK(t.numel() == numel, op, ": ", name, " must have ", numel, " elements, got ",
              t.numel());
}

// The last dim of `x` (>= 1 dim, < 2^31: the kernels index a row with int).
int64_t last_dim(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.dim() >= 1, op, ": ", name, " must have at least 1 dim");
  const int64_t h = x.size(-1);
  TORCH_CHECK(h < INT_MAX / 2, op, ": ", name, " last dim ", h, " is too large");
  return h;
}

int64_t rows_of(const at::Tensor& x, int64_t h) { return h == 0 ? 0 : x.numel() / h; }

void check_weight(const at::Tensor& w, const at::Tensor& x, int64_t h, const char* op,
                  const char* name) {
  check_like(w, x, op, name, "x");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h, op, ": ", name, " must have shape [", h,
              "] (x's last dim), got ", w.sizes());
}

// The optional bias of the activations: empty (no bias) or [width] like x.
const at::Tensor* bias_or_null(const at::Tensor& bias, const at::Tensor& x, int64_t width,
                               const char* op) {
  if (!bias.defined() || bias.numel() == 0) return nullptr;
  check_weight(bias, x, width, op, "bias");
  return &bias;
}

}  // namespace

// Where the extension came from, for logs and tests.
std::string build_info() { return "cuda"; }

// ---- Norms ----
std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& gamma,
                                       const at::Tensor& beta, double eps) {
  constexpr const char* op = "layer_norm_fwd";
  check_float(x, op, "x");
  const int64_t h = last_dim(x, op, "x");
  check_weight(gamma, x, h, op, "gamma");
  check_weight(beta, x, h, op, "beta");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t rows = rows_of(x, h);
  auto y = at::empty_like(x);
  auto mean = at::empty({rows}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(
        gpu::layer_norm_fwd<T>(ptr<T>(x), ptr<T>(gamma), ptr<T>(beta), ptr<T>(y), ptr<float>(mean),
                               ptr<float>(rstd), rows, h, static_cast<float>(eps), stream()),
        op);
  });
  return {y, mean, rstd};
}

std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& mean, const at::Tensor& rstd,
                                       const at::Tensor& gamma) {
  constexpr const char* op = "layer_norm_bwd";
  check_float(x, op, "x");
  check_like(dy, x, op, "dy", "x");
  TORCH_CHECK(dy.sizes() == x.sizes(), op, ": dy shape ", dy.sizes(), " must match x ", x.sizes());
  const int64_t h = last_dim(x, op, "x");
  const int64_t rows = rows_of(x, h);
  check_fp32(mean, x, rows, op, "mean");
  check_fp32(rstd, x, rows, op, "rstd");
  check_weight(gamma, x, h, op, "gamma");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  auto dgamma = at::empty_like(gamma);
  auto dbeta = at::empty_like(gamma);
  auto work = at::empty({gpu::norm_bwd_workspace_floats(rows, h, 2)}, mean.options());
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::layer_norm_bwd<T>(ptr<T>(dy), ptr<T>(x), ptr<float>(mean), ptr<float>(rstd),
                                        ptr<T>(gamma), ptr<T>(dx), ptr<T>(dgamma), ptr<T>(dbeta),
                                        ptr<float>(work), rows, h, stream()),
                 op);
  });
  return {dx, dgamma, dbeta};
}

std::vector<at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& gamma, double eps) {
  constexpr const char* op = "rms_norm_fwd";
  check_float(x, op, "x");
  const int64_t h = last_dim(x, op, "x");
  check_weight(gamma, x, h, op, "gamma");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t rows = rows_of(x, h);
  auto y = at::empty_like(x);
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::rms_norm_fwd<T>(ptr<T>(x), ptr<T>(gamma), ptr<T>(y), ptr<float>(rstd), rows,
                                      h, static_cast<float>(eps), stream()),
                 op);
  });
  return {y, rstd};
}

std::vector<at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                     const at::Tensor& rstd, const at::Tensor& gamma) {
  constexpr const char* op = "rms_norm_bwd";
  check_float(x, op, "x");
  check_like(dy, x, op, "dy", "x");
  TORCH_CHECK(dy.sizes() == x.sizes(), op, ": dy shape ", dy.sizes(), " must match x ", x.sizes());
  const int64_t h = last_dim(x, op, "x");
  const int64_t rows = rows_of(x, h);
  check_fp32(rstd, x, rows, op, "rstd");
  check_weight(gamma, x, h, op, "gamma");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  auto dgamma = at::empty_like(gamma);
  auto work = at::empty({gpu::norm_bwd_workspace_floats(rows, h, 1)}, rstd.options());
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(
        gpu::rms_norm_bwd<T>(ptr<T>(dy), ptr<T>(x), ptr<float>(rstd), ptr<T>(gamma), ptr<T>(dx),
                             ptr<T>(dgamma), ptr<float>(work), rows, h, stream()),
        op);
  });
  return {dx, dgamma};
}

// ---- Softmax of attention scores ----
at::Tensor scaled_upper_triang_masked_softmax_fwd(const at::Tensor& x, double scale) {
  constexpr const char* op = "scaled_upper_triang_masked_softmax_fwd";
  check_float(x, op, "x");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == x.size(2), op, ": x must be [B, sq, sk] with sq == sk,",
              " got ", x.sizes());
  last_dim(x, op, "x");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::causal_softmax_fwd<T>(ptr<T>(x), ptr<T>(y), x.size(0), x.size(1),
                                            static_cast<float>(scale), stream()),
                 op);
  });
  return y;
}

at::Tensor scaled_masked_softmax_fwd(const at::Tensor& x, const at::Tensor& mask, double scale) {
  constexpr const char* op = "scaled_masked_softmax_fwd";
  check_float(x, op, "x");
  TORCH_CHECK(x.dim() == 4, op, ": x must be [b, np, sq, sk], got ", x.sizes());
  last_dim(x, op, "x");
  check_tensor(mask, op, "mask");
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": mask must be bool, got ", mask.scalar_type());
  TORCH_CHECK(mask.device() == x.device(), op, ": mask is on ", mask.device(), " but x is on ",
              x.device());
  const int64_t b = x.size(0), np = x.size(1), sq = x.size(2), sk = x.size(3);
  TORCH_CHECK(mask.dim() == 4 && (mask.size(0) == b || mask.size(0) == 1) && mask.size(1) == 1 &&
                  mask.size(2) == sq && mask.size(3) == sk,
              op, ": mask must be [", b, " or 1, 1, ", sq, ", ", sk, "], got ", mask.sizes());
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::masked_softmax_fwd<T>(ptr<T>(x), ptr<bool>(mask), ptr<T>(y), b, np, sq, sk,
                                            mask.size(0), static_cast<float>(scale), stream()),
                 op);
  });
  return y;
}

at::Tensor scaled_masked_softmax_bwd(const at::Tensor& dy, const at::Tensor& y, double scale) {
  constexpr const char* op = "scaled_masked_softmax_bwd";
  check_float(y, op, "y");
  check_like(dy, y, op, "dy", "y");
  TORCH_CHECK(dy.sizes() == y.sizes(), op, ": dy shape ", dy.sizes(), " must match y ", y.sizes());
  const int64_t sk = last_dim(y, op, "y");
  const at::cuda::OptionalCUDAGuard guard(y.device());
  auto dx = at::empty_like(y);
  dispatch(y.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::softmax_bwd<T>(ptr<T>(dy), ptr<T>(y), ptr<T>(dx), rows_of(y, sk), sk,
                                     static_cast<float>(scale), stream()),
                 op);
  });
  return dx;
}

// ---- Bias + activation ----
at::Tensor bias_gelu_fwd(const at::Tensor& x, const at::Tensor& bias) {
  constexpr const char* op = "bias_gelu_fwd";
  check_float(x, op, "x");
  const int64_t f = last_dim(x, op, "x");
  const at::Tensor* b = bias_or_null(bias, x, f, op);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::bias_gelu_fwd<T>(ptr<T>(x), b ? ptr<T>(*b) : nullptr, ptr<T>(y),
                                       rows_of(x, f), f, stream()),
                 op);
  });
  return y;
}

// The bias gradient: dx [rows, f] summed over rows, accumulated in fp32 and rounded to the bias
// dtype. sum's dtype argument reduces fp16/bf16 on the GPU with fp32 accumulation straight from dx;
// dx.to(kFloat) first would allocate an fp32 copy of all of dx (2x its size for 16-bit types).
namespace {
at::Tensor bias_grad(const at::Tensor& dx, int64_t rows, int64_t f, at::ScalarType dtype) {
  return at::sum(dx.view({rows, f}), at::IntArrayRef{0}, /*keepdim=*/false, at::kFloat).to(dtype);
}
}  // namespace

std::vector<at::Tensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                      const at::Tensor& bias) {
  constexpr const char* op = "bias_gelu_bwd";
  check_float(x, op, "x");
  check_like(dy, x, op, "dy", "x");
  TORCH_CHECK(dy.sizes() == x.sizes(), op, ": dy shape ", dy.sizes(), " must match x ", x.sizes());
  const int64_t f = last_dim(x, op, "x");
  const at::Tensor* b = bias_or_null(bias, x, f, op);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::bias_gelu_bwd<T>(ptr<T>(dy), ptr<T>(x), b ? ptr<T>(*b) : nullptr, ptr<T>(dx),
                                       rows_of(x, f), f, stream()),
                 op);
  });
  if (b == nullptr) return {dx, at::empty({0}, dx.options())};  // no bias: EMPTY dbias
  return {dx, bias_grad(dx, rows_of(x, f), f, b->scalar_type())};
}

at::Tensor bias_swiglu_fwd(const at::Tensor& x, const at::Tensor& bias) {
  constexpr const char* op = "bias_swiglu_fwd";
  check_float(x, op, "x");
  const int64_t two_f = last_dim(x, op, "x");
  TORCH_CHECK(two_f % 2 == 0, op, ": x last dim (", two_f, ") must be even ([gate | up])");
  const at::Tensor* b = bias_or_null(bias, x, two_f, op);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = two_f / 2;  // [*, 2f] -> [*, f]
  auto y = at::empty(shape, x.options());
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::bias_swiglu_fwd<T>(ptr<T>(x), b ? ptr<T>(*b) : nullptr, ptr<T>(y),
                                         rows_of(x, two_f), two_f / 2, stream()),
                 op);
  });
  return y;
}

std::vector<at::Tensor> bias_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                        const at::Tensor& bias) {
  constexpr const char* op = "bias_swiglu_bwd";
  check_float(x, op, "x");
  check_like(dy, x, op, "dy", "x");
  const int64_t two_f = last_dim(x, op, "x");
  TORCH_CHECK(two_f % 2 == 0, op, ": x last dim (", two_f, ") must be even ([gate | up])");
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = two_f / 2;
  TORCH_CHECK(dy.sizes() == at::IntArrayRef(shape), op, ": dy shape ", dy.sizes(), " must be ",
              at::IntArrayRef(shape), " (x's with the last dim halved)");
  const at::Tensor* b = bias_or_null(bias, x, two_f, op);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::bias_swiglu_bwd<T>(ptr<T>(dy), ptr<T>(x), b ? ptr<T>(*b) : nullptr,
                                         ptr<T>(dx), rows_of(x, two_f), two_f / 2, stream()),
                 op);
  });
  if (b == nullptr) return {dx, at::empty({0}, dx.options())};  // no bias: EMPTY dbias
  return {dx, bias_grad(dx, rows_of(x, two_f), two_f, b->scalar_type())};
}

// ---- Rotary embedding ----
namespace {

// x [s, b, n, hn], cos / sin [s, b, d] -> d.
int64_t check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                   const char* op, const char* x_name) {
  check_float(x, op, x_name);
  TORCH_CHECK(x.dim() == 4, op, ": ", x_name, " must be [s, b, n, hn], got ", x.sizes());
  last_dim(x, op, x_name);
  check_like(cos, x, op, "cos", x_name);
  check_like(sin, x, op, "sin", x_name);
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == x.size(0) && cos.size(1) == x.size(1), op,
              ": cos must be [s, b, d] = [", x.size(0), ", ", x.size(1), ", d], got ", cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), op, ": sin shape ", sin.sizes(), " must match cos ",
              cos.sizes());
  const int64_t d = cos.size(2);
  TORCH_CHECK(d % 2 == 0 && d <= x.size(3), op, ": rotary dim d (", d, ") must be even and <= hn (",
              x.size(3), ")");
  return d;
}

}  // namespace

at::Tensor rope_fwd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  constexpr const char* op = "rope_fwd";
  const int64_t d = check_rope(x, cos, sin, op, "x");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::rope_fwd<T>(ptr<T>(x), ptr<T>(cos), ptr<T>(sin), ptr<T>(y),
                                  x.size(0) * x.size(1), x.size(2), x.size(3), d, stream()),
                 op);
  });
  return y;
}

at::Tensor rope_bwd(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  constexpr const char* op = "rope_bwd";
  const int64_t d = check_rope(dy, cos, sin, op, "dy");
  const at::cuda::OptionalCUDAGuard guard(dy.device());
  auto dx = at::empty_like(dy);
  dispatch(dy.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::rope_bwd<T>(ptr<T>(dy), ptr<T>(cos), ptr<T>(sin), ptr<T>(dx),
                                  dy.size(0) * dy.size(1), dy.size(2), dy.size(3), d, stream()),
                 op);
  });
  return dx;
}

// ---- Vocab-parallel cross-entropy, local passes ----
namespace {

// logits [N, vp], local_target int64 [N] -> N.
int64_t check_ce(const at::Tensor& logits, const at::Tensor& target, const char* op) {
  check_float(logits, op, "logits");
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [N, vp], got ", logits.sizes());
  last_dim(logits, op, "logits");
  check_tensor(target, op, "local_target");
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": local_target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.device() == logits.device(), op, ": local_target is on ", target.device(),
              " but logits is on ", logits.device());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), op, ": local_target must be [",
              logits.size(0), "], got ", target.sizes());
  return logits.size(0);
}

}  // namespace

at::Tensor ce_local_stats(const at::Tensor& logits, const at::Tensor& local_target) {
  constexpr const char* op = "ce_local_stats";
  const int64_t n = check_ce(logits, local_target, op);
  const at::cuda::OptionalCUDAGuard guard(logits.device());
  auto stats = at::empty({n, 4}, logits.options().dtype(at::kFloat));
  dispatch(logits.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(gpu::ce_local_stats<T>(ptr<T>(logits), ptr<int64_t>(local_target),
                                        ptr<float>(stats), n, logits.size(1), stream()),
                 op);
  });
  return stats;
}

void ce_grad_inplace(at::Tensor logits, const at::Tensor& local_target,
                     const at::Tensor& global_max, const at::Tensor& log_sum_exp, double smoothing,
                     int64_t vocab_size, const at::Tensor& row_scale) {
  constexpr const char* op = "ce_grad_inplace";
  const int64_t n = check_ce(logits, local_target, op);
  check_fp32(global_max, logits, n, op, "global_max");
  check_fp32(log_sum_exp, logits, n, op, "log_sum_exp");
  const bool scaled = row_scale.defined() && row_scale.numel() > 0;
  if (scaled) check_fp32(row_scale, logits, n, op, "row_scale");
  TORCH_CHECK(vocab_size > 0, op, ": vocab_size must be positive, got ", vocab_size);
  TORCH_CHECK(smoothing >= 0.0 && smoothing <= 1.0, op, ": smoothing must be in [0, 1], got ",
              smoothing);
  const at::cuda::OptionalCUDAGuard guard(logits.device());
  dispatch(logits.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_launch(
        gpu::ce_grad_inplace<T>(ptr<T>(logits), ptr<int64_t>(local_target), ptr<float>(global_max),
                                ptr<float>(log_sum_exp), scaled ? ptr<float>(row_scale) : nullptr,
                                n, logits.size(1), smoothing, vocab_size, stream()),
        op);
  });
}

}  // namespace trident

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Trident fused kernels, CUDA implementation";
  m.def("build_info", &trident::build_info, "Which implementation this is (\"cuda\")");

  // Norms.
  m.def("layer_norm_fwd", &trident::layer_norm_fwd, "LayerNorm forward -> [y, mean, rstd]",
        py::arg("x"), py::arg("gamma"), py::arg("beta"), py::arg("eps"));
  m.def("layer_norm_bwd", &trident::layer_norm_bwd, "LayerNorm backward -> [dx, dgamma, dbeta]",
        py::arg("dy"), py::arg("x"), py::arg("mean"), py::arg("rstd"), py::arg("gamma"));
  m.def("rms_norm_fwd", &trident::rms_norm_fwd, "RMSNorm forward -> [y, rstd]", py::arg("x"),
        py::arg("gamma"), py::arg("eps"));
  m.def("rms_norm_bwd", &trident::rms_norm_bwd, "RMSNorm backward -> [dx, dgamma]", py::arg("dy"),
        py::arg("x"), py::arg("rstd"), py::arg("gamma"));

  // Softmax of attention scores.
  m.def("scaled_upper_triang_masked_softmax_fwd", &trident::scaled_upper_triang_masked_softmax_fwd,
        "Causal scaled softmax forward", py::arg("x"), py::arg("scale"));
  m.def("scaled_masked_softmax_fwd", &trident::scaled_masked_softmax_fwd,
        "Scaled masked softmax forward", py::arg("x"), py::arg("mask"), py::arg("scale"));
  m.def("scaled_masked_softmax_bwd", &trident::scaled_masked_softmax_bwd,
        "Scaled (masked or causal) softmax backward", py::arg("dy"), py::arg("y"),
        py::arg("scale"));

  // Bias + activation.
  m.def("bias_gelu_fwd", &trident::bias_gelu_fwd, "Bias + tanh-GELU forward", py::arg("x"),
        py::arg("bias"));
  m.def("bias_gelu_bwd", &trident::bias_gelu_bwd, "Bias + tanh-GELU backward -> [dx, dbias]",
        py::arg("dy"), py::arg("x"), py::arg("bias"));
  m.def("bias_swiglu_fwd", &trident::bias_swiglu_fwd, "Bias + SwiGLU forward", py::arg("x"),
        py::arg("bias"));
  m.def("bias_swiglu_bwd", &trident::bias_swiglu_bwd, "Bias + SwiGLU backward -> [dx, dbias]",
        py::arg("dy"), py::arg("x"), py::arg("bias"));

  // Rotary embedding.
  m.def("rope_fwd", &trident::rope_fwd, "Rotary embedding forward", py::arg("x"), py::arg("cos"),
        py::arg("sin"));
  m.def("rope_bwd", &trident::rope_bwd, "Rotary embedding backward", py::arg("dy"), py::arg("cos"),
        py::arg("sin"));

  // Vocab-parallel cross-entropy, local passes.
  m.def("ce_local_stats", &trident::ce_local_stats,
        "Per-row [max, sum exp, target logit, sum logits] of the local vocab shard",
        py::arg("logits"), py::arg("local_target"));
  m.def("ce_grad_inplace", &trident::ce_grad_inplace,
        "Overwrite logits with d loss / d logits, times row_scale per row (empty: 1)",
        py::arg("logits"), py::arg("local_target"), py::arg("global_max"), py::arg("log_sum_exp"),
        py::arg("smoothing"), py::arg("vocab_size"), py::arg("row_scale"));
}
