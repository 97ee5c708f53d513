// Pipeline pieces of the GPT in one process: the model cut into chunks, driven by hand the way the
// pipeline executor drives them (several micro-batches in flight per chunk), reproduces the whole
// model's loss and gradients.
#include <doctest/doctest.h>

#include <cmath>

#include "lib/model/gpt.h"
#include "lib/model/gpt_testing.h"

using namespace mpigpt;

namespace {

// Max |a - b| over the parameter `name` of two models (same global tensor, both unsharded).
double max_diff(const GPT& a, const GPT& b, const std::string& name, bool grads) {
  int ia = -1, ib = -1;
  for (size_t i = 0; i < a.params().size(); ++i)
    if (a.params()[i].name == name) ia = int(i);
  for (size_t i = 0; i < b.params().size(); ++i)
    if (b.params()[i].name == name) ib = int(i);
  REQUIRE(ia >= 0);
  REQUIRE(ib >= 0);
  Tensor x = grads ? a.grad(ia) : a.param(ia), y = grads ? b.grad(ib) : b.param(ib);
  double m = 0;
  for (int64_t k = 0; k < x.numel(); ++k) m = std::max(m, double(std::abs(x.f32()[k] - y.f32()[k])));
  return m;
}

}  // namespace

TEST_CASE("two stages (first: embedding + layer 0, last: layer 1 + head + tied replica) match the whole model") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    const GptDims d = testing::tiny_gpt_dims(fam);
    const int B = 2, M = 3;  // three micro-batches in flight on both stages
    auto ops = make_cpu_ops();
    GPT full(d, *ops, B);
    full.init_weights(3);
    ModelPlacement p0, p1;
    p0.chunks = {{0, 1}};
    p0.last_stage = false;
    p1.chunks = {{1, 2}};
    p1.first_stage = false;
    const TensorParallel tp(nullptr, false);
    GPT s0(d, *ops, B, p0, tp, build_param_table(d, p0), -1), s1(d, *ops, B, p1, tp, build_param_table(d, p1), -1);
    s0.init_weights(3);
    s1.init_weights(3);
    CHECK(s0.params().size() + s1.params().size() == full.params().size() + (d.tied ? 1 : 0));
    if (d.tied) {
      REQUIRE(s1.params()[0].replica);
      CHECK(max_diff(s1, s0, "embedding.word.weight", false) == 0.0);  // same init by name and index
    }

    std::vector<testing::TinyBatch> mb;
    for (int m = 0; m < M; ++m) {
      mb.push_back(testing::tiny_batch(d, B));
      for (auto& t : mb.back().tokens) t = (t + 5 * m) % d.V;
    }
    const float dloss = 0.01f;
    full.zero_grads();
    s0.zero_grads();
    s1.zero_grads();
    double lf = 0, ls = 0;
    for (int m = 0; m < M; ++m) {
      lf += full.forward(mb[m].tokens.data(), mb[m].targets.data(), dloss);
      full.backward();
    }
    // All forwards first (as in a pipeline's warm-up), then the backwards in order.
    for (int m = 0; m < M; ++m) {
      s0.forward_chunk(0, m, mb[m].tokens.data(), nullptr, dloss);
      ops->copy(s1.chunk_input(0, m), s0.chunk_output(0, m));
      ls += s1.forward_chunk(0, m, nullptr, mb[m].targets.data(), dloss);
    }
    for (int m = 0; m < M; ++m) {
      s1.backward_chunk(0, m);
      ops->copy(s0.chunk_grad(0), s1.chunk_grad(0));
      s0.backward_chunk(0, m);
    }
    CHECK(ls == doctest::Approx(lf).epsilon(1e-6));
    for (const auto& p : full.params()) {
      CAPTURE(p.name);
      const bool in0 = p.name.rfind("embedding", 0) == 0 || p.name.rfind("layers.0.", 0) == 0;
      const GPT& s = in0 ? s0 : s1;
      double g = max_diff(full, s, p.name, true);
      if (d.tied && p.name == "embedding.word.weight") {
        // The whole model's gradient is the sum of the embedding's and the head's share.
        Tensor a = s0.grad(0), r = s1.grad(0), f = full.grad(0);
        g = 0;
        for (int64_t k = 0; k < f.numel(); ++k) g = std::max(g, double(std::abs(a.f32()[k] + r.f32()[k] - f.f32()[k])));
      }
      CHECK(g <= 1e-5);
    }
  }
}

