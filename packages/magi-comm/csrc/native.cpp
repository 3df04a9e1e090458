// magi_comm._native: host-side index planning for group collectives and (with CUDA) fused
// range gather/scatter kernels. Tensors cross the boundary as raw pointers plus a stream, so
// the module depends on neither libtorch nor a particular torch version.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using Splits = std::vector<int64_t>;
using RankSets = std::vector<std::vector<int64_t>>;

py::bytes to_bytes(const std::vector<int64_t>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
}

void check_rank(int64_t r, int64_t world, const char* what) {
  if (r < 0 || r >= world) {
    throw std::invalid_argument(std::string(what) + " names rank " + std::to_string(r) + ", but the group has " +
                                std::to_string(world) + " ranks");
  }
}

// Rows of `sizes`-splits, grouped by rank in rank order, for the splits whose rank set holds
// that rank. Returns (rows, counts per rank).
std::pair<std::vector<int64_t>, std::vector<int64_t>> rows_by_rank(const Splits& sizes, const RankSets& ranks,
                                                                   int64_t world, const char* what) {
  if (sizes.size() != ranks.size()) throw std::invalid_argument(std::string(what) + ": sizes and ranks differ in length");
  std::vector<int64_t> offsets(sizes.size());
  int64_t pos = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) throw std::invalid_argument(std::string(what) + ": negative split size");
    offsets[i] = pos;
    pos += sizes[i];
  }
  std::vector<std::vector<size_t>> per_rank(world);
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int64_t r : ranks[i]) {
      check_rank(r, world, what);
      if (sizes[i]) per_rank[r].push_back(i);
    }
  }
  std::vector<int64_t> rows, counts(world, 0);
  for (int64_t r = 0; r < world; ++r) {
    for (size_t i : per_rank[r]) {
      for (int64_t k = 0; k < sizes[i]; ++k) rows.push_back(offsets[i] + k);
      counts[r] += sizes[i];
    }
  }
  return {rows, counts};
}

// The row-level form of a GroupCast (see magi_comm.group_collective.cast_index_plan).
py::tuple cast_index_plan(const Splits& input_split_sizes, const RankSets& dst_indices, const Splits& output_split_sizes,
                          const std::vector<int64_t>& src_index, int64_t world) {
  RankSets src_sets;
  src_sets.reserve(src_index.size());
  for (int64_t s : src_index) src_sets.push_back({s});
  auto send = rows_by_rank(input_split_sizes, dst_indices, world, "dst_indices");
  auto recv = rows_by_rank(output_split_sizes, src_sets, world, "src_index");
  return py::make_tuple(to_bytes(send.first), send.second, to_bytes(recv.first), recv.second);
}

}  // namespace

#ifdef MAGI_WITH_CUDA
void copy_rows(uintptr_t src, uintptr_t dst, uintptr_t src_index, uintptr_t dst_index, int64_t n_rows, int64_t row_bytes,
               uintptr_t stream);
void add_rows_f32(uintptr_t src, uintptr_t dst, uintptr_t src_index, uintptr_t dst_index, int64_t n_rows, int64_t row_elems,
                  uintptr_t stream);
#endif

PYBIND11_MODULE(_native, m) {
  m.doc() = "magi-comm native helpers";
  m.def("cast_index_plan", &cast_index_plan, py::arg("input_split_sizes"), py::arg("dst_indices"),
        py::arg("output_split_sizes"), py::arg("src_index"), py::arg("world"));
#ifdef MAGI_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  // what the kernels were compiled for (CMake CUDA_ARCHITECTURES entries, comma-separated);
  // magi_comm.native checks the GPU's compute capability against it before launching
  m.attr("CUDA_ARCHS") = MAGI_CUDA_ARCHS_STR;
  m.def("copy_rows", &copy_rows,
        "dst[dst_index[i]] = src[src_index[i]] for rows of row_bytes bytes; an index pointer of 0 means identity",
        py::arg("src"), py::arg("dst"), py::arg("src_index"), py::arg("dst_index"), py::arg("n_rows"), py::arg("row_bytes"),
        py::arg("stream"));
  m.def("add_rows_f32", &add_rows_f32, "dst[dst_index[i]] += src[src_index[i]] for fp32 rows (atomic: repeats allowed)",
        py::arg("src"), py::arg("dst"), py::arg("src_index"), py::arg("dst_index"), py::arg("n_rows"), py::arg("row_elems"),
        py::arg("stream"));
#else
  m.attr("WITH_CUDA") = false;
  m.attr("CUDA_ARCHS") = "";
#endif
}
