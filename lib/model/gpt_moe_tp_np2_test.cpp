// Mixture of experts under tensor + sequence parallelism on two ranks: each tp rank routes its own
// half of the tokens through replicated experts, and the results equal the single-rank model's.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>

#include "lib/core/rng.h"
#include "lib/model/gpt.h"
#include "lib/model/gpt_testing.h"

using namespace mpigpt;

namespace {

void check_moe_tp(Family fam, float capacity, bool position) {
  CAPTURE(int(fam));
  CAPTURE(capacity);
  CAPTURE(position);
  GptDims d = testing::tiny_gpt_dims(fam);
  d.moe.E = 4;
  d.moe.K = 2;
  d.moe.F = 16;
  d.moe.shared_F = fam == Family::Llama ? 8 : 0;
  d.moe.aux_coeff = 0.1f;
  d.moe.z_coeff = 0.01f;
  d.moe.capacity_factor = capacity;
  d.moe.drop_position = position;
  d.moe.layers = {true, fam == Family::GPT2};
  const int B = 2;
  auto ops = make_cpu_ops();
  Comm comm(MPI_COMM_WORLD);
  REQUIRE(comm.size() == 2);
  GPT full(d, *ops, B);
  full.init_weights(7);
  ModelPlacement pl;
  pl.tp = 2;
  pl.tp_rank = comm.rank();
  TensorParallel tp(&comm, true);
  GPT shard(d, *ops, B, pl, tp, build_param_table(d, pl), -1);
  shard.init_weights(7);

  const auto b = testing::tiny_batch(d, B);
  const float dloss = 1.0f / float(B * d.T - 1);
  full.zero_grads();
  shard.zero_grads();
  full.set_moe_aux_scale(0.5f);
  shard.set_moe_aux_scale(0.5f);
  const double lf = full.forward(b.tokens.data(), b.targets.data(), dloss);
  const double ls = shard.forward(b.tokens.data(), b.targets.data(), dloss);
  CHECK(ls == doctest::Approx(lf).epsilon(1e-6));
  CHECK(full.moe_loss_sum() > 0.0);
  CHECK(shard.moe_loss_sum() == doctest::Approx(full.moe_loss_sum()).epsilon(1e-6));
  full.backward();
  shard.backward();

  int summed = 0;
  for (size_t i = 0; i < shard.params().size(); ++i) {
    const ParamInfo& p = shard.params()[i];
    CAPTURE(p.name);
    REQUIRE(p.name == full.params()[i].name);
    const bool token_local = p.split == TpSplit::None &&
                             (p.name.find("norm.") != std::string::npos || p.name.find(".mlp.router.") != std::string::npos ||
                              p.name.find(".mlp.experts.") != std::string::npos ||
                              p.name.find(".mlp.shared.") != std::string::npos);
    if (token_local) tp.sum_replicated_grad(shard.grad(int(i))), ++summed;
    const float* g = shard.grad(int(i)).f32();
    const float* gf = full.grad(int(i)).f32();
    double err = 0, ref = 0;
    for (int64_t k = 0; k < p.numel(); ++k) {
      const int64_t gk = p.global_index(k);
      err = std::max(err, double(std::abs(g[k] - gf[gk])));
      ref = std::max(ref, double(std::abs(gf[gk])));
    }
    CHECK(ref > 0.0);
    CHECK(err <= 1e-5 * ref + 1e-7);
  }
  CHECK(summed > 0);
}

}  // namespace

// Every gradient after the tp sum of the token-local ones (norms, router, experts).
TEST_CASE("MoE under tp=2 with sequence parallelism reproduces the single-rank loss, aux loss and gradients") {
  for (Family fam : {Family::GPT2, Family::Llama}) check_moe_tp(fam, 0.0f, false);
}

// Capacity is decided over the whole micro-batch, by global token index.
TEST_CASE("MoE capacity under tp=2 SP drops the same assignments as one rank (probs and position)") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    check_moe_tp(fam, 1.0f, false);
    check_moe_tp(fam, 0.5f, true);
  }
}
