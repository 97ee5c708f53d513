// GPU test (CTest label gpu): device discovery. Exits 77 (reported as skipped) without a GPU.
#include <doctest/doctest.h>

#include <cstdlib>

#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/device.h"
#endif

TEST_CASE("CUDA devices are discovered and described") {
#ifdef MPIGPT_WITH_CUDA
  const int n = mpigpt::cuda::device_count();
  if (n == 0) {
    MESSAGE("no CUDA device: skipped");
    std::exit(77);
  }
  for (int i = 0; i < n; ++i) CHECK(mpigpt::cuda::device_description(i).find("sm_") != std::string::npos);
#else
  MESSAGE("built without the CUDA backend: skipped");
  std::exit(77);
#endif
}
