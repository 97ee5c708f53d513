// The peak FLOP rate MFU is measured against when the user gives none: for the CPU backend the
// best rate of a large fp32 GEMM on this machine (what the hardware can really do here).
#pragma once
#include "lib/kernels/ops.h"

namespace mpigpt {

double measured_peak_flops(Ops& ops);

}  // namespace mpigpt
