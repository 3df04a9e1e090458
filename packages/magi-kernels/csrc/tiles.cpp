// magi_kernels._native: host-side tile tables of the Triton backend.
//
// Slices are coloured into layers along one axis (q for forward/dQ, k for dK/dV) so that no two
// tiles of a launch write the same rows; each layer lists its (slice index, tile start) pairs.
// Same result as magi_kernels.triton_backend._layers / _layer_pairs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace py = pybind11;
using Slice = std::array<int64_t, 5>;

static py::bytes as_bytes(const std::vector<int32_t>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int32_t));
}

// Slices whose starts agree modulo `block` (same phase) have coinciding tiles, so they may share
// a layer even when their ranges overlap; slices of different phase only when disjoint.
static std::vector<std::vector<int64_t>> layers(const std::vector<Slice>& s, int axis, int64_t block) {
  std::vector<int64_t> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return s[a][axis] != s[b][axis] ? s[a][axis] < s[b][axis] : s[a][axis + 1] < s[b][axis + 1];
  });
  std::vector<std::vector<int64_t>> out;
  std::vector<std::map<int64_t, int64_t>> ends;  // per layer: phase -> largest end
  for (int64_t i : order) {
    const auto& x = s[i];
    if (x[axis + 1] <= x[axis] || x[2] >= x[3] || x[0] >= x[1]) continue;  // empty slice
    const int64_t start = x[axis], end = x[axis + 1], phase = start % block;
    bool placed = false;
    for (size_t l = 0; l < ends.size() && !placed; ++l) {
      bool ok = true;
      for (const auto& [ph, e] : ends[l]) ok = ok && (ph == phase || e <= start);
      if (ok) {
        out[l].push_back(i);
        auto& e = ends[l][phase];
        e = std::max(e, end);
        placed = true;
      }
    }
    if (!placed) {
      out.push_back({i});
      ends.push_back({{phase, end}});
    }
  }
  return out;
}

// Returns a list of (slice ids bytes, tile starts bytes, n tiles) per layer (int32 data).
static py::list tiles(const std::vector<Slice>& slices, int axis, int64_t block) {
  if (axis != 0 && axis != 2) throw std::invalid_argument("axis must be 0 (q) or 2 (k)");
  if (block <= 0) throw std::invalid_argument("block must be positive");
  py::list out;
  for (const auto& layer : layers(slices, axis, block)) {
    std::vector<int32_t> sid, start;
    for (int64_t i : layer) {
      for (int64_t b = slices[i][axis]; b < slices[i][axis + 1]; b += block) {
        sid.push_back(static_cast<int32_t>(i));
        start.push_back(static_cast<int32_t>(b));
      }
    }
    out.append(py::make_tuple(as_bytes(sid), as_bytes(start), static_cast<int64_t>(sid.size())));
  }
  return out;
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "magi-kernels native helpers";
  m.def("tiles", &tiles, py::arg("slices"), py::arg("axis"), py::arg("block"));
}
