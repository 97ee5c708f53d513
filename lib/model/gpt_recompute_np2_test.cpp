// Activation recomputation on two ranks: the recomputed forwards re-issue the same collectives in
// the same order on both ranks, and loss, MoE losses and gradients are bit-identical to
// recompute = none on the same layout.
#include <doctest/doctest.h>
#include <mpi.h>

#include "lib/model/gpt.h"
#include "lib/model/gpt_recompute_testing.h"
#include "lib/model/gpt_testing.h"
#include "parallel/context_parallel.h"

using namespace mpigpt;
using testing::RecomputeRun;

namespace {

constexpr int B = 2;

struct Layout {
  int tp = 1;  // tp = 2 with sequence parallelism, else cp = 2 (p2p ring)
};

RecomputeRun run(const GptDims& d, Recompute r, const Layout& lay) {
  auto ops = make_cpu_ops();
  Comm comm(MPI_COMM_WORLD);
  REQUIRE(comm.size() == 2);
  ModelPlacement pl;
  pl.tp = lay.tp;
  pl.tp_rank = lay.tp == 2 ? comm.rank() : 0;
  const bool cp = lay.tp == 1;
  const SequenceLayout seq{cp ? &comm : nullptr, CpCommType::P2P, false};
  MoeLayout moe;
  moe.tp_cp = &comm;  // the token group: tp under SP, or cp
  GPT m(d, *ops, B, pl, TensorParallel(cp ? nullptr : &comm, !cp), build_param_table(d, pl), -1, seq, moe);
  m.init_weights(7);
  m.set_moe_aux_scale(0.5f);
  m.set_recompute(r);
  const auto b = testing::tiny_batch(d, B);
  MicroBatchInput in{b.tokens.data(), b.targets.data()};
  const CpMicroBatch s = cp_split(B, d.T, 2, comm.rank(), b.tokens.data(), b.targets.data(), nullptr);
  if (cp) in = {s.tokens.data(), s.targets.data(), s.pos.data(), s.seg.data(), s.index.data()};
  return testing::run_recompute(m, {in}, 1.0f / float(B * d.T));
}

struct Runs {
  RecomputeRun none, sel, full;
};
Runs check_modes(const GptDims& d, const Layout& lay) {
  Runs r{run(d, Recompute::None, lay), run(d, Recompute::Selective, lay), run(d, Recompute::Full, lay)};
  testing::check_bit_identical(r.none, r.sel);
  testing::check_bit_identical(r.none, r.full);
  return r;
}

GptDims dims(Family f, bool moe) {
  GptDims d = testing::tiny_gpt_dims(f);
  d.T = d.maxT = 8;  // cp = 2 splits the sequence into 2 * cp chunks
  if (!moe) return d;
  d.moe.E = 4;
  d.moe.K = 2;
  d.moe.F = 16;
  d.moe.shared_F = f == Family::Llama ? 8 : 0;
  d.moe.aux_coeff = 0.1f;
  d.moe.z_coeff = 0.01f;
  d.moe.layers = {true, f == Family::GPT2};
  return d;
}

}  // namespace

TEST_CASE("recompute under tp=2 + sequence parallelism: bit-identical to none, expected activation savings") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    const GptDims d = dims(fam, false);
    const Runs r = check_modes(d, {2});
    auto ops = make_cpu_ops();
    testing::check_dense_savings(r.none, r.sel, r.full, d, B, d.T, 2, true,
                                 ops->attention_saved_numel(B, d.T, d.NH / 2), 1, d.L);
  }
}

TEST_CASE("recompute of MoE layers under tp=2 + SP: routing over the token group, losses counted once") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    const Runs r = check_modes(dims(fam, true), {2});
    CHECK(r.none.moe_loss > 0.0);
    CHECK(r.full.activation_bytes < r.sel.activation_bytes);
    CHECK(r.sel.activation_bytes < r.none.activation_bytes);
  }
}

TEST_CASE("recompute under cp=2 (ring attention): bit-identical; selective keeps the lse and saves nothing") {
  for (Family fam : {Family::GPT2, Family::Llama})
    for (bool moe : {false, true}) {
      CAPTURE(int(fam));
      CAPTURE(moe);
      const Runs r = check_modes(dims(fam, moe), {1});
      CHECK(r.sel.activation_bytes == r.none.activation_bytes);
      CHECK(r.full.activation_bytes < r.none.activation_bytes);
    }
}
