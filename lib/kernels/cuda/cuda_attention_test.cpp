// GPU tests of the builtin fused causal attention against the CPU backend: forward output, the saved
// log-sum-exp and the backward, in f32 and bf16, over GQA and plain multi-head shapes, sequence
// lengths that are not multiples of the kernels' 64-row tiles, and every head-dim kernel.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_attention_testing.h"
#include "lib/kernels/cuda/cuda_testing.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/cuda_ops.h"
#endif
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

TEST_CASE("cuda attention forward and backward match the CPU backend (f32 and bf16)") {
  auto ops = cuda_ops_or_skip();
#ifdef MPIGPT_WITH_CUDA
  dynamic_cast<cuda::CudaOps&>(*ops).set_attention(CudaOptions::Attention::Builtin);  // not cuDNN's
#endif
  auto cpu = make_cpu_ops();
  // T = 1; T not a multiple of the 64-row and 32-column tiles; GQA 8/2 and plain 4/4 heads; B > 1;
  // every kernel head dim (16, 32, 64, 80, 96, 128) and padded ones (6: element loads, 48: vector
  // loads into the 64 kernel). In bf16, HD 64 and 128 run the tensor-core forward (GQA 128 included).
  const std::vector<Geometry> shapes = {
      {1, 1, 4, 2, 64},    {2, 37, 8, 2, 64},  {1, 200, 4, 4, 128}, {2, 70, 2, 1, 32}, {1, 130, 4, 2, 80},
      {2, 65, 2, 2, 96},   {2, 33, 4, 1, 16},  {2, 7, 4, 2, 6},     {1, 100, 6, 3, 48},  {1, 150, 4, 2, 128},
  };
  for (DType dt : {DType::F32, DType::BF16})
    for (const Geometry& g : shapes) {
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      CAPTURE(g.B);
      CAPTURE(g.T);
      CAPTURE(g.NH);
      CAPTURE(g.NKV);
      CAPTURE(g.HD);
      compare(g, dt, *ops, *cpu);
    }
}

TEST_CASE("cuda attention rejects unsupported head dims and inconsistent shapes") {
  auto ops = cuda_ops_or_skip();
  const Geometry g{1, 4, 2, 1, 160};
  auto qkv = zeros(*ops, {g.B, g.T, g.R()});
  auto out = zeros(*ops, {g.B, g.T, g.C()});
  auto saved = zeros(*ops, {g.B * g.NH * g.T});
  CHECK_THROWS_WITH_AS(ops->attention_forward(out.t, saved.t, qkv.t, g.NH, g.NKV, g.HD),
                       doctest::Contains("HD = 160"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_forward(out.t, saved.t, qkv.t, g.NH, g.NKV, 80),  // R would differ
                       doctest::Contains("attention_forward"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_forward(out.t, saved.t, qkv.t, 3, 2, g.HD), doctest::Contains("NH"), Error);
  auto small = zeros(*ops, {g.B * g.NH * g.T - 1});
  const Geometry h{1, 4, 2, 1, 64};
  auto qkv2 = zeros(*ops, {h.B, h.T, h.R()});
  auto out2 = zeros(*ops, {h.B, h.T, h.C()});
  CHECK_THROWS_WITH_AS(ops->attention_forward(out2.t, small.t, qkv2.t, h.NH, h.NKV, h.HD), doctest::Contains("saved"),
                       Error);
  auto out_bf16 = zeros(*ops, {h.B, h.T, h.C()}, DType::BF16);  // one data dtype per call
  CHECK_THROWS_AS(ops->attention_forward(out_bf16.t, saved.t, qkv2.t, h.NH, h.NKV, h.HD), Error);
}

