// The host emulator of the CUDA backend, its runtime API (docs/testing.md): the emulated devices
// (how many, their compute capability and memory: MPIGPT_EMULATED_DEVICES, MPIGPT_EMULATED_CC,
// MPIGPT_EMULATED_MEMORY_MIB), which code they load, the last error, device and pinned memory,
// and streams and events, whose work has already run when it is issued (emulator.cpp runs each
// launch at once), with the bookkeeping of what each stream is ordered after.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "cuda_runtime.h"

namespace emu {
cudaError_t last_error = cudaSuccess;

namespace {
const AsyncHooks* async_hooks = nullptr;
}  // namespace
void set_async_hooks(const AsyncHooks* hooks) { async_hooks = hooks; }
void complete_stream(::CUstream_st* stream) {
  if (async_hooks) async_hooks->complete(stream, ~0ull);
}

// What each stream's later work is ordered after: the emulator runs kernels, copies and products
// when they are issued, so it cannot see a race between streams; it tracks instead, per stream,
// how many of them it has queued (work) and how many of every other stream's it is ordered
// after (seen: through events it waited for, transitively) or the host is (synced).
namespace {
using Counts = std::map<::CUstream_st*, unsigned long long>;
Counts work, synced;
std::map<::CUstream_st*, Counts> seen;
void raise_to(Counts& into, const Counts& from) {
  for (const auto& [s, n] : from) into[s] = std::max(into[s], n);
}
}  // namespace
void begin_work(::CUstream_st* stream) {
  complete_stream(stream);
  ++work[stream];
}
void host_synced(::CUstream_st* stream) {
  if (stream) {
    synced[stream] = work[stream];
  } else {
    synced = work;
  }
}
std::string unordered_work(::CUstream_st* stream) {
  const Counts& known = seen[stream];
  for (const auto& [other, n] : work) {
    if (other == stream) continue;
    const auto k = known.find(other);
    const auto h = synced.find(other);
    const unsigned long long ordered =
        std::max(k == known.end() ? 0ull : k->second, h == synced.end() ? 0ull : h->second);
    if (n > ordered) {
      char text[160];
      std::snprintf(text, sizeof text, "%llu operation(s) queued on stream %p are not ordered before stream %p",
                    n - ordered, static_cast<void*>(other), static_cast<void*>(stream));
      return text;
    }
  }
  return "";
}
}  // namespace emu

// ---- runtime API: one device, host memory, streams and events that are already complete ---------
static std::map<void*, size_t> allocations;  // cudaMalloc'ed block -> its size
// MPIGPT_EMULATED_DEVICES devices (default 1), with bus ids 0000:01:00.0, 0000:02:00.0, ..., so
// that ranks on devices of their own may use the NCCL stand-in; they share the host's memory.
static int device_count() {
  static const int n = [] {
    const char* e = std::getenv("MPIGPT_EMULATED_DEVICES");
    return e && std::atoi(e) > 0 ? std::atoi(e) : 1;
  }();
  return n;
}
static int current_device = 0;
cudaError_t cudaGetDeviceCount(int* n) {
  *n = device_count();
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= device_count()) return cudaErrorInvalidDevice;
  current_device = d;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = current_device;
  return cudaSuccess;
}
// MPIGPT_EMULATED_CC=X.Y makes the devices compute capability X.Y (default 9.0, an H100), for the
// checks of what runs where: the emulated program carries code for sm_90 (machine code and PTX,
// as a build for CMake's architecture 90), which a GPU older than 9.0 cannot load, and the
// *_sm90a kernels only as sm_90a machine code, which nothing but a 9.0 GPU runs.
static int device_cc() {
  static const int cc = [] {
    const char* e = std::getenv("MPIGPT_EMULATED_CC");
    int major = 0, minor = 0;
    if (!e) return 90;
    if (std::sscanf(e, "%d.%d", &major, &minor) != 2 || major < 1 || minor < 0 || minor > 9) {
      fprintf(stderr, "cuda emulator: MPIGPT_EMULATED_CC = '%s' is not a compute capability like 9.0\n", e);
      std::abort();
    }
    return 10 * major + minor;
  }();
  return cc;
}
// The device memory (MPIGPT_EMULATED_MEMORY_MIB, default 80 GiB), of which 10 GiB or an eighth,
// whichever is less, is taken by others, so that requests beyond the rest fail as out of memory.
static size_t device_memory() {
  static const size_t bytes = [] {
    const char* e = std::getenv("MPIGPT_EMULATED_MEMORY_MIB");
    return e && std::atol(e) > 0 ? size_t(std::atol(e)) << 20 : size_t(80) << 30;
  }();
  return bytes;
}
static size_t device_memory_free_at_start() {
  return device_memory() - std::min(device_memory() / 8, size_t(10) << 30);
}
namespace emu {
cudaError_t image_error(bool sm90a_only) {
  const bool loads = sm90a_only ? device_cc() == 90 : device_cc() >= 90;
  if (loads) return cudaSuccess;
  last_error = cudaErrorNoKernelImageForDevice;
  return cudaErrorNoKernelImageForDevice;
}
}  // namespace emu
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  std::memset(p, 0, sizeof(*p));
  if (device_cc() == 90)
    std::strcpy(p->name, "NVIDIA H100 80GB HBM3 (emulated)");
  else
    std::snprintf(p->name, sizeof p->name, "GPU of compute capability %d.%d (emulated)", device_cc() / 10,
                  device_cc() % 10);
  p->major = device_cc() / 10;
  p->minor = device_cc() % 10;
  p->totalGlobalMem = device_memory();
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
    {cudaErrorNoKernelImageForDevice, "cudaErrorNoKernelImageForDevice",
     "no kernel image is available for execution on the device"},
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
  if (n > device_memory_free_at_start() - allocated_total) {
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
  *f = device_memory_free_at_start() - allocated_total;
  *t = device_memory();
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t stream) {
  emu::begin_work(stream);
  std::memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) {  // returns when the copy is done
  cudaMemcpyAsync(d, s, n, k);
  emu::host_synced(nullptr);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t stream) {
  emu::begin_work(stream);
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
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  emu::complete_stream(stream);
  emu::host_synced(stream);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  emu::complete_stream(nullptr);
  emu::host_synced(nullptr);
  return cudaSuccess;
}


// An event: the stream and the number of its issued operations when it was recorded, and what
// that stream was ordered after then (its own work included).
struct CUevent_st {
  cudaStream_t stream = nullptr;
  unsigned long long upto = 0;
  std::map<cudaStream_t, unsigned long long> ordered_after;
};
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
  e->stream = stream;
  e->upto = emu::async_hooks ? emu::async_hooks->issued(stream) : 0;
  e->ordered_after = emu::seen[stream];
  e->ordered_after[stream] = emu::work[stream];
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  return !emu::async_hooks || emu::async_hooks->done(e->stream, e->upto) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t e, unsigned) {
  if (emu::async_hooks) emu::async_hooks->complete(e->stream, e->upto);
  emu::raise_to(emu::seen[stream], e->ordered_after);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetPCIBusId(char* s, int n, int device) {
  std::snprintf(s, size_t(n), "0000:%02x:00.0", device + 1);
  return cudaSuccess;
}
