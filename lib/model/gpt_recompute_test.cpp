// Activation recomputation on one rank: with engine.recompute = selective or full, loss, MoE losses
// and statistics and every gradient are bit-identical to none (the CPU backend is deterministic),
// and the activation memory shrinks by what each mode drops.
#include <doctest/doctest.h>

#include <memory>

#include "lib/model/gpt.h"
#include "lib/model/gpt_recompute_testing.h"
#include "lib/model/gpt_testing.h"
#include "parallel/context_parallel.h"

using namespace mpigpt;
using testing::RecomputeRun;

namespace {

constexpr int B = 2;

// M micro-batches of the tiny batch with shifted tokens; packed: documents restart at t = 4
// (positions within documents, the blockwise attention path), split by cp_split for one rank.
struct Batches {
  std::vector<testing::TinyBatch> raw;
  std::vector<std::vector<int32_t>> pos;
  std::vector<CpMicroBatch> split;
  std::vector<MicroBatchInput> in;
};

Batches make_batches(const GptDims& d, int M, bool packed) {
  Batches b;
  for (int m = 0; m < M; ++m) {
    b.raw.push_back(testing::tiny_batch(d, B));
    for (auto& t : b.raw.back().tokens) t = (t + 5 * m) % d.V;
    b.pos.emplace_back();
    for (int i = 0; i < B * d.T; ++i) b.pos.back().push_back(i % d.T < 4 ? i % d.T : i % d.T - 4);
  }
  for (int m = 0; m < M; ++m) {
    if (!packed) {
      b.in.push_back({b.raw[m].tokens.data(), b.raw[m].targets.data()});
      continue;
    }
    b.split.push_back(cp_split(B, d.T, 1, 0, b.raw[m].tokens.data(), b.raw[m].targets.data(), b.pos[m].data()));
  }
  for (const CpMicroBatch& s : b.split)
    b.in.push_back({s.tokens.data(), s.targets.data(), s.pos.data(), s.seg.data(), s.index.data()});
  return b;
}

RecomputeRun run(const GptDims& d, Recompute r, const ModelPlacement& pl, int M, bool packed) {
  auto ops = make_cpu_ops();
  const SequenceLayout seq{nullptr, CpCommType::P2P, packed};
  GPT m(d, *ops, B, pl, TensorParallel(nullptr, false), build_param_table(d, pl), -1, seq);
  m.init_weights(7);
  m.set_moe_aux_scale(0.5f);
  m.set_recompute(r);
  CHECK(m.recompute() == r);
  const Batches b = make_batches(d, M, packed);
  return testing::run_recompute(m, b.in, 1.0f / float(B * d.T));
}

// Every mode against none, bit for bit; the three runs for the caller's size checks.
struct Runs {
  RecomputeRun none, sel, full;
};
Runs check_modes(const GptDims& d, const ModelPlacement& pl = {}, int M = 1, bool packed = false) {
  Runs r{run(d, Recompute::None, pl, M, packed), run(d, Recompute::Selective, pl, M, packed),
         run(d, Recompute::Full, pl, M, packed)};
  testing::check_bit_identical(r.none, r.sel);
  testing::check_bit_identical(r.none, r.full);
  return r;
}

GptDims moe_dims(Family f) {
  GptDims d = testing::tiny_gpt_dims(f);
  d.moe.E = 4;
  d.moe.K = 2;
  d.moe.F = 16;
  d.moe.shared_F = f == Family::Llama ? 8 : 0;
  d.moe.aux_coeff = 0.5f;
  d.moe.z_coeff = 0.05f;
  d.moe.capacity_factor = f == Family::Llama ? 1.0f : 0.0f;  // capacity drops re-decided identically
  d.moe.layers = {f == Family::Llama, true};
  return d;
}

}  // namespace

TEST_CASE("recompute selective/full: loss and gradients bit-identical to none, activations smaller (dense)") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    const GptDims d = testing::tiny_gpt_dims(fam);
    const Runs r = check_modes(d);
    auto ops = make_cpu_ops();
    testing::check_dense_savings(r.none, r.sel, r.full, d, B, d.T, 1, false, ops->attention_saved_numel(B, d.T, d.NH),
                                 1, d.L);
  }
}

TEST_CASE("recompute with two chunks and three micro-batches in flight: saved inputs per micro-batch") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    const GptDims d = testing::tiny_gpt_dims(fam);
    ModelPlacement pl;
    pl.chunks = {{0, 1}, {1, 2}};
    const int M = 3;
    const Runs r = check_modes(d, pl, M);
    auto ops = make_cpu_ops();
    // Three slots in each chunk of one layer: 6 layer activation sets, of which full keeps one.
    testing::check_dense_savings(r.none, r.sel, r.full, d, B, d.T, 1, false, ops->attention_saved_numel(B, d.T, d.NH),
                                 M, d.L);
  }
}

TEST_CASE("recompute of MoE layers: routing, capacity and aux/z losses identical, statistics counted once") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    const Runs r = check_modes(moe_dims(fam), {}, 2);
    CHECK(r.none.moe_loss > 0.0);
    CHECK(r.none.moe_forwards == (fam == Family::Llama ? 4 : 2));  // MoE layers x micro-batches
    CHECK(r.full.activation_bytes < r.sel.activation_bytes);
    CHECK(r.sel.activation_bytes < r.none.activation_bytes);
  }
}

TEST_CASE("recompute with packed sequences (blockwise attention): selective keeps the lse, full still saves") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    const Runs r = check_modes(testing::tiny_gpt_dims(fam), {}, 1, true);
    CHECK(r.sel.activation_bytes == r.none.activation_bytes);  // nothing to drop: only O(T) state per layer
    CHECK(r.full.activation_bytes < r.none.activation_bytes);
  }
}

TEST_CASE("parse_recompute reads the engine.recompute values") {
  CHECK(parse_recompute("none") == Recompute::None);
  CHECK(parse_recompute("selective") == Recompute::Selective);
  CHECK(parse_recompute("full") == Recompute::Full);
}
