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

// The backend's peak: the table's figure for a known GPU (named by the backend), else a measured
// GEMM rate (bf16 on a GPU, fp32 on the CPU: the best rate of a large GEMM on this machine, what
// the hardware can really do here).
double measured_peak_flops(Ops& ops);

}  // namespace mpigpt
