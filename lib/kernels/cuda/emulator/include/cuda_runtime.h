// The host emulator of the CUDA backend (docs/testing.md): this header stands in for the toolkit's
// cuda_runtime.h when lib/kernels/cuda/*.cu are compiled as C++ for the CPU. It declares the
// device built-ins the kernels use (thread and block indices, __syncthreads, warp shuffles, votes,
// atomics, vector types, fast-math intrinsics) and the runtime API subset of CudaOps, all served
// by emulator.cpp: every launch runs its blocks one after another, each CUDA thread of a block as
// a fiber, so barriers and shuffles behave as on the GPU (in a fixed interleaving). Streams are
// the host: every call completes before it returns, except the NCCL stand-in's operations, which
// finish where the stream's later work, an event wait or a synchronisation needs them.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
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
// The launches and attribute queries of the *_sm90a.cu kernels (rewrite_launches.py renames them),
// which exist only as sm_90a machine code: they fail with cudaErrorNoKernelImageForDevice unless
// the emulated GPU is compute capability 9.0 (MPIGPT_EMULATED_CC, emulator.cpp), as every launch
// fails on one older than 9.0.
void launch_sm90a(const void* kernel, dim3 grid, dim3 block, size_t smem, ::CUstream_st* stream,
                  std::function<void()> body);
template <class F>
const void* kernel_id(F kernel) {
  return reinterpret_cast<const void*>(kernel);
}
void set_max_dynamic_smem(const void* kernel, int bytes);  // cudaFuncAttributeMaxDynamicSharedMemorySize

// Hopper's asynchronous warpgroup products (wgmma.mma_async, mma_ptx.h), run as a GPU may run
// them: `product(base, out)` computes a thread's `count` accumulator values onto base (the
// accumulators when `accumulate`, or the result still in flight for them, else zeros), reading its
// shared-memory operands when it is called. Issued, the product's accumulators read NaN until the
// wgmma.wait_group that retires its group, which runs it again and aborts if the shared memory it
// reads changed in between (an operand tile refilled too early). A product issued without a
// wgmma.fence since the thread's products last all retired, one issued while some thread's
// asynchronous copies have reached shared memory with no fence.proxy.async after them, and a
// thread that ends with products not retired abort too.
void wgmma_fence();
void wgmma_issue(float* d, int count, bool accumulate, std::function<void(const float* base, float* out)> product);
void wgmma_commit();
void wgmma_wait(int pending);
void proxy_fence_async();  // fence.proxy.async.shared::cta

// Work that is not done when it is issued: the NCCL stand-in (nccl_mpi.cpp) issues its operations
// as nonblocking MPI and registers these hooks; the runtime calls them where a GPU would order
// work after it. `issued` numbers a stream's operations so far; `complete` finishes a stream's
// operations up to number `upto` in order (a null stream: every stream's, all of them); `done`
// says, without waiting, whether they are finished.
struct AsyncHooks {
  unsigned long long (*issued)(::CUstream_st* stream);
  void (*complete)(::CUstream_st* stream, unsigned long long upto);
  bool (*done)(::CUstream_st* stream, unsigned long long upto);
};
void set_async_hooks(const AsyncHooks* hooks);
// Finishes the stream's issued work (a null stream: all streams') before what comes next on it.
void complete_stream(::CUstream_st* stream);
// Work queued on a stream (a kernel, copy, fill or product): complete_stream, and counted for
// unordered_work. host_synced: the host waited for the stream (a null stream: for every stream).
void begin_work(::CUstream_st* stream);
void host_synced(::CUstream_st* stream);
// Empty when everything queued so far on other streams is ordered before the stream's next
// operation (by events it waited for, or host synchronisation); else which stream's is not. The
// emulator runs work when it is issued, so a missing wait does not show in results: the NCCL
// stand-in asks this before it reads an operation's input.
std::string unordered_work(::CUstream_st* stream);
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
// Whether the emulated GPU loads code built for sm_90 (or, sm90a_only, only for sm_90a):
// cudaSuccess, or cudaErrorNoKernelImageForDevice, which also becomes the last error.
cudaError_t image_error(bool sm90a_only);
}  // namespace emu
template <class F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, F) {
  a->binaryVersion = a->ptxVersion = 90;
  return emu::image_error(false);
}
namespace emu {
template <class F>
cudaError_t func_get_attributes_sm90a(cudaFuncAttributes* a, F) {
  a->binaryVersion = 90;
  a->ptxVersion = 0;
  return image_error(true);
}
}  // namespace emu
template <class F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, F, int, size_t) {
  *n = 2;
  return cudaSuccess;
}
