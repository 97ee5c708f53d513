// What the GPU tests of the causal attention share (cuda_attention_test.cpp for the builtin
// kernels, cudnn_sdpa_test.cpp for cuDNN's): geometries, the log-sum-exp reference, the bf16 and
// f32 tolerances, and the comparison of a GPU forward and backward with the CPU backend's.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

namespace mpigpt::testing {

struct Geometry {
  int64_t B, T;
  int NH, NKV, HD;
  int64_t R() const { return int64_t(NH + 2 * NKV) * HD; }
  int64_t C() const { return int64_t(NH) * HD; }
};

// log sum_{j <= i} exp(q_i.k_j / sqrt(HD)) in double: the CUDA forward's saved state (B,NH,T).
inline std::vector<double> reference_lse(const std::vector<float>& qkv, const Geometry& g) {
  const int64_t R = g.R(), G = g.NH / g.NKV;
  std::vector<double> lse;
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < g.NH; ++h)
      for (int64_t i = 0; i < g.T; ++i) {
        std::vector<double> s;
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t c = 0; c < g.HD; ++c)
            d += double(qkv[size_t((b * g.T + i) * R + h * g.HD + c)]) *
                 double(qkv[size_t((b * g.T + j) * R + (g.NH + h / G) * g.HD + c)]);
          s.push_back(d / std::sqrt(double(g.HD)));
          mx = std::max(mx, s.back());
        }
        for (double v : s) sum += std::exp(v - mx);
        lse.push_back(mx + std::log(sum));
      }
  return lse;
}

// Tolerances, GPU against the CPU backend fed the same (for bf16: bf16-rounded) inputs.
//  f32: both compute in fp32 with different summation orders, tile-wise online rescaling and
//  exp2f (2 ulp); expected differences ~1e-6 relative on O(1..10) values. 1e-4 abs + rel is ~100x
//  that and still ~1000x below what a mask, GQA-head or tile-boundary error produces (O(0.1)).
//  bf16: the GPU stores out and dqkv rounded to bf16 (relative 2^-9 ~ 2e-3), and its backward
//  takes D = rowsum(dout * out) from that rounded out while the CPU keeps exact probabilities;
//  2e-2 abs + rel (1e-2 for out, which is only rounded once) is ~5-10x those errors. lse is f32
//  in both dtypes and computed from identical inputs: 1e-4 abs + 1e-5 rel.
struct Tolerance {
  double out, grad;
};
inline Tolerance tolerance(DType dt) { return dt == DType::F32 ? Tolerance{1e-4, 1e-4} : Tolerance{1e-2, 2e-2}; }

// The GPU's forward and backward of random inputs against the CPU backend's. between_passes runs
// after the forward (a test may switch the GPU's attention backend there); a second backward must
// give bitwise the same gradient.
inline void compare(const Geometry& g, DType dt, Ops& gpu, Ops& cpu, const std::function<void()>& between_passes = {}) {
  const Shape sqkv{g.B, g.T, g.R()}, sout{g.B, g.T, g.C()};
  auto qkv = random_normal(size_t(g.B * g.T * g.R()), 301, uint64_t(g.T * 1000 + g.HD));
  auto dout = random_normal(size_t(g.B * g.T * g.C()), 302, uint64_t(g.T * 1000 + g.HD));
  if (dt == DType::BF16) {  // the CPU reference sees exactly the GPU's inputs
    qkv = rounded_bf16(qkv);
    dout = rounded_bf16(dout);
  }
  // CPU reference: forward (saving probabilities) and backward.
  std::vector<float> out_cpu(size_t(g.B * g.T * g.C())), dqkv_cpu(qkv.size());
  std::vector<float> saved_cpu(size_t(cpu.attention_saved_numel(g.B, g.T, g.NH)));
  cpu.attention_forward(as_tensor(out_cpu, sout), as_tensor(saved_cpu, {int64_t(saved_cpu.size())}),
                        as_tensor(qkv, sqkv), g.NH, g.NKV, g.HD);
  cpu.attention_backward(as_tensor(dqkv_cpu, sqkv), as_tensor(dout, sout), as_tensor(qkv, sqkv),
                         as_tensor(out_cpu, sout), as_tensor(saved_cpu, {int64_t(saved_cpu.size())}), g.NH, g.NKV,
                         g.HD);

  // GPU: NaN-filled outputs, so every element must be written (the backward overwrites dqkv).
  const int64_t nsaved = gpu.attention_saved_numel(g.B, g.T, g.NH);
  CHECK(nsaved == g.B * g.NH * g.T);
  auto d_qkv = to_device(gpu, qkv, sqkv, dt);
  auto d_dout = to_device(gpu, dout, sout, dt);
  auto d_out = to_device(gpu, std::vector<float>(out_cpu.size(), std::numeric_limits<float>::quiet_NaN()), sout, dt);
  auto d_saved = to_device(gpu, std::vector<float>(size_t(nsaved), std::numeric_limits<float>::quiet_NaN()), {nsaved});
  auto d_dqkv = to_device(gpu, std::vector<float>(qkv.size(), std::numeric_limits<float>::quiet_NaN()), sqkv, dt);
  gpu.attention_forward(d_out.t, d_saved.t, d_qkv.t, g.NH, g.NKV, g.HD);
  if (between_passes) between_passes();
  gpu.attention_backward(d_dqkv.t, d_dout.t, d_qkv.t, d_out.t, d_saved.t, g.NH, g.NKV, g.HD);
  const Tolerance tol = tolerance(dt);

  auto r = allclose(to_host(gpu, d_out.t), out_cpu, tol.out, tol.out);
  CHECK_MESSAGE(r.ok, "out: ", r.str());
  r = allclose(to_host(gpu, d_saved.t), reference_lse(qkv, g), 1e-4, 1e-5);
  CHECK_MESSAGE(r.ok, "lse: ", r.str());
  const auto dqkv = to_host(gpu, d_dqkv.t);
  r = allclose(dqkv, dqkv_cpu, tol.grad, tol.grad);
  CHECK_MESSAGE(r.ok, "dqkv: ", r.str());

  // Every backward is deterministic (the builtin kernels sum each gradient element in one thread in
  // a fixed order; cuDNN's is asked for its deterministic reductions): a rerun is bitwise equal.
  gpu.attention_backward(d_dqkv.t, d_dout.t, d_qkv.t, d_out.t, d_saved.t, g.NH, g.NKV, g.HD);
  CHECK(to_host(gpu, d_dqkv.t) == dqkv);
}

}  // namespace mpigpt::testing
