// Index builders for the GPT and blended datasets (engine/data). Each has a numpy reference in
// engine/data/helpers.py; tests compare the two on random inputs.
//
// build_sample_index: documents are laid end to end in `doc_index` order to form one token
// stream. Sample i is the seq_length + 1 tokens starting at stream position i * seq_length, so
// consecutive samples share one token (the last label of sample i is the first input of i + 1).
// Row i of the result is (position in doc_index, token offset inside that document) of the
// start of sample i, with offset < document length: a start never points at an empty document
// or one past a document's end. Rows 0..num_samples are produced; the last one only marks
// where sample num_samples - 1 ends.
//
// build_blending_indices: for each global sample i picks the dataset whose realised count lags
// its target weight * max(i, 1) the most (ties to the lowest index), the rule megatron-core's
// blending uses, so the same weights give the same order. `weights` must already be normalised
// to sum to one (normalising again here could move a last bit and with it the order).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

py::array_t<int64_t> build_sample_index(
    py::array_t<int32_t, py::array::c_style | py::array::forcecast> sizes,
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> doc_index,
    int64_t seq_length, int64_t num_samples) {
  if (seq_length <= 0) throw std::invalid_argument("seq_length must be positive");
  if (num_samples < 0) throw std::invalid_argument("num_samples must be non-negative");
  const int32_t* size_of = sizes.data();
  const int64_t num_sizes = sizes.size();
  const int64_t* docs = doc_index.data();
  const int64_t num_docs = doc_index.size();
  for (int64_t j = 0; j < num_docs; ++j) {
    if (docs[j] < 0 || docs[j] >= num_sizes)
      throw std::out_of_range("doc_index entry " + std::to_string(docs[j]) + " is outside sizes");
  }

  py::array_t<int64_t> result({num_samples + 1, static_cast<int64_t>(2)});
  int64_t* out = result.mutable_data();
  bool overran = false;
  {
    py::gil_scoped_release release;
    int64_t j = 0;       // position in doc_index
    int64_t offset = 0;  // token offset in docs[j]
    while (j < num_docs && size_of[docs[j]] == 0) ++j;
    for (int64_t i = 0; i <= num_samples; ++i) {
      if (j >= num_docs) {
        overran = true;
        break;
      }
      out[2 * i] = j;
      out[2 * i + 1] = offset;
      int64_t remaining = seq_length;
      while (remaining > 0 && j < num_docs) {
        const int64_t available = size_of[docs[j]] - offset;
        if (available > remaining) {
          offset += remaining;
          remaining = 0;
        } else {
          remaining -= available;
          ++j;
          offset = 0;
        }
      }
      while (j < num_docs && size_of[docs[j]] == 0) ++j;
    }
  }
  if (overran)
    throw std::out_of_range("the documents hold fewer tokens than num_samples * seq_length + 1");
  return result;
}

py::tuple build_blending_indices(
    py::array_t<double, py::array::c_style | py::array::forcecast> weights, int64_t size) {
  const int64_t num_datasets = weights.size();
  if (num_datasets <= 0 || num_datasets > 32767)
    throw std::invalid_argument("need between 1 and 32767 datasets");
  const double* w = weights.data();
  for (int64_t d = 0; d < num_datasets; ++d) {
    if (!(w[d] >= 0.0)) throw std::invalid_argument("weights must be non-negative numbers");
  }

  py::array_t<int16_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  int16_t* which = dataset_index.mutable_data();
  int64_t* nth = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> count(num_datasets, 0);
    for (int64_t i = 0; i < size; ++i) {
      const double target = std::max(static_cast<double>(i), 1.0);
      int64_t best = 0;
      double best_lag = w[0] * target - static_cast<double>(count[0]);
      for (int64_t d = 1; d < num_datasets; ++d) {
        const double lag = w[d] * target - static_cast<double>(count[d]);
        if (lag > best_lag) {
          best_lag = lag;
          best = d;
        }
      }
      which[i] = static_cast<int16_t>(best);
      nth[i] = count[best];
      ++count[best];
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "C++ index builders for engine.data (sample index, blending index)";
  m.def("build_sample_index", &build_sample_index, py::arg("sizes"), py::arg("doc_index"),
        py::arg("seq_length"), py::arg("num_samples"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"));
}
