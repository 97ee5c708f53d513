// LoRA in the training engine: only the adapters are trained (the base stays bitwise unchanged),
// and the frozen base holds no gradient and no optimizer state.
#include <doctest/doctest.h>
#include <mpi.h>

#include <vector>

#include "lib/core/rng.h"
#include "lib/train/model_runner.h"
#include "lib/train/trainer.h"

using namespace mpigpt;

namespace {

Config small(int lora_rank) {
  Config cfg;
  cfg.model.family = "llama";
  cfg.model.num_layers = 2;
  cfg.model.hidden = 32;
  cfg.model.num_heads = 4;
  cfg.model.num_kv_heads = 2;
  cfg.model.seq_len = 16;
  cfg.model.vocab_size = 97;
  cfg.training.micro_batch = 2;
  cfg.training.global_batch = 2;
  cfg.lora.rank = lora_rank;
  cfg.lora.targets = "qkv,fc2";
  cfg.resolve_defaults();
  cfg.validate(1);
  return cfg;
}

}  // namespace

TEST_CASE("LoRA trains the adapters only: the base is bitwise unchanged, its gradients and state are absent") {
  const auto ops = make_cpu_ops();
  const Config cfg = small(4), full_cfg = small(0);
  const Mesh mesh(MPI_COMM_SELF, MeshSizes{});
  const GptDims d = make_dims(cfg, 97);
  ModelRunner r(cfg, d, mesh, *ops), full(full_cfg, make_dims(full_cfg, 97), mesh, *ops);

  int64_t base = 0, adapters = 0;
  for (const ParamInfo& p : r.model().params()) (p.frozen ? base : adapters) += p.numel();
  CHECK(base == full.model().num_params());
  CHECK(adapters == d.L * 4 * ((d.C + d.qkv_dim()) + (d.F + d.C)));
  // Gradients and Adam moments for the adapters only; parameters: the base and the adapters.
  const DpMemory m = r.memory(), f = full.memory();
  CHECK(m.grads == adapters * 4);
  CHECK(m.optimizer == adapters * 8);
  CHECK(m.params >= (base + adapters) * 4);
  CHECK(m.params < (base + adapters) * 4 + 4096);
  CHECK(f.grads == f.params);
  CHECK(f.optimizer == base * 8);
  CHECK(r.optimizer().state_numel() == adapters);

  const Tensor p = r.model().params_flat();
  const std::vector<float> before(p.f32(), p.f32() + p.numel());
  std::vector<int32_t> tokens(size_t(2 * d.T)), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t(bits_at(3, 1, i) % 97);
    targets[i] = int32_t(bits_at(3, 2, i) % 97);
  }
  for (int step = 0; step < 3; ++step) {
    r.forward_backward(tokens.data(), targets.data(), nullptr, 1, 1.0f / float(tokens.size()));
    CHECK(r.grad_norm() > 0);
    r.optimizer_step(1e-2f, 1.0f);
  }
  for (const ParamInfo& q : r.model().params()) {
    CAPTURE(q.name);
    int64_t changed = 0;
    for (int64_t k = q.offset; k < q.offset + q.numel(); ++k) changed += p.f32()[k] != before[size_t(k)];
    if (q.frozen)
      CHECK(changed == 0);
    else
      CHECK(changed > q.numel() / 2);
  }
}
