// CUDA backend: the factory and construction (device, architecture check, stream, cuBLASLt), memory
// through the caching allocator, copies (host <-> device, and f32 <-> bf16 on the device), the
// element-wise ops fill/scale/add, and the CHECK failure handlers that every cuda_*.cu file shares.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "lib/core/watchdog.h"
#include "lib/kernels/cuda/cuda_common.cuh"

// The architectures this binary carries code for, for the "no kernel image" message. CMake may
// pass its CMAKE_CUDA_ARCHITECTURES as MPIGPT_CUDA_ARCHS (a string); otherwise nvcc's own
// __CUDA_ARCH_LIST__ (e.g. 800,900) says exactly what this file was compiled for.
#define MPIGPT_STRINGIFY_(...) #__VA_ARGS__
#define MPIGPT_STRINGIFY(...) MPIGPT_STRINGIFY_(__VA_ARGS__)
#if defined(MPIGPT_CUDA_ARCHS)
static constexpr const char* kBuiltArchs = MPIGPT_CUDA_ARCHS;
#elif defined(__CUDA_ARCH_LIST__)
static constexpr const char* kBuiltArchs = MPIGPT_STRINGIFY(__CUDA_ARCH_LIST__);
#else
static constexpr const char* kBuiltArchs = "unknown";
#endif

