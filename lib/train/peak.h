// The peak FLOP rate MFU is measured against when the user gives none (training.peak_tflops = 0):
// for a GPU the vendor's dense bf16 tensor-core rate, for the CPU backend a measured fp32 GEMM.
#pragma once
#include <string>

#include "lib/kernels/ops.h"

namespace mpigpt {

// Dense (no sparsity) bf16 peak in FLOP/s of the GPU whose name `gpu` contains (e.g. "NVIDIA H100
// 80GB HBM3", "NVIDIA H200"), or 0 when the model is not in the table: the vendor's figure, which
// Megatron-LM and llm.c report MFU against.
double dense_bf16_peak_flops(const std::string& gpu);

// The backend's measured GEMM rate: the best of a large GEMM on this machine (bf16 8192^3 on a
// GPU, fp32 1024^3 on the CPU), what the hardware can really do here.
double measured_peak_flops(Ops& ops);

// What MFU is measured against, per rank: flops 0 where no figure would be true, and `what` says
// where the figure comes from or why there is none.
struct MfuPeak {
  double flops = 0;
  std::string what;
};
// training.peak_tflops when > 0; else a GPU's dense_bf16_peak_flops, or measured_peak_flops,
// except on the CPU when the `node_ranks` ranks of this node times this rank's OpenMP threads
// outnumber the node's `cores`: a GEMM then measures a share of the machine, and MFU against it
// would read high.
MfuPeak mfu_peak(double peak_tflops, Ops& ops, int node_ranks, unsigned cores);

}  // namespace mpigpt
