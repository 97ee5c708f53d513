// CUDA device discovery, callable from code that does not include CUDA headers. Only built
// when the CUDA backend is (MPIGPT_WITH_CUDA); the compute ops arrive with the CUDA backend.
#pragma once
#include <string>

namespace mpigpt::cuda {

// Number of visible CUDA devices; 0 when there is no driver or no device (never throws).
int device_count();
// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)" for device `index`, or the CUDA error text.
std::string device_description(int index);

}  // namespace mpigpt::cuda
