// Tensor parallelism on two ranks: a tp shard of the GPT (heads, MLP columns and vocabulary
// split; with and without sequence parallelism) gives the single-rank model's loss, and each
// shard's gradients are exactly its slice of the single-rank gradients.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>

#include "lib/core/rng.h"
#include "lib/model/gpt.h"
#include "lib/model/gpt_testing.h"

using namespace mpigpt;

namespace {

// Norms, biases and LoRA's B start at 1 and 0; perturb them (by global element) so that a bias
// added on every rank instead of once, or a norm gradient not summed, shows.
void perturb(GPT& m) {
  for (size_t i = 0; i < m.params().size(); ++i) {
    const ParamInfo& p = m.params()[i];
    if (p.kind != ParamKind::Norm && p.kind != ParamKind::Bias && !p.name.ends_with("lora_B.weight")) continue;
    float* w = m.param(int(i)).f32();
    for (int64_t k = 0; k < p.numel(); ++k)  // B's structure (an adapter per projection) kept
      if (testing::lora_b_live(m.dims(), p, p.global_index(k)))
        w[k] += 0.2f * normal_at(9, stream_of(p.name), uint64_t(p.global_index(k)));
  }
}

void check_tp(Family fam, bool sp, int lora_rank = 0, unsigned lora_targets = LoraDims{}.targets,
              bool qkv_bias = false) {
  CAPTURE(int(fam));
  CAPTURE(sp);
  CAPTURE(lora_rank);
  CAPTURE(lora_targets);
  CAPTURE(qkv_bias);
  GptDims d = testing::tiny_gpt_dims(fam);
  d.qkv_bias = qkv_bias;
  d.lora.rank = lora_rank;
  d.lora.targets = lora_targets;
  const int B = 2;
  auto ops = make_cpu_ops();
  Comm comm(MPI_COMM_WORLD);
  REQUIRE(comm.size() == 2);
  GPT full(d, *ops, B);
  full.init_weights(7);
  perturb(full);
  ModelPlacement pl;
  pl.tp = 2;
  pl.tp_rank = comm.rank();
  TensorParallel tp(&comm, sp);
  GPT shard(d, *ops, B, pl, tp, build_param_table(d, pl), -1);
  shard.init_weights(7);
  perturb(shard);
  REQUIRE(shard.params().size() == full.params().size());

  const auto b = testing::tiny_batch(d, B);
  const float dloss = 1.0f / float(B * d.T - 1);
  full.zero_grads();
  shard.zero_grads();
  const double lf = full.forward(b.tokens.data(), b.targets.data(), dloss);
  const double ls = shard.forward(b.tokens.data(), b.targets.data(), dloss);
  CHECK(ls == doctest::Approx(lf).epsilon(1e-6));
  full.backward();
  shard.backward();

  for (size_t i = 0; i < shard.params().size(); ++i) {
    const ParamInfo& p = shard.params()[i];
    const ParamInfo& q = full.params()[i];
    CAPTURE(p.name);
    REQUIRE(p.name == q.name);
    REQUIRE(p.global.numel() == q.numel());
    CHECK((p.split == TpSplit::None) == (p.numel() == q.numel()));
    const float* w = shard.param(int(i)).f32();
    if (p.frozen) {  // LoRA's base: its slice of the single-rank weights, no gradient
      CHECK_FALSE(shard.grad(int(i)).defined());
      for (int64_t k = 0; k < p.numel(); ++k) REQUIRE(w[k] == full.param(int(i)).f32()[p.global_index(k)]);
      continue;
    }
    // Replicated norm weights saw only this rank's tokens under sequence parallelism.
    if (sp && p.split == TpSplit::None && p.name.find("norm.") != std::string::npos) tp.sum_replicated_grad(shard.grad(int(i)));
    // LoRA's whole factor of a split layer: each rank's gradient is its part of the sum.
    if (is_lora_param(p.name) && p.split == TpSplit::None) tp.allreduce_sum(shard.grad(int(i)));
    const float* g = shard.grad(int(i)).f32();
    const float* wf = full.param(int(i)).f32();
    const float* gf = full.grad(int(i)).f32();
    double err = 0, ref = 0;
    for (int64_t k = 0; k < p.numel(); ++k) {
      const int64_t gk = p.global_index(k);
      REQUIRE(w[k] == wf[gk]);  // every shard holds exactly its slice of the single-rank init
      err = std::max(err, double(std::abs(g[k] - gf[gk])));
      ref = std::max(ref, double(std::abs(gf[gk])));
    }
    CHECK(err <= 1e-5 * ref + 1e-7);
  }
  // The shards together cover each split tensor once: the squared norms add up.
  for (size_t i = 0; i < shard.params().size(); ++i) {
    const ParamInfo& p = shard.params()[i];
    if (p.split == TpSplit::None) continue;
    double sq = ops->sum_squares(shard.param(int(i)));
    comm.allreduce_sum(&sq, 1);
    CHECK(sq == doctest::Approx(ops->sum_squares(full.param(int(i)))).epsilon(1e-5));
  }
}

}  // namespace

TEST_CASE("tp=2 shards reproduce the single-rank loss and gradient slices (both families, with/without SP)") {
  for (Family fam : {Family::GPT2, Family::Llama})
    for (bool sp : {false, true}) check_tp(fam, sp);
  // Llama with Qwen2's q/k/v biases: each rank's bias holds its heads' rows, as the weight does.
  for (bool sp : {false, true}) check_tp(Family::Llama, sp, 0, LoraDims{}.targets, true);
}

TEST_CASE("tp=2 shards of LoRA adapters (A and B split as their layer) reproduce the single-rank loss and gradients") {
  for (Family fam : {Family::GPT2, Family::Llama})
    for (bool sp : {false, true}) check_tp(fam, sp, 3);
  // An adapter per projection: each rank's q, k, v (gate, up) rows of B in their own blocks.
  check_tp(Family::Llama, true, 3, kLoraQ | kLoraV | kLoraProj | kLoraGate | kLoraUp | kLoraFc2);
  check_tp(Family::Llama, false, 3, kLoraK | kLoraUp);
  check_tp(Family::GPT2, true, 3, kLoraQ | kLoraK | kLoraV | kLoraFc1);
  check_tp(Family::Llama, true, 3, kLoraQ | kLoraV, true);  // the bias frozen with its weight
}
