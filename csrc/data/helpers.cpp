// Trident data helpers (pybind11 module `megatron.data._helpers`): the two index builders of GPT pretraining.
//
// What it computes (Megatron-DeepSpeed semantics, bit for bit):
//   build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch) -> int64 [num_samples + 1, 2]
//     Documents doc_idx[0], doc_idx[1], ... are laid end to end as one token stream. Row i is
//     (position in doc_idx, token offset inside that document) of the first token of sample i; sample i runs from
//     row i to row i + 1 INCLUSIVE, i.e. seq_length + 1 tokens, so consecutive samples overlap by one token.
//     num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length. Row 0 is always (0, 0).
//   build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size) -> None (in place)
//     Greedy blending: sample i goes to the dataset d maximising weights[d] * max(i, 1) - taken[d] (first d on
//     ties); dataset_index[i] = d (uint8), dataset_sample_index[i] = taken[d] (int64), then taken[d] += 1.
//
// Constraints (checked, raising ValueError with the offending value):
//   sizes int32 1-D C-contiguous; doc_idx int32 1-D C-contiguous with every entry in [0, len(sizes));
//   seq_length >= 1; num_epochs >= 1; tokens_per_epoch >= 2; the documents of doc_idx must hold the
//   num_samples * seq_length + 1 tokens the samples cover (true when doc_idx is num_epochs epochs of documents whose
//   sizes sum to tokens_per_epoch, as GPTDataset builds it). dataset_index uint8 / dataset_sample_index int64 /
//   weights float64, all 1-D C-contiguous and writeable where written, lengths >= size, 1 <= num_datasets <= 255.
//
// Python reference it must match: megatron/data/helpers.py (build_sample_idx_numpy, build_blending_indices_numpy),
// checked array-for-array by tests/data/test_helpers_cpp.py; the loop below is the algorithm of Megatron's
// helpers.cpp as documented in shared/reference/megatron-compat.md section 6.3.
//
// Floating point: the blending error must round exactly like the Python reference (one multiply, one subtract, no
// fused multiply-add), hence the fp-contract pragmas.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace py = pybind11;

namespace {

template <typename T>
void check_array(const py::array& a, const char* name, const char* dtype_name, bool writeable) {
  if (!a.dtype().is(py::dtype::of<T>())) {
    std::ostringstream msg;
    msg << name << " must have dtype " << dtype_name << ", got " << std::string(py::str(a.dtype()))
        << "; convert it with .astype(np." << dtype_name << ")";
    throw py::value_error(msg.str());
  }
  if (a.ndim() != 1) {
    std::ostringstream msg;
    msg << name << " must be 1-D, got " << a.ndim() << " dimensions";
    throw py::value_error(msg.str());
  }
  if (!(a.flags() & py::array::c_style)) {
    std::ostringstream msg;
    msg << name << " must be C-contiguous; pass np.ascontiguousarray(" << name << ")";
    throw py::value_error(msg.str());
  }
  if (writeable && !a.writeable()) {
    std::ostringstream msg;
    msg << name << " must be writeable (it is filled in place)";
    throw py::value_error(msg.str());
  }
}

py::array_t<int64_t> build_sample_idx(const py::array& sizes_arr, const py::array& doc_idx_arr,
                                      int64_t seq_length, int64_t num_epochs,
                                      int64_t tokens_per_epoch) {
  check_array<int32_t>(sizes_arr, "sizes", "int32", false);
  check_array<int32_t>(doc_idx_arr, "doc_idx", "int32", false);
  if (seq_length < 1)
    throw py::value_error("seq_length must be >= 1, got " + std::to_string(seq_length));
  if (num_epochs < 1)
    throw py::value_error("num_epochs must be >= 1, got " + std::to_string(num_epochs));
  if (tokens_per_epoch < 2) {
    throw py::value_error("tokens_per_epoch must be >= 2 (a sample needs 2 tokens), got " +
                          std::to_string(tokens_per_epoch));
  }
  const int32_t* sizes = static_cast<const int32_t*>(sizes_arr.data());
  const int32_t* doc_idx = static_cast<const int32_t*>(doc_idx_arr.data());
  const int64_t num_sizes = sizes_arr.shape(0);
  const int64_t num_docs = doc_idx_arr.shape(0);

  // Validate doc ids and the token budget up front, so the walk below can never read out of bounds.
  int64_t stream_tokens = 0;
  for (int64_t k = 0; k < num_docs; ++k) {
    const int32_t d = doc_idx[k];
    if (d < 0 || d >= num_sizes) {
      throw py::value_error("doc_idx[" + std::to_string(k) + "] = " + std::to_string(d) +
                            " is outside [0, len(sizes) = " + std::to_string(num_sizes) + ")");
    }
    stream_tokens += sizes[d];
  }
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  if (stream_tokens < num_samples * seq_length + 1) {
    throw py::value_error("doc_idx holds " + std::to_string(stream_tokens) + " tokens, but " +
                          std::to_string(num_samples) + " samples of seq_length " +
                          std::to_string(seq_length) + " need " +
                          std::to_string(num_samples * seq_length + 1) +
                          " (num_epochs * tokens_per_epoch overstates the documents' tokens)");
  }

  py::array_t<int64_t> result({num_samples + 1, static_cast<int64_t>(2)});
  int64_t* out = result.mutable_data();
  {
    py::gil_scoped_release release;
    int64_t doc_pos = 0;     // index into doc_idx
    int64_t doc_offset = 0;  // token offset inside doc_idx[doc_pos]
    out[0] = 0;
    out[1] = 0;
    for (int64_t sample = 1; sample <= num_samples; ++sample) {
      int64_t remaining = seq_length + 1;  // tokens still to take, counting the shared last one
      while (remaining != 0) {
        const int64_t doc_length = static_cast<int64_t>(sizes[doc_idx[doc_pos]]) - doc_offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          // The sample ends inside this document; the next one starts on its last token (the -1).
          doc_offset += remaining + doc_length - 1;
          remaining = 0;
        } else {
          ++doc_pos;
          doc_offset = 0;
        }
      }
      out[2 * sample] = doc_pos;
      out[2 * sample + 1] = doc_offset;
    }
  }
  return result;
}

