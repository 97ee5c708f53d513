// What every CUDA kernel file shares: the CHECK macros for CUDA and cuBLAS calls, float <-> storage
// conversion for the two data dtypes, a dtype dispatch and launch helpers. Included only by
// lib/kernels/cuda/*.cu.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "lib/core/error.h"
#include "lib/kernels/cuda/cuda_ops.h"

namespace mpigpt::cuda {

// A failed call throws mpigpt::Error naming file:line, the call and the library's message; app/
// turns it into MPI_Abort.
[[noreturn]] void cuda_failed(cudaError_t rc, const char* call, const char* file, int line);
[[noreturn]] void cublas_failed(cublasStatus_t rc, const char* call, const char* file, int line);

}  // namespace mpigpt::cuda

#define MPIGPT_CUDA(call)                                                             \
  do {                                                                                \
    cudaError_t mpigpt_rc_ = (call);                                                  \
    if (mpigpt_rc_ != cudaSuccess) ::mpigpt::cuda::cuda_failed(mpigpt_rc_, #call, __FILE__, __LINE__); \
  } while (0)
#define MPIGPT_CUBLAS(call)                                                           \
  do {                                                                                \
    cublasStatus_t mpigpt_rc_ = (call);                                               \
    if (mpigpt_rc_ != CUBLAS_STATUS_SUCCESS) ::mpigpt::cuda::cublas_failed(mpigpt_rc_, #call, __FILE__, __LINE__); \
  } while (0)
// After a kernel launch: launch-configuration errors surface here, execution errors at the next
// synchronising call.
#define MPIGPT_CUDA_LAUNCHED() MPIGPT_CUDA(cudaGetLastError())

namespace mpigpt::cuda {

using bf16 = __nv_bfloat16;

// Storage <-> float. Kernels are templates over the storage type T (float or bf16).
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }

// The host waits for the work queued on `stream` (cudaStreamSynchronize), as a wait the
// watchdog watches (lib/core/watchdog.h): the stream may itself wait for collectives on NCCL
// streams, which wait for peers. `why` names what the host needs the results for.
void wait_for_stream(cudaStream_t stream, const char* why);

inline unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// Runs the generic lambda `body` with a value of the storage type matching `dtype` (F32 -> float,
// BF16 -> bf16), e.g. dispatch_float(t.dtype, "gelu", [&](auto tag) { using T = decltype(tag); ... }).
template <class F>
void dispatch_float(DType dtype, const char* op, F&& body) {
  if (dtype == DType::F32) {
    body(float{});
  } else if (dtype == DType::BF16) {
    body(bf16{});
  } else {
    fail("{}: data tensors must be f32 or bf16, got {}", op, dtype_name(dtype));
  }
}

template <class T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.ptr);
}

}  // namespace mpigpt::cuda
