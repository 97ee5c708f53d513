// The host emulator's cuda_runtime.h (docs/testing.md): the device built-ins and the runtime API
// subset the kernels and CudaOps use, served by emulator.cpp and emulator_runtime.cpp.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "cuda_bf16.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {__bfloat162float(v.x), __bfloat162float(v.y)}; }

extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

struct CUstream_st;

namespace emu {
void syncthreads();
void syncwarp();
int syncthreads_or(int p);
void* dyn_smem();
size_t dyn_smem_bytes();  // the launch's dynamic shared memory size
void shfl_exchange(const void* in, void* out, size_t bytes, int src_lane_xor);
int lane();  // the calling thread's lane in its warp
// Warp-collective: out[l] = lane l's `in` (bytes each, at most 256) for the 32 lanes of the warp.
void warp_allgather(const void* in, void* out, size_t bytes);
// A launch of `kernel` (kernel_id of the function launched): fails, as on a GPU, when it asks for
// more than 48 KiB of dynamic shared memory without cudaFuncSetAttribute having allowed that much.
void launch(const void* kernel, dim3 grid, dim3 block, size_t smem, ::CUstream_st* stream,
            std::function<void()> body);
template <class F>
const void* kernel_id(F kernel) {
  return reinterpret_cast<const void*>(kernel);
}
void set_max_dynamic_smem(const void* kernel, int bytes);  // cudaFuncAttributeMaxDynamicSharedMemorySize

}  // namespace emu

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::syncwarp(); }
inline int __syncthreads_or(int p) { return emu::syncthreads_or(p); }
template <class T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int = 32) {
  T r;
  emu::shfl_exchange(&v, &r, sizeof(T), lane_mask);
  return r;
}
// One fiber runs at a time and only barriers switch fibers: a plain read-modify-write is atomic.
template <class T>
T atomicAdd(T* p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
  const __nv_bfloat16 old = *p;
  *p = __float2bfloat16_rn(__bfloat162float(old) + __bfloat162float(v));
  return old;
}
inline __nv_bfloat162 atomicAdd(__nv_bfloat162* p, __nv_bfloat162 v) {
  const __nv_bfloat162 old = *p;
  p->x = __float2bfloat16_rn(__bfloat162float(old.x) + __bfloat162float(v.x));
  p->y = __float2bfloat16_rn(__bfloat162float(old.y) + __bfloat162float(v.y));
  return old;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __int_as_float(int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __expf(float x) { return std::exp(x); }
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
  return a < b ? a : b;
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}

// ---- the runtime API (synchronous: every stream is the host) ----------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorIllegalAddress = 700,
  cudaErrorMisalignedAddress = 716,
  cudaErrorLaunchFailure = 719,
  cudaErrorIllegalInstruction = 715,
};
using cudaError = cudaError_t;
using cudaStream_t = struct CUstream_st*;
using cudaEvent_t = struct CUevent_st*;
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
constexpr unsigned cudaStreamNonBlocking = 1;
struct cudaDeviceProp {
  char name[256];
  int major, minor;
  size_t totalGlobalMem;
  int multiProcessorCount;
};
struct cudaFuncAttributes {
  int binaryVersion, ptxVersion;
};
cudaError_t cudaGetDeviceCount(int*);
cudaError_t cudaSetDevice(int);
cudaError_t cudaGetDevice(int*);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp*, int);
cudaError_t cudaDeviceGetAttribute(int*, cudaDeviceAttr, int);
cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t);
const char* cudaGetErrorName(cudaError_t);
cudaError_t cudaMalloc(void**, size_t);
template <class T>
cudaError_t cudaMalloc(T** p, size_t n) {
  return cudaMalloc(reinterpret_cast<void**>(p), n);
}
cudaError_t cudaFree(void*);
cudaError_t cudaMallocHost(void**, size_t);
cudaError_t cudaFreeHost(void*);
cudaError_t cudaMemGetInfo(size_t*, size_t*);
cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t = nullptr);
cudaError_t cudaMemcpy(void*, const void*, size_t, cudaMemcpyKind);
cudaError_t cudaMemsetAsync(void*, int, size_t, cudaStream_t = nullptr);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t*, unsigned);
cudaError_t cudaStreamDestroy(cudaStream_t);
cudaError_t cudaStreamSynchronize(cudaStream_t);
cudaError_t cudaDeviceSynchronize();
constexpr unsigned cudaEventDisableTiming = 2;
constexpr cudaError_t cudaErrorNotReady = cudaError_t(600);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t*, unsigned);
cudaError_t cudaEventDestroy(cudaEvent_t);
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = nullptr);
cudaError_t cudaEventQuery(cudaEvent_t);
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned = 0);
cudaError_t cudaDeviceGetPCIBusId(char*, int, int);
template <class F>
cudaError_t cudaFuncSetAttribute(F kernel, cudaFuncAttribute, int v) {
  if (v < 0 || v > 232448) return cudaErrorInvalidValue;
  emu::set_max_dynamic_smem(emu::kernel_id(kernel), v);
  return cudaSuccess;
}
namespace emu {
// What cudaGetLastError returns next: set by failed launches and calls (emulator_runtime.cpp).
extern cudaError_t last_error;
}  // namespace emu
template <class F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, F) {
  a->binaryVersion = a->ptxVersion = 90;
  return cudaSuccess;
}
template <class F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, F, int, size_t) {
  *n = 2;
  return cudaSuccess;
}
