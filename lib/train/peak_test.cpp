// Tests of the MFU peak: the GPU table picks the right part by the names CUDA reports; CPU ranks
// that share cores get no MFU.
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

TEST_CASE("MFU's peak: the configured figure, a measured one, or none when CPU ranks share the cores") {
  auto ops = make_cpu_ops();
  const MfuPeak set = mfu_peak(2.5, *ops, 64, 2);
  CHECK(set.flops == 2.5e12);
  CHECK(set.what == "training.peak_tflops");
  const MfuPeak shared = mfu_peak(0, *ops, 64, 2);  // 64 ranks on 2 cores
  CHECK(shared.flops == 0.0);
  CHECK(shared.what.find("64 ranks x") != std::string::npos);
  CHECK(shared.what.find("share this node's 2 cores") != std::string::npos);
  CHECK(shared.what.find("training.peak_tflops") != std::string::npos);
  const MfuPeak alone = mfu_peak(0, *ops, 1, 1u << 20);
  CHECK(alone.flops > 1e8);
  CHECK(alone.what.find("fp32 GEMM") != std::string::npos);
}
