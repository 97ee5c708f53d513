// The GPT computing in bf16 on the CUDA backend (CTest label gpu): the bf16 copies of the fp32
// master weights that forward and backward read.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "lib/core/rng.h"
#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/model/gpt.h"
#include "lib/model/gpt_testing.h"

using namespace mpigpt;
using testing::round_bf16;
using testing::to_host;

namespace {

// Whether every element of parameter i's compute copy is its fp32 master rounded to bf16.
bool converted(Ops& ops, const GPT& m, int i) {
  const std::vector<float> master = to_host(ops, m.param(i)), copy = to_host(ops, m.compute_param(i));
  for (size_t k = 0; k < master.size(); ++k)
    if (copy[k] != round_bf16(master[k])) return false;
  return true;
}
bool all_zero(Ops& ops, const GPT& m, int i) {
  for (float x : to_host(ops, m.compute_param(i)))
    if (x != 0.0f) return false;
  return true;
}

}  // namespace

// Each chunk's forward converts its own parameters (and the head) from the masters, whatever
// padding a data-parallel buffer plan left between them, leaves other chunks' copies alone until
// their forward, and converts again after params_changed().
TEST_CASE("bf16 compute weights: each chunk's forward converts its parameters, and again after they change") {
  auto ops = testing::cuda_ops_or_skip();
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    GptDims d = testing::tiny_gpt_dims(fam);
    d.act = DType::BF16;
    const int B = 2;
    ModelPlacement pl;
    pl.chunks = {{0, 1}, {1, 2}};  // two chunks on one stage: embedding + layer 0, layer 1 + head
    const TensorParallel tp(nullptr, false);
    // Gaps between the parameters, as a data-parallel bucket plan leaves for alignment.
    std::vector<ParamInfo> table = build_param_table(d, pl);
    int64_t off = 0;
    for (auto& p : table) {
      off += 5;
      p.offset = off;
      off += p.numel();
    }
    GPT m(d, *ops, B, pl, tp, table, off + 3);
    const int n = int(m.params().size());

    // Masters: distinct non-zero values everywhere (gaps too); the compute copies start at zero.
    std::vector<float> host(size_t(m.params_flat().numel()));
    for (size_t k = 0; k < host.size(); ++k) host[k] = 0.5f + float(bits_at(7, 1, k) % 1000) / 1000.0f;
    ops->copy(m.params_flat(), Tensor(host.data(), m.params_flat().shape, DType::F32, Device::CPU));
    m.params_changed();

    const testing::TinyBatch batch = testing::tiny_batch(d, B);
    const auto [first1, end1] = m.chunk_params(1);
    auto forward_both = [&](bool check_between) {
      m.forward_chunk(0, 0, batch.tokens.data(), nullptr, 0.0f);
      if (check_between) {
        for (int i = m.chunk_params(0).first; i < m.chunk_params(0).second; ++i) {
          CAPTURE(m.params()[i].name);
          CHECK(converted(*ops, m, i));
        }
        for (int i = first1; i < end1; ++i) {
          CAPTURE(m.params()[i].name);
          CHECK(all_zero(*ops, m, i));  // not yet: chunk 1's parameters may still be on their way
        }
      }
      ops->copy(m.chunk_input(1, 0), m.chunk_output(0, 0));
      m.forward_chunk(1, 0, nullptr, batch.targets.data(), 0.0f);
      m.release(0, 0);
      m.release(1, 0);
      for (int i = 0; i < n; ++i) {
        CAPTURE(m.params()[i].name);
        CHECK(converted(*ops, m, i));
      }
    };
    forward_both(true);

    // The masters change (an optimizer step): unchanged copies until params_changed().
    ops->scale(m.params_flat(), -0.75f);
    m.forward_chunk(0, 0, batch.tokens.data(), nullptr, 0.0f);
    m.release(0, 0);
    CHECK_FALSE(converted(*ops, m, 1));
    m.params_changed();
    forward_both(false);
  }
}
