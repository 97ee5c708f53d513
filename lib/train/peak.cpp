// The peak FLOP rate for MFU: the GPU table and the GEMM measurement.
#include "lib/train/peak.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>

#include "lib/kernels/buffer.h"

namespace mpigpt {

double dense_bf16_peak_flops(const std::string& gpu) {
  auto has = [&](const char* s) { return gpu.find(s) != std::string::npos; };
  // Dense bf16 tensor-core TFLOP/s from the vendors' data sheets. The PCIe/NVL H100 parts run at a
  // lower clock and have fewer SMs than the SXM part (whose memory is HBM3: "H100 80GB HBM3").
  struct Entry {
    const char* name;
    const char* unless;  // a second substring that picks another row
    double tflops;
  };
  static const Entry table[] = {
      {"GB200", nullptr, 2500}, {"B200", nullptr, 2250}, {"H200", nullptr, 989},  {"GH200", nullptr, 989},
      {"H100 PCIe", nullptr, 756}, {"H100 NVL", nullptr, 835}, {"H100", nullptr, 989}, {"H800", nullptr, 989},
      {"A100", nullptr, 312}, {"A800", nullptr, 312},  {"L40S", nullptr, 362}, {"L4", "L40", 121},
      {"A10G", nullptr, 70},  {"V100", nullptr, 125},
  };
  for (const Entry& e : table)
    if (has(e.name) && !(e.unless && has(e.unless))) return e.tflops * 1e12;
  return 0.0;
}

double measured_peak_flops(Ops& ops) {
  // A GPU is timed on bf16 operands big enough to fill it; the CPU on fp32.
  const bool gpu = ops.device() == Device::CUDA;
  const int64_t n = gpu ? 8192 : 1024;
  const DType dt = gpu ? DType::BF16 : DType::F32;
  const size_t bytes = size_t(n * n) * dtype_size(dt);
  Buffer a(ops, bytes), b(ops, bytes), c(ops, bytes);
  Tensor ta = a.tensor({n, n}, dt), tb = b.tensor({n, n}, dt), tc = c.tensor({n, n}, dt);
  ops.fill(ta, 0.5f);
  ops.fill(tb, 0.25f);
  ops.gemm(tc, ta, tb, false, true, 1.0f, 0.0f);  // warm-up: thread pool start, page faults, heuristics
  ops.synchronize();
  double best = 1e30;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    ops.gemm(tc, ta, tb, false, true, 1.0f, 0.0f);
    ops.synchronize();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * double(n) * n * n / best;
}

MfuPeak mfu_peak(double peak_tflops, Ops& ops, int node_ranks, unsigned cores) {
  if (peak_tflops > 0) return {peak_tflops * 1e12, "training.peak_tflops"};
  if (ops.device() == Device::CUDA) {
    const double table = dense_bf16_peak_flops(ops.name());
    if (table > 0) return {table, "the GPU's dense bf16 figure from its data sheet"};
    return {measured_peak_flops(ops), "a bf16 GEMM of 8192^3 timed at start (a GPU not in the table)"};
  }
  const int threads = omp_get_max_threads();
  if (int64_t(node_ranks) * threads > int64_t(cores))
    return {0.0, fmt::format("no MFU: {} ranks x {} threads share this node's {} cores, so a GEMM timed now measures "
                             "a share of them; set training.peak_tflops to the machine's rate per rank for MFU",
                             node_ranks, threads, cores)};
  return {measured_peak_flops(ops), fmt::format("an fp32 GEMM of 1024^3 timed at start on {} threads", threads)};
}

}  // namespace mpigpt