TEST_CASE("two chunks on one rank (interleaved pipeline) match the whole model") {
  const GptDims d = testing::tiny_gpt_dims(Family::GPT2);
  auto ops = make_cpu_ops();
  GPT full(d, *ops, 1);
  full.init_weights(5);
  ModelPlacement pl;
  pl.chunks = {{0, 1}, {1, 2}};
  const TensorParallel tp(nullptr, false);
  GPT m(d, *ops, 1, pl, tp, build_param_table(d, pl), -1);
  m.init_weights(5);
  REQUIRE(m.num_chunks() == 2);
  CHECK(m.has_embedding(0));
  CHECK(!m.has_head(0));
  CHECK(m.has_head(1));
  CHECK(m.chunk_params(0).first == 0);
  CHECK(m.chunk_params(1).second == int(m.params().size()));
  const auto b = testing::tiny_batch(d, 1);
  full.zero_grads();
  m.zero_grads();
  const double lf = full.forward(b.tokens.data(), b.targets.data(), 0.1f);
  full.backward();
  m.forward_chunk(0, 0, b.tokens.data(), nullptr, 0.1f);
  ops->copy(m.chunk_input(1, 0), m.chunk_output(0, 0));
  const double lm = m.forward_chunk(1, 0, nullptr, b.targets.data(), 0.1f);
  CHECK(lm == doctest::Approx(lf).epsilon(1e-6));
  m.backward_chunk(1, 0);
  m.backward_chunk(0, 0);  // the gradient of chunk 1's input is where chunk 0's output gradient goes
  double g = 0;
  for (int64_t k = 0; k < full.num_params(); ++k)
    g = std::max(g, double(std::abs(full.grads_flat().f32()[k] - m.grads_flat().f32()[k])));
  CHECK(g <= 1e-6);
}

TEST_CASE("chunks of one kind share their activation slots: a rank holds what is in flight over all of them") {
  GptDims d = testing::tiny_gpt_dims(Family::Llama);
  d.L = 4;
  auto ops = make_cpu_ops();
  GPT full(d, *ops, 1);
  full.init_weights(7);
  ModelPlacement pl;
  pl.chunks = {{0, 1}, {1, 2}, {2, 3}, {3, 4}};  // chunks 1 and 2 alike: one pool
  const TensorParallel tp(nullptr, false);
  GPT m(d, *ops, 1, pl, tp, build_param_table(d, pl), -1);
  m.init_weights(7);
  std::vector<testing::TinyBatch> b = {testing::tiny_batch(d, 1), testing::tiny_batch(d, 1)};
  for (auto& t : b[1].tokens) t = (t + 3) % d.V;
  // Both micro-batches through chunks 0 and 1, then chunk 1's slots freed, then both into chunk 2
  // (from chunk 0's outputs; only the memory counts here): it takes chunk 1's slots.
  for (int mb = 0; mb < 2; ++mb) m.forward_chunk(0, mb, b[mb].tokens.data(), nullptr, 0.1f);
  for (int mb = 0; mb < 2; ++mb) {
    ops->copy(m.chunk_input(1, mb), m.chunk_output(0, mb));
    m.forward_chunk(1, mb, nullptr, nullptr, 0.1f);
  }
  const size_t held = m.activation_bytes();
  for (int mb = 0; mb < 2; ++mb) m.release(1, mb);
  for (int mb = 0; mb < 2; ++mb) {
    ops->copy(m.chunk_input(2, mb), m.chunk_output(0, mb));
    m.forward_chunk(2, mb, nullptr, nullptr, 0.1f);
  }
  CHECK(m.activation_bytes() == held);
  for (int c : {0, 2})
    for (int mb = 0; mb < 2; ++mb) m.release(c, mb);
  // And a slot moved to another chunk computes that chunk: the loss and gradients of the whole model.
  full.zero_grads();
  m.zero_grads();
  const double lf = full.forward(b[0].tokens.data(), b[0].targets.data(), 0.1f);
  full.backward();
  m.forward_chunk(0, 0, b[0].tokens.data(), nullptr, 0.1f);
  for (int c = 1; c < 3; ++c) {
    ops->copy(m.chunk_input(c, 0), m.chunk_output(c - 1, 0));
    m.forward_chunk(c, 0, nullptr, nullptr, 0.1f);
  }
  ops->copy(m.chunk_input(3, 0), m.chunk_output(2, 0));
  CHECK(m.forward_chunk(3, 0, nullptr, b[0].targets.data(), 0.1f) == doctest::Approx(lf).epsilon(1e-6));
  for (int c = 3; c >= 0; --c) m.backward_chunk(c, 0);
  double g = 0;
  for (int64_t k = 0; k < full.num_params(); ++k)
    g = std::max(g, double(std::abs(full.grads_flat().f32()[k] - m.grads_flat().f32()[k])));
  CHECK(g <= 1e-6);
}