void build_blending_indices(py::array& dataset_index_arr, py::array& dataset_sample_index_arr,
                            const py::array& weights_arr, int64_t num_datasets, int64_t size) {
  check_array<uint8_t>(dataset_index_arr, "dataset_index", "uint8", true);
  check_array<int64_t>(dataset_sample_index_arr, "dataset_sample_index", "int64", true);
  check_array<double>(weights_arr, "weights", "float64", false);
  if (num_datasets < 1 || num_datasets > 255) {
    throw py::value_error("num_datasets must be in [1, 255] (dataset_index is uint8), got " +
                          std::to_string(num_datasets));
  }
  if (size < 0) throw py::value_error("size must be >= 0, got " + std::to_string(size));
  if (weights_arr.shape(0) != num_datasets) {
    throw py::value_error("weights has " + std::to_string(weights_arr.shape(0)) +
                          " entries but num_datasets is " + std::to_string(num_datasets));
  }
  if (dataset_index_arr.shape(0) < size || dataset_sample_index_arr.shape(0) < size) {
    throw py::value_error("dataset_index and dataset_sample_index must hold at least size = " +
                          std::to_string(size) + " entries");
  }
  uint8_t* dataset_index = static_cast<uint8_t*>(dataset_index_arr.mutable_data());
  int64_t* dataset_sample_index = static_cast<int64_t*>(dataset_sample_index_arr.mutable_data());
  const double* weights = static_cast<const double*>(weights_arr.data());
  {
    py::gil_scoped_release release;
    std::vector<int64_t> taken(static_cast<size_t>(num_datasets), 0);
    for (int64_t i = 0; i < size; ++i) {
      const double scale = std::max(static_cast<double>(i), 1.0);
      int64_t best = 0;
      double best_error = weights[0] * scale - static_cast<double>(taken[0]);
      for (int64_t d = 1; d < num_datasets; ++d) {
        const double error = weights[d] * scale - static_cast<double>(taken[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      dataset_index[i] = static_cast<uint8_t>(best);
      dataset_sample_index[i] = taken[best];
      taken[best] += 1;
    }
  }
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "Trident GPT data index builders (Megatron semantics); see csrc/data/helpers.cpp";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        "int64 [num_samples + 1, 2] (doc_idx position, token offset) of each sample start.");
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index"),
        py::arg("dataset_sample_index"), py::arg("weights"), py::arg("num_datasets"),
        py::arg("size"),
        "Greedy blending: fills dataset_index (uint8) and dataset_sample_index (int64) in place.");
}
