// Helpers for the GPU tests (CTest label gpu): the CUDA backend or a skip (exit 77), host <-> device
// tensors in either data dtype, and bf16 rounding of host data so that a CPU reference sees exactly
// the GPU's inputs. Header only, plain C++ (the test binary is not compiled by nvcc).
#pragma once
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "lib/kernels/buffer.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/cuda_ops.h"
#include "lib/kernels/cuda/device.h"
#endif

namespace mpigpt::testing {

// The CUDA backend on device 0, or exit 77 (skipped) when this build or machine has no GPU.
inline std::unique_ptr<Ops> cuda_ops_or_skip() {
#ifdef MPIGPT_WITH_CUDA
  if (cuda::device_count() > 0) return make_cuda_ops(0);
  MESSAGE("no CUDA device: skipped");
#else
  MESSAGE("built without the CUDA backend: skipped");
#endif
  std::exit(77);
}

// Two subcases for the matmul tests: the heuristic's algorithm, and autotuning on every product
// (no size floor: each candidate runs on the product's own operands before the real run). Returns
// whether this pass tunes; tuned_products then says how many configurations were timed.
inline bool gemm_tuning_subcases(Ops& gpu) {
  bool tuned = false;
  SUBCASE("the heuristic's algorithm") {}
  SUBCASE("autotuned") {
#ifdef MPIGPT_WITH_CUDA
    dynamic_cast<cuda::CudaOps&>(gpu).set_gemm_autotune(true, 0);
    tuned = true;
#endif
  }
  return tuned;
}
inline size_t tuned_products(Ops& gpu) {
#ifdef MPIGPT_WITH_CUDA
  return dynamic_cast<cuda::CudaOps&>(gpu).gemm_tuned_plans();
#else
  return 0;
#endif
}
// The bf16 unit roundoff (8 significand bits): the unit of the tests' bf16 tolerances.
constexpr double kBf16U = 1.0 / 256;

// Round-to-nearest-even to bfloat16 and back (what __float2bfloat16_rn does), NaN kept.
inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return x;
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
inline std::vector<float> rounded_bf16(std::vector<float> v) {
  for (float& x : v) x = round_bf16(x);
  return v;
}

// Device tensors that own their memory (a Buffer of the backend) and the host round trips.
struct DeviceTensor {
  Buffer buf;
  Tensor t;
};
// host (f32 values) -> a device tensor of dtype dt (F32, BF16: rounded on the device, or I32).
inline DeviceTensor to_device(Ops& ops, const std::vector<float>& host, Shape s, DType dt = DType::F32) {
  MPIGPT_CHECK(size_t(s.numel()) == host.size(), "to_device: shape {} needs {} values, got {}", s.str(), s.numel(),
               host.size());
  DeviceTensor d{Buffer(ops, std::max<size_t>(1, host.size() * dtype_size(dt))), {}};
  d.t = d.buf.tensor(s, dt);
  std::vector<float> tmp(host);
  Tensor src(tmp.data(), s, DType::F32, Device::CPU);
  if (dt == DType::F32) {
    ops.copy(d.t, src);
  } else {
    Buffer stage(ops, std::max<size_t>(1, host.size() * 4));
    Tensor f = stage.tensor(s, DType::F32);
    ops.copy(f, src);
    ops.copy(d.t, f);  // device-side conversion to bf16
    ops.synchronize();
  }
  return d;
}
inline DeviceTensor to_device(Ops& ops, const std::vector<int32_t>& host, Shape s) {
  DeviceTensor d{Buffer(ops, std::max<size_t>(1, host.size() * 4)), {}};
  d.t = d.buf.tensor(s, DType::I32);
  std::vector<int32_t> tmp(host);
  ops.copy(d.t, Tensor(tmp.data(), s, DType::I32, Device::CPU));
  return d;
}
// An all-zero device tensor.
inline DeviceTensor zeros(Ops& ops, Shape s, DType dt = DType::F32) {
  DeviceTensor d{Buffer(ops, std::max<size_t>(1, size_t(s.numel()) * dtype_size(dt))), {}};
  d.t = d.buf.tensor(s, dt);
  return d;
}
// A device tensor of any float dtype -> host f32 values.
inline std::vector<float> to_host(Ops& ops, const Tensor& t) {
  std::vector<float> out(size_t(t.numel()));
  Tensor dst(out.data(), t.shape, DType::F32, Device::CPU);
  if (t.dtype == DType::F32) {
    ops.copy(dst, t);
  } else {
    Buffer stage(ops, std::max<size_t>(1, out.size() * 4));
    Tensor f = stage.tensor(t.shape, DType::F32);
    ops.copy(f, t);
    ops.copy(dst, f);
  }
  return out;
}
inline std::vector<int32_t> to_host_i32(Ops& ops, const Tensor& t) {
  std::vector<int32_t> out(size_t(t.numel()));
  ops.copy(Tensor(out.data(), t.shape, DType::I32, Device::CPU), t);
  return out;
}

}  // namespace mpigpt::testing
