// pybind11 binding of the CPU fused kernels (module megatron.fused_kernels._cpu, contract #16).
//
// This is the only CPU file that includes <torch/extension.h>; the kernels live in norms.cpp,
// softmax.cpp, activations.cpp, rope.cpp and cross_entropy.cpp and are declared in ops.h. No math
// here: see the comment at the top of each kernel file for the forward and backward formulas.
#include <torch/extension.h>

#include <string>

#include "ops.h"
#include "vec_io.h"

namespace trident {

// Which vector ISA the kernels were compiled for ("avx512", "avx2" or "default"), for logs and tests.
std::string build_info() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "default";
#endif
}

}  // namespace trident

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Trident fused kernels, CPU (ATen) implementation";
  m.def("build_info", &trident::build_info, "Vector ISA the kernels were compiled for");
  // The norms write outputs of this many bytes or more with streaming stores, where their pages are resident
  // (see vec_io.h).
  m.attr("stream_bytes") = trident::vec_io::kStreamBytes;
  m.def(
      "worth_streaming",
      [](const at::Tensor& out) {
        return trident::vec_io::worth_streaming(out.const_data_ptr(), out.nbytes());
      },
      "Whether the norms would write this output with streaming stores", py::arg("out"));

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
  m.def("bias_gelu_bwd_into_dy", &trident::bias_gelu_bwd_into_dy,
        "Bias + tanh-GELU backward, dx written over dy -> dbias", py::arg("dy"), py::arg("x"),
        py::arg("bias"));
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
