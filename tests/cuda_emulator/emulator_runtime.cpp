// The host emulator of the CUDA backend, its runtime API (docs/testing.md): one H100-like device of
// 80 GiB, the last error, device and pinned memory, and streams and events whose work has already
// run when it is issued (emulator.cpp runs each launch at once).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "cuda_runtime.h"

namespace emu {
cudaError_t last_error = cudaSuccess;
}  // namespace emu

// ---- runtime API: one device, host memory, streams and events that are already complete ---------
static std::map<void*, size_t> allocations;  // cudaMalloc'ed block -> its size
static int current_device = 0;
cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d != 0) return cudaErrorInvalidDevice;
  current_device = d;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = current_device;
  return cudaSuccess;
}
// 80 GiB, of which others hold 10 GiB, so that a request beyond the rest fails as out of memory.
static constexpr size_t kDeviceMemory = size_t(80) << 30, kFreeAtStart = size_t(70) << 30;
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  std::memset(p, 0, sizeof(*p));
  std::strcpy(p->name, "NVIDIA H100 80GB HBM3 (emulated)");
  p->major = 9;
  p->minor = 0;
  p->totalGlobalMem = kDeviceMemory;
  p->multiProcessorCount = 4;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrMultiProcessorCount ? 4 : 232448;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::last_error;
  emu::last_error = cudaSuccess;
  return e;
}
// The name and message of each error the emulator raises itself; others are "emulated error".
namespace {
struct ErrorText {
  cudaError_t code;
  const char* name;
  const char* message;
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
};
const ErrorText& error_text(cudaError_t e) {
  static constexpr ErrorText other{cudaSuccess, "cudaErrorEmulated", "emulated error"};
  for (const ErrorText& t : kErrors)
    if (t.code == e) return t;
  return other;
}
}  // namespace
const char* cudaGetErrorString(cudaError_t e) { return error_text(e).message; }
const char* cudaGetErrorName(cudaError_t e) { return error_text(e).name; }
static size_t allocated_total = 0;
cudaError_t cudaMalloc(void** p, size_t n) {
  if (n > kFreeAtStart - allocated_total) {
    emu::last_error = cudaErrorMemoryAllocation;
    *p = nullptr;
    return cudaErrorMemoryAllocation;
  }
  allocated_total += n;
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256 + 256);
  std::memset(*p, 0xff, n);  // garbage, as cudaMalloc's memory is
  allocations[*p] = n;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  auto it = allocations.find(p);
  if (it == allocations.end()) return cudaErrorInvalidValue;
  allocated_total -= it->second;
  allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t n) {
  *p = std::malloc(n);
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* f, size_t* t) {
  *f = kFreeAtStart - allocated_total;
  *t = kDeviceMemory;
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t) {
  std::memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) {  // returns when the copy is done
  return cudaMemcpyAsync(d, s, n, k);
}
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t) {
  std::memset(d, v, n);
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = reinterpret_cast<cudaStream_t>(new int(0));
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete reinterpret_cast<int*>(s);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }


// Events: every operation is complete when it is issued.
struct CUevent_st {};
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
cudaError_t cudaDeviceGetPCIBusId(char* s, int n, int) {
  std::snprintf(s, size_t(n), "0000:01:00.0");
  return cudaSuccess;
}
