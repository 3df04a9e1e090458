// Row copy / add kernels for the group collectives (any sm_80+; built for the archs CMake picks): one block per row, optional index
// on either side, so a gather, a scatter, or a fused gather-transfer-scatter into a peer's
// (CUDA IPC mapped) buffer is one launch.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

__global__ void copy_rows_kernel(const char* __restrict__ src, char* __restrict__ dst, const int64_t* __restrict__ src_index,
                                 const int64_t* __restrict__ dst_index, int64_t row_bytes, bool vec16) {
  const int64_t row = blockIdx.x;
  const char* s = src + (src_index ? src_index[row] : row) * row_bytes;
  char* d = dst + (dst_index ? dst_index[row] : row) * row_bytes;
  if (vec16) {
    const int64_t n = row_bytes / 16;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) reinterpret_cast<int4*>(d)[i] = reinterpret_cast<const int4*>(s)[i];
  } else {
    for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) d[i] = s[i];
  }
}

__global__ void add_rows_f32_kernel(const float* __restrict__ src, float* __restrict__ dst, const int64_t* __restrict__ src_index,
                                    const int64_t* __restrict__ dst_index, int64_t row_elems) {
  const int64_t row = blockIdx.x;
  const float* s = src + (src_index ? src_index[row] : row) * row_elems;
  float* d = dst + (dst_index ? dst_index[row] : row) * row_elems;
  for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) atomicAdd(d + i, s[i]);
}

}  // namespace

void copy_rows(uintptr_t src, uintptr_t dst, uintptr_t src_index, uintptr_t dst_index, int64_t n_rows, int64_t row_bytes,
               uintptr_t stream) {
  if (n_rows == 0 || row_bytes == 0) return;
  const bool vec16 = row_bytes % 16 == 0 && src % 16 == 0 && dst % 16 == 0;
  copy_rows_kernel<<<static_cast<unsigned>(n_rows), 128, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const char*>(src), reinterpret_cast<char*>(dst), reinterpret_cast<const int64_t*>(src_index),
      reinterpret_cast<const int64_t*>(dst_index), row_bytes, vec16);
  check(cudaGetLastError(), "copy_rows");
}

void add_rows_f32(uintptr_t src, uintptr_t dst, uintptr_t src_index, uintptr_t dst_index, int64_t n_rows, int64_t row_elems,
                  uintptr_t stream) {
  if (n_rows == 0 || row_elems == 0) return;
  add_rows_f32_kernel<<<static_cast<unsigned>(n_rows), 128, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const float*>(src), reinterpret_cast<float*>(dst), reinterpret_cast<const int64_t*>(src_index),
      reinterpret_cast<const int64_t*>(dst_index), row_elems);
  check(cudaGetLastError(), "add_rows_f32");
}
