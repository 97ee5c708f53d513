// Tests of the MFU peak: the GPU table picks the right part by the names CUDA reports.
#include <doctest/doctest.h>

#include "lib/train/peak.h"

using namespace mpigpt;

TEST_CASE("dense bf16 peak of GPUs by the names the CUDA runtime reports") {
  CHECK(dense_bf16_peak_flops("cuda (NVIDIA H100 80GB HBM3, sm_90)") == 989e12);
  CHECK(dense_bf16_peak_flops("NVIDIA H200") == 989e12);
  CHECK(dense_bf16_peak_flops("NVIDIA H100 PCIe") == 756e12);
  CHECK(dense_bf16_peak_flops("NVIDIA H100 NVL") == 835e12);
  CHECK(dense_bf16_peak_flops("NVIDIA GH200 480GB") == 989e12);
  CHECK(dense_bf16_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12);
  CHECK(dense_bf16_peak_flops("NVIDIA L40S") == 362e12);
  CHECK(dense_bf16_peak_flops("NVIDIA L4") == 121e12);
  CHECK(dense_bf16_peak_flops("NVIDIA B200") == 2250e12);
  CHECK(dense_bf16_peak_flops("NVIDIA GeForce RTX 4090") == 0.0);  // not in the table: measured instead
  CHECK(dense_bf16_peak_flops("cpu (fp32, OpenBLAS, 2 OpenMP threads)") == 0.0);
}

TEST_CASE("the CPU backend's peak is a measured fp32 GEMM rate") {
  auto ops = make_cpu_ops();
  const double p = measured_peak_flops(*ops);
  CHECK(p > 1e8);   // any machine this runs on does more than 0.1 GFLOP/s
  CHECK(p < 1e13);  // and no CPU core pair 10 TFLOP/s of fp32
}