namespace mpigpt {

std::unique_ptr<Ops> make_cuda_ops(int device, const CudaOptions& options) {
  auto ops = std::make_unique<cuda::CudaOps>(device);
  ops->set_gemm_autotune(options.gemm_autotune);
  ops->set_attention(options.attention);
  return ops;
}

namespace cuda {

// ---- failure handlers and argument checks ----------------------------------------------------

namespace {
// What to do about the common CUDA failures, appended to the library's message.
const char* cuda_hint(cudaError_t rc) {
  switch (rc) {
    case cudaErrorMemoryAllocation:
      return "; out of GPU memory: lower training.micro_batch or set engine.recompute = selective (or full)";
    case cudaErrorNoDevice:
      return "; no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES and the job's GPU "
             "allocation) or use engine.backend = cpu";
    case cudaErrorInsufficientDriver:
      return "; no NVIDIA driver is loaded, or it is older than the CUDA runtime this mpigpt was built with: run on "
             "a GPU node with a current driver (or build with an older toolkit), or use engine.backend = cpu";
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidDeviceFunction:
      return "; this mpigpt has no code for the GPU's architecture: reconfigure with "
             "-DCMAKE_CUDA_ARCHITECTURES=<the GPU's XY> and rebuild";
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
      return "; a kernel failed, possibly one queued before this call (errors are asynchronous): rerun with "
             "CUDA_LAUNCH_BLOCKING=1 to see which";
    default:
      return "";
  }
}

std::string human_bytes(size_t b) {
  const double x = double(b);
  if (x >= double(1ull << 30)) return fmt::format("{:.2f} GiB", x / double(1ull << 30));
  if (x >= double(1ull << 20)) return fmt::format("{:.1f} MiB", x / double(1ull << 20));
  if (x >= 1024.0) return fmt::format("{:.1f} KiB", x / 1024.0);
  return fmt::format("{} B", b);
}

// "800,900" (nvcc's list) -> "sm_80, sm_90"; a CMake list "80;90-real" -> "sm_80, sm_90-real".
std::string describe_archs(const char* list) {
  std::string out, tok;
  auto flush = [&] {
    if (tok.empty()) return;
    const bool digits = std::all_of(tok.begin(), tok.end(), [](char c) { return c >= '0' && c <= '9'; });
    std::string name = digits && tok.size() >= 3 ? tok.substr(0, tok.size() - 1) : tok;  // 900 -> 90
    if (name[0] >= '0' && name[0] <= '9') name = "sm_" + name;  // "native", "compute_90" stay as they are
    out += (out.empty() ? "" : ", ") + name;
    tok.clear();
  };
  for (const char* p = list; *p; ++p) {
    if (*p == ',' || *p == ';' || *p == ' ')
      flush();
    else
      tok += *p;
  }
  flush();
  return out.empty() ? std::string("none") : out;
}
}  // namespace

void cuda_failed(cudaError_t rc, const char* call, const char* file, int line) {
  fail("{}:{}: CUDA call {} failed: {} ({}){}", file, line, call, cudaGetErrorName(rc), cudaGetErrorString(rc),
       cuda_hint(rc));
}

void cublas_failed(cublasStatus_t rc, const char* call, const char* file, int line) {
  const char* hint = "";
  if (rc == CUBLAS_STATUS_NOT_SUPPORTED)
    hint = "; cuBLASLt has no kernel for this combination of shapes, dtypes, alignment and epilogue";
  else if (rc == CUBLAS_STATUS_ALLOC_FAILED)
    hint = "; out of GPU memory: lower training.micro_batch or set engine.recompute = selective (or full)";
  else if (rc == CUBLAS_STATUS_EXECUTION_FAILED)
    hint = "; a kernel failed, possibly one queued earlier: rerun with CUDA_LAUNCH_BLOCKING=1 to see which";
  fail("{}:{}: cuBLAS call {} failed: {} ({}){}", file, line, call, cublasLtGetStatusName(rc),
       cublasLtGetStatusString(rc), hint);
}

// ---- kernels ---------------------------------------------------------------------------------

namespace {
constexpr int kThreads = 256;
// Grid-stride loops: enough blocks to fill any current GPU, never more than the work.
inline unsigned grid_for(int64_t n) { return std::min<unsigned>(blocks_for(n, kThreads), 8192u); }

template <class T>
__global__ void fill_kernel(T* p, int64_t n, T v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

template <class T>
__global__ void scale_kernel(T* p, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = from_f<T>(to_f(p[i]) * s);
}

// out may alias a or b: each element is read before it is written, by the same thread.
template <class T>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}

template <class D, class S>
__global__ void convert_kernel(D* dst, const S* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f<D>(to_f(src[i]));
}
}  // namespace

// ---- construction ----------------------------------------------------------------------------

CudaOps::CudaOps(int device) : device_(device) {
  int count = 0;
  MPIGPT_CUDA(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count)
    fail("CUDA device {} does not exist: this process sees {} device(s) (CUDA_VISIBLE_DEVICES may restrict them)",
         device, count);
  MPIGPT_CUDA(cudaSetDevice(device));
  cudaDeviceProp prop{};
  MPIGPT_CUDA(cudaGetDeviceProperties(&prop, device));

  // Does this binary carry code the GPU can run (SASS for its architecture, or PTX the driver can
  // compile for it)? Asking for one kernel's attributes answers that before anything is queued.
  cudaFuncAttributes attr{};
  const cudaError_t rc = cudaFuncGetAttributes(&attr, fill_kernel<float>);
  if (rc == cudaErrorNoKernelImageForDevice || rc == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();  // not sticky, but clear it for whoever handles the error
    fail("GPU {} ({}) is sm_{}{}, but this mpigpt was built with CUDA code for {} only; reconfigure with "
         "-DCMAKE_CUDA_ARCHITECTURES={}{} (or add it to the list) and rebuild",
         device, prop.name, prop.major, prop.minor, describe_archs(kBuiltArchs), prop.major, prop.minor);
  }
  MPIGPT_CUDA(rc);

  MPIGPT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MPIGPT_CUBLAS(cublasLtCreate(&lt_));
  MPIGPT_CUDA(cudaMalloc(&workspace_, kCublasWorkspace));
  MPIGPT_CUDA(cudaMallocHost(reinterpret_cast<void**>(&host_result_), 2 * sizeof(double)));

  const int dev = device_;
  auto raw_alloc = [dev](size_t bytes) -> void* {
    MPIGPT_CUDA(cudaSetDevice(dev));  // cudaMalloc allocates on the calling thread's current device
    void* p = nullptr;
    const cudaError_t r = cudaMalloc(&p, bytes);
    if (r == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // the allocator retries after emptying its cache
      return nullptr;
    }
    MPIGPT_CUDA(r);
    return p;
  };
  // A segment goes back only when every block in it was released, but kernels queued on the
  // stream (or collectives on a communication stream) may still be using those blocks: wait for
  // the whole device first. This runs only when the cache is emptied (out of memory, shutdown).
  auto raw_free = [dev](void* p) {
    MPIGPT_CUDA(cudaSetDevice(dev));
    MPIGPT_CUDA(cudaDeviceSynchronize());
    MPIGPT_CUDA(cudaFree(p));
  };
  alloc_ = std::make_unique<CachingAllocator>(raw_alloc, raw_free);
}

CudaOps::~CudaOps() {
  // Teardown must not throw (this runs during stack unwinding after a failure too), so these calls
  // are not CHECKed: a context that is already broken has nothing left to report.
  if (stream_) (void)cudaStreamSynchronize(stream_);
  sdpa_.reset();  // its cuDNN handle uses stream_
  plans_.reset();
  adam_tables_.reset();  // gives its blocks back to the allocator
  alloc_.reset();
  if (workspace_) (void)cudaFree(workspace_);
  if (host_result_) (void)cudaFreeHost(host_result_);
  if (lt_) (void)cublasLtDestroy(lt_);
  if (stream_) (void)cudaStreamDestroy(stream_);
}

std::string CudaOps::name() const {
  cudaDeviceProp prop{};
  MPIGPT_CUDA(cudaGetDeviceProperties(&prop, device_));
  return fmt::format("cuda (device {}: {}, sm_{}{}, {:.1f} GiB)", device_, prop.name, prop.major, prop.minor,
                     double(prop.totalGlobalMem) / double(1ull << 30));
}

void wait_for_stream(cudaStream_t stream, const char* why) {
  const Waiting w([why] {
    return fmt::format("the GPU's work queued before {} (kernels, and collectives on NCCL streams that the "
                       "compute stream waits for)", why);
  });
  MPIGPT_CUDA(cudaStreamSynchronize(stream));
}

void CudaOps::synchronize() { wait_for_stream(stream_, "a synchronisation of the host with the device"); }

// ---- memory ----------------------------------------------------------------------------------

void* CudaOps::allocate_uninitialised(size_t bytes) {
  void* p = alloc_->allocate(bytes);
  if (p) return p;
  // The allocator has already given its cache back and retried; what is left is a real shortage.
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
  const auto s = alloc_->stats();
  fail("out of GPU memory on device {}: requested {} bytes ({}), but only {} bytes ({}) of {} are free; this "
       "process holds {} in {} blocks (peak {}) and {} reserved. Lower training.micro_batch, or set "
       "engine.recompute = selective (or full) to keep fewer activations",
       device_, bytes, human_bytes(bytes), free_b, human_bytes(free_b), human_bytes(total_b), human_bytes(s.in_use),
       s.blocks_in_use, human_bytes(s.peak_in_use), human_bytes(s.reserved));
}

void* CudaOps::allocate(size_t bytes) {
  void* p = allocate_uninitialised(bytes);
  // Queued on the stream like every later use of the block, so no host wait is needed.
  if (bytes) MPIGPT_CUDA(cudaMemsetAsync(p, 0, bytes, stream_));
  return p;
}

void CudaOps::release(void* p) { alloc_->release(p); }

// ---- copies and element-wise ops -------------------------------------------------------------

void CudaOps::copy_impl(Tensor dst, Tensor src) {
  // dst, src: equal numel (shapes may differ). Same dtype: any of host <-> device, device <->
  // device, host <-> host. Different dtypes: f32 <-> bf16 conversion, both on the device
  // (round to nearest even into bf16; exact into f32).
  const int64_t n = dst.numel();
  if (dst.dtype != src.dtype) {
    if (n == 0) return;
    if (dst.dtype == DType::BF16)
      convert_kernel<<<grid_for(n), kThreads, 0, stream_>>>(ptr<bf16>(dst), ptr<float>(src), n);
    else
      convert_kernel<<<grid_for(n), kThreads, 0, stream_>>>(ptr<float>(dst), ptr<bf16>(src), n);
    MPIGPT_CUDA_LAUNCHED();
    return;
  }
  const size_t bytes = dst.nbytes();
  if (bytes == 0 || (dst.ptr == src.ptr && dst.device == src.device)) return;
  const bool dst_host = dst.device == Device::CPU, src_host = src.device == Device::CPU;
  if (dst_host && src_host) {
    std::memmove(dst.ptr, src.ptr, bytes);
    return;
  }
  if (!dst_host && !src_host) {
    MPIGPT_CUDA(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  // Host <-> device: queued on the stream (so it is ordered after the ops that produced or will
  // overwrite the device side, e.g. allocate's zero fill), then waited for: a host destination is
  // readable on return, and a host source may be freed or reused on return even when it is
  // pinned (pageable sources are staged by the driver anyway).
  MPIGPT_CUDA(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, dst_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                              stream_));
  wait_for_stream(stream_, dst_host ? "a copy to the host" : "a copy from the host");
}

void CudaOps::fill_impl(Tensor t, float value) {
  // t (any shape): f32, bf16 (value rounded to nearest even) or i32 (value truncated)
  const int64_t n = t.numel();
  if (n == 0) return;
  if (value == 0.0f && !std::signbit(value)) {  // +0 is all-zero bits in every dtype
    MPIGPT_CUDA(cudaMemsetAsync(t.ptr, 0, t.nbytes(), stream_));
    return;
  }
  if (t.dtype == DType::I32) {
    fill_kernel<<<grid_for(n), kThreads, 0, stream_>>>(ptr<int32_t>(t), n, int32_t(value));
  } else if (t.dtype == DType::BF16) {
    fill_kernel<<<grid_for(n), kThreads, 0, stream_>>>(ptr<bf16>(t), n, __float2bfloat16_rn(value));
  } else {
    fill_kernel<<<grid_for(n), kThreads, 0, stream_>>>(ptr<float>(t), n, value);
  }
  MPIGPT_CUDA_LAUNCHED();
}

void CudaOps::scale_impl(Tensor t, float s) {
  // t (any shape) *= s, f32 or bf16 (computed in f32, rounded once)
  const int64_t n = t.numel();
  if (n == 0 || s == 1.0f) return;
  dispatch_float(t.dtype, "scale", [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<<<grid_for(n), kThreads, 0, stream_>>>(ptr<T>(t), n, s);
  });
  MPIGPT_CUDA_LAUNCHED();
}

void CudaOps::add_impl(Tensor out, Tensor a, Tensor b) {
  // out = a + b, equal numel, one data dtype; out may alias a or b
  const char* op = "add";
  const DType dt = out.dtype;
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    add_kernel<<<grid_for(n), kThreads, 0, stream_>>>(ptr<T>(out), ptr<T>(a), ptr<T>(b), n);
  });
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace mpigpt
