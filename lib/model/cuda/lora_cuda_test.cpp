// LoRA on the CUDA backend (CTest label gpu): the adapted GPT gives the CPU backend's loss and
// adapter gradients, in fp32 (dense and MoE) to fp32 rounding and in bf16 within bf16's bounds.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/model/gpt.h"
#include "lib/model/gpt_testing.h"
#include "lib/model/params.h"

using namespace mpigpt;
using testing::to_host;

namespace {

// The same weights (random B) on the CPU and on the GPU, one forward and backward on each: the
// loss within `tol` (relative), every adapter's gradient within tol x its largest CPU element, and
// exactly zero outside B's structure (an adapter per projection).
void check_against_cpu(Family fam, bool moe, DType act, double tol,
                       unsigned targets = kLoraQkv | kLoraProj | kLoraFc1 | kLoraFc2) {
  CAPTURE(int(fam));
  CAPTURE(moe);
  CAPTURE(act == DType::BF16);
  CAPTURE(targets);
  auto gpu = testing::cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const GptDims d = testing::lora_dims(fam, targets, moe);
  GptDims dg = d;
  dg.act = act;
  const int B = 2;
  GPT ref(d, *cpu, B), m(dg, *gpu, B);
  ref.init_weights(7);
  testing::randomize_lora_b(ref);
  REQUIRE(m.params_flat().numel() == ref.params_flat().numel());
  gpu->copy(m.params_flat(), ref.params_flat());
  m.params_changed();

  const testing::TinyBatch b = testing::tiny_batch(d, B);
  const float dloss = 1.0f / float(B * d.T);
  ref.zero_grads();
  m.zero_grads();
  const double want = ref.forward(b.tokens.data(), b.targets.data(), dloss);
  ref.backward();
  const double got = m.forward(b.tokens.data(), b.targets.data(), dloss);
  m.backward();
  CHECK(got == doctest::Approx(want).epsilon(tol));
  int adapters = 0;
  for (size_t i = 0; i < ref.params().size(); ++i) {
    if (!is_lora_param(ref.params()[i].name)) continue;
    CAPTURE(ref.params()[i].name);
    ++adapters;
    const Tensor r = ref.grad(int(i));
    const std::vector<float> g = to_host(*gpu, m.grad(int(i)));
    REQUIRE(int64_t(g.size()) == r.numel());
    double scale = 0, diff = 0;
    int64_t stray = 0;
    for (int64_t k = 0; k < r.numel(); ++k) {
      scale = std::max(scale, double(std::abs(r.f32()[k])));
      diff = std::max(diff, double(std::abs(g[size_t(k)] - r.f32()[k])));
      stray += !testing::lora_b_live(d, ref.params()[i], ref.params()[i].global_index(k)) && g[size_t(k)] != 0;
    }
    CHECK(stray == 0);
    CHECK(scale > 0);
    CHECK(diff <= tol * scale);
  }
  CHECK(adapters > 0);
}

}  // namespace

TEST_CASE("cuda lora: fp32 equals the CPU backend, dense and MoE (both families)") {
  for (Family fam : {Family::GPT2, Family::Llama})
    for (bool moe : {false, true}) check_against_cpu(fam, moe, DType::F32, 1e-4);
  // An adapter per projection (q and v; gate and up of the dense and the routed experts' MLPs).
  for (bool moe : {false, true})
    check_against_cpu(Family::Llama, moe, DType::F32, 1e-4, kLoraQ | kLoraV | kLoraProj | kLoraGate | kLoraUp);
}

// bf16 rounds activations and compute weights to 8 bits of mantissa (~4e-3 relative), and the
// rank-3 adapters' GEMMs run with an inner dimension of 3.
TEST_CASE("cuda lora: bf16 within bf16 bounds of the CPU backend (dense, both families)") {
  for (Family fam : {Family::GPT2, Family::Llama}) check_against_cpu(fam, false, DType::BF16, 5e-2);
}
