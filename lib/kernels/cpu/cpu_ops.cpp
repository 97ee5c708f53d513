// CPU backend: the factory, memory, and the element-wise ops (copy, fill, scale, add).
#include "lib/kernels/cpu/cpu_ops.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace mpigpt {

std::unique_ptr<Ops> make_cpu_ops() { return std::make_unique<cpu::CpuOps>(); }

namespace cpu {

std::string CpuOps::name() const {
  return "cpu (fp32, OpenBLAS, " + std::to_string(omp_get_max_threads()) + " OpenMP threads)";
}

// Byte ranges big enough to be worth splitting over the threads (memset/memcpy are memory bound;
// two cores still move more than one).
constexpr size_t kParallelBytes = size_t(1) << 20;

static void parallel_memset0(void* p, size_t bytes) {
  if (bytes < kParallelBytes) {
    std::memset(p, 0, bytes);
    return;
  }
  char* c = static_cast<char*>(p);
  const int64_t chunks = int64_t((bytes + kParallelBytes - 1) / kParallelBytes);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < chunks; ++i) {
    size_t begin = size_t(i) * kParallelBytes;
    std::memset(c + begin, 0, std::min(kParallelBytes, bytes - begin));
  }
}

void* CpuOps::allocate(size_t bytes) {
  // aligned_alloc wants a size that is a multiple of the alignment; a 0-byte request still gets a
  // distinct pointer so that "defined" tensors of no elements stay defined.
  size_t rounded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, rounded);
  MPIGPT_CHECK(p != nullptr, "allocate: out of host memory allocating {} bytes", bytes);
  parallel_memset0(p, rounded);
  return p;
}

void CpuOps::release(void* p) { std::free(p); }

void CpuOps::copy_impl(Tensor dst, Tensor src) {
  const size_t bytes = dst.nbytes();
  char* d = static_cast<char*>(dst.ptr);
  const char* s = static_cast<const char*>(src.ptr);
  if (d == s || bytes == 0) return;
  if (bytes < kParallelBytes) {
    std::memmove(d, s, bytes);
    return;
  }
  const int64_t chunks = int64_t((bytes + kParallelBytes - 1) / kParallelBytes);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < chunks; ++i) {
    size_t begin = size_t(i) * kParallelBytes;
    std::memcpy(d + begin, s + begin, std::min(kParallelBytes, bytes - begin));
  }
}

void CpuOps::fill_impl(Tensor t, float value) {
  const int64_t n = t.numel();
  if (t.dtype == DType::I32) {  // index tensors (targets, positions) are filled too
    int32_t* p = static_cast<int32_t*>(t.ptr);
    const int32_t iv = int32_t(value);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) p[i] = iv;
    return;
  }
  float* p = f32(t);
  if (value == 0.0f) {
    parallel_memset0(p, t.nbytes());
    return;
  }
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}

void CpuOps::scale_impl(Tensor t, float s) {
  float* p = f32(t);
  const int64_t n = t.numel();
  if (s == 1.0f) return;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) p[i] *= s;
}

void CpuOps::add_impl(Tensor out, Tensor a, Tensor b) {
  float* o = f32(out);
  const float* x = f32(a);
  const float* y = f32(b);
  const int64_t n = out.numel();
  // out may alias a or b: element i is read before it is written, so no restrict here.
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

}  // namespace cpu
}  // namespace mpigpt
