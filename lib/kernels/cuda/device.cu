// CUDA device discovery.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include "lib/kernels/cuda/device.h"

namespace mpigpt::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

std::string device_description(int index) {
  cudaDeviceProp p{};
  cudaError_t rc = cudaGetDeviceProperties(&p, index);
  if (rc != cudaSuccess) return fmt::format("device {}: {}", index, cudaGetErrorString(rc));
  return fmt::format("{} (sm_{}{}, {:.1f} GiB)", p.name, p.major, p.minor, p.totalGlobalMem / 1073741824.0);
}

}  // namespace mpigpt::cuda
