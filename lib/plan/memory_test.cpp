// The memory model against what mpigpt measured (make bench-parallel's CPU layouts, the GPU peaks
// of docs/performance.md), and unit checks of its terms: sharding, recomputation, 1F1B in flight.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "lib/plan/memory.h"
#include "lib/train/trainer.h"

using namespace mpigpt;

namespace {

constexpr double MiB = 1048576.0, GiB = 1073741824.0;

Config config(const std::string& ini, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"--config", std::string(MPIGPT_TEST_DATA_DIR) + "/" + ini};
  args.insert(args.end(), extra.begin(), extra.end());
  return parse_config_args(args).config;
}

MemoryEstimate estimate(const Config& cfg, int world) {
  if (cfg.engine.backend == "cpu") cfg.validate(world);  // a CPU build cannot validate CUDA settings
  return estimate_memory(cfg, make_dims(cfg, cfg.model.vocab_size), world);
}

// The figures `mpigpt bench` reports: each the maximum over ranks (so over stages here).
struct Reported {
  double state = 0, activations = 0;  // MiB
};
Reported reported(const MemoryEstimate& e) {
  Reported r;
  for (const StageMemory& m : e.stages) {
    r.state = std::max(r.state, m.state() / MiB);
    r.activations = std::max(r.activations, m.activations() / MiB);
  }
  return r;
}

double error(double predicted, double measured) { return std::abs(predicted - measured) / measured; }

// One layout of make bench-parallel and its measured per-rank figures (MiB).
struct Measured {
  int np;
  std::vector<std::string> args;
  double state, activations;
};

}  // namespace

// Measured 2026-11-27 on a 2-core machine (all 16 layouts take about 3 minutes, too long for a live
// test), the layouts of `make bench-parallel`, each run as
//   mpirun -np N -x OMP_NUM_THREADS=1 build/mpigpt bench --config inputs/gpt2_parallel_bench.ini
//     --bench-steps 2 --bench-warmup 1 ARGS
// reading "bench: per rank (max over ranks): ... = STATE MiB" and "bench: activations per rank
// (max over ranks ...): ACTIVATIONS MiB". The CPU backend's figures are the exact buffer sizes.
TEST_CASE("memory model: make bench-parallel's CPU layouts within 10%") {
  const std::vector<Measured> layouts = {
      {1, {}, 293.4, 92.4},
      {2, {}, 293.4, 92.4},
      {2, {"--engine.distributed_optimizer", "true"}, 220.1, 92.4},
      {4, {}, 293.4, 92.4},
      {4, {"--engine.distributed_optimizer", "true"}, 183.4, 92.4},
      {2, {"--parallel.tp", "2"}, 147.3, 50.9},
      {2, {"--parallel.tp", "2", "--parallel.sequence_parallel", "true"}, 147.3, 46.9},
      {2, {"--parallel.pp", "2"}, 245.2, 72.4},
      {4, {"--parallel.pp", "4"}, 221.1, 62.4},
      {4, {"--parallel.pp", "4", "--parallel.vpp", "2"}, 221.1, 83.7},
      {8,
       {"--parallel.tp", "2", "--parallel.pp", "2", "--engine.distributed_optimizer", "true",
        "--engine.overlap_grad_reduce", "true", "--engine.overlap_param_gather", "true"},
       92.4, 38.9},
      {2, {"--parallel.cp", "2"}, 293.4, 42.2},
      {2, {"--parallel.cp", "2", "--parallel.cp_comm_type", "all_gather"}, 293.4, 42.2},
      {4, {"--parallel.cp", "4"}, 293.4, 21.1},
      {4, {"--parallel.cp", "4", "--parallel.cp_comm_type", "all_gather"}, 293.4, 21.1},
      {4, {"--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"}, 147.3, 21.5},
  };
  for (const Measured& l : layouts) {
    const Reported p = reported(estimate(config("gpt2_parallel_bench.ini", l.args), l.np));
    std::string name = std::to_string(l.np);
    for (const auto& a : l.args) name += " " + a;
    INFO(name << ": state " << p.state << " MiB (measured " << l.state << "), activations " << p.activations
              << " MiB (measured " << l.activations << ")");
    MESSAGE(name << ": state " << p.state << " MiB (measured " << l.state << "), activations " << p.activations
                 << " MiB (measured " << l.activations << ")");
    CHECK(error(p.state, l.state) < 0.10);
    CHECK(error(p.activations, l.activations) < 0.10);
    CHECK(error(p.state + p.activations, l.state + l.activations) < 0.10);
  }
}

// docs/performance.md, "CUDA backend on one GPU": bf16, fp32 masters, gradients and AdamW state,
// cuDNN attention, no recompute, one H200. Peaks (the caching allocator's high-water mark, "bench:
// peak GPU memory per rank") 2026-11-27 by
//   RECOMPUTE=none MODELS="gpt2_124m gpt2_1p3b" STEPS=20 WARMUP=5 scripts/gpu_check.sh bundle LOGS bench
// ("bench: peak GPU memory per rank": 28353.5 and 131116.0 MiB)
// Activations ("bench: activations per rank") 2026-11-23 by scripts/bench_gpu.sh with engine.recompute
// none and full (builtin attention, which saves the same log-sum-exp as cuDNN's).
TEST_CASE("memory model: the GPU figures of docs/performance.md within 10%") {
  struct Case {
    const char* ini;
    double peak, activations_none, activations_full;  // GiB
  };
  for (const Case& c : {Case{"gpt2_124m_gpu.ini", 28353.5 / 1024, 25.4, 10.0},
                        Case{"gpt2_1p3b_gpu.ini", 131116.0 / 1024, 105.5, 19.4}}) {
    const MemoryEstimate none = estimate(config(c.ini, {"--training.micro_batch", "64"}), 1);
    const MemoryEstimate full =
        estimate(config(c.ini, {"--training.micro_batch", "64", "--engine.recompute", "full"}), 1);
    const StageMemory& m = none.largest();
    INFO(std::string(c.ini) << ": peak " << m.peak() / GiB << " GiB (measured " << c.peak << "), activations "
               << m.activations() / GiB << " / full " << full.largest().activations() / GiB << " GiB\n"
               << none.report());
    MESSAGE(std::string(c.ini) << ": peak " << m.peak() / GiB << " GiB (measured " << c.peak << "), activations "
                  << m.activations() / GiB << " (" << c.activations_none << "), full recompute "
                  << full.largest().activations() / GiB << " (" << c.activations_full << ")");
    CHECK(error(m.peak() / GiB, c.peak) < 0.10);
    CHECK(error(m.activations() / GiB, c.activations_none) < 0.10);
    CHECK(error(full.largest().activations() / GiB, c.activations_full) < 0.10);
    CHECK(m.required() > m.peak());  // the allocator's headroom comes on top
  }
}

// docs/performance.md, "LoRA against full fine-tuning": the 1B-class Llama at sequence 128,
// micro-batch 1, CPU backend (fp32), measured 2026-11-27 by mpirun -np N build/mpigpt bench
// [--parallel.tp 2 --parallel.sequence_parallel true] [--lora.rank 16 --lora.alpha 32]. Under LoRA
// the frozen base is held but has no gradient, no optimizer state and no bucket.
TEST_CASE("memory model: LoRA's state is the frozen base plus the adapters' (measured, CPU)") {
  struct Case {
    std::vector<std::string> args;
    int np;
    double params, grads, optimizer, activations;  // MiB
  };
  const std::vector<std::string> shape = {"--engine.backend", "cpu", "--training.precision", "fp32",
                                          "--model.seq_len", "128", "--training.micro_batch", "1",
                                          "--training.global_batch", "1"};
  const std::vector<std::string> lora = {"--lora.rank", "16", "--lora.alpha", "32"};
  const std::vector<std::string> tp2 = {"--parallel.tp", "2", "--parallel.sequence_parallel", "true"};
  auto join = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  for (const Case& c : {Case{join(shape, {}), 1, 4714.3, 4714.3, 9428.5, 410.1},
                        Case{join(shape, lora), 1, 4751.3, 37.0, 74.0, 410.7},
                        Case{join(join(shape, tp2), lora), 2, 2379.8, 22.5, 45.0, 208.1}}) {
    const StageMemory m = estimate(config("llama_1b_gpu.ini", c.args), c.np).largest();
    CAPTURE(c.args.size());
    MESSAGE("params " << m.params / MiB << " (" << c.params << "), grads " << m.grads / MiB << " (" << c.grads
                      << "), optimizer " << m.optimizer / MiB << " (" << c.optimizer << "), activations "
                      << m.activations() / MiB << " (" << c.activations << ") MiB");
    CHECK(m.params / MiB == doctest::Approx(c.params).epsilon(1e-3));
    CHECK(m.grads / MiB == doctest::Approx(c.grads).epsilon(1e-2));
    CHECK(m.optimizer / MiB == doctest::Approx(c.optimizer).epsilon(1e-2));
    CHECK(error(m.activations() / MiB, c.activations) < 0.10);
  }
}

TEST_CASE("memory model: the distributed optimizer divides the optimizer state by dp") {
  const MemoryEstimate plain = estimate(config("gpt2_parallel_bench.ini"), 4);
  const MemoryEstimate dist = estimate(config("gpt2_parallel_bench.ini", {"--engine.distributed_optimizer", "true"}), 4);
  const StageMemory &p = plain.stages.at(0), &d = dist.stages.at(0);
  CHECK(d.params == p.params);
  CHECK(d.grads == p.grads);
  CHECK(double(d.optimizer) * 4 == doctest::Approx(double(p.optimizer)).epsilon(1e-3));
  CHECK(p.optimizer == 2 * p.params);  // without it: both moments of every parameter (no padding here)
}

TEST_CASE("memory model: full recompute keeps only the layer inputs, selective drops the attention state") {
  const Config none = config("gpt2_parallel_bench.ini");
  const Config full = config("gpt2_parallel_bench.ini", {"--engine.recompute", "full"});
  const Config sel = config("gpt2_parallel_bench.ini", {"--engine.recompute", "selective"});
  const StageMemory n = estimate(none, 1).stages.at(0), f = estimate(full, 1).stages.at(0),
                    s = estimate(sel, 1).stages.at(0);
  const GptDims d = make_dims(none, none.model.vocab_size);
  const int64_t B = none.training.micro_batch, T = d.T, C = d.C, L = d.L;
  CHECK(f.layer_activations == 0);
  CHECK(f.layer_inputs == (L + 1) * B * T * C * 4);  // one micro-batch in flight on one rank
  CHECK(f.layer_inputs == n.layer_inputs);
  CHECK(f.recompute_scratch == layer_activations(d, full, true, true).total() + B * T * C * 4);
  CHECK(n.layer_activations == L * layer_activations(d, none, true, true).total());
  // CPU attention saves the probabilities, B * NH * T * T floats: selective keeps one for all layers.
  const int64_t probs = B * d.NH * T * T * 4;
  CHECK(layer_activations(d, none, true, true).attention_state == probs);
  CHECK(n.activations() - s.activations() == (L - 1) * probs);
}

TEST_CASE("memory model: tensor and sequence parallelism shard the layer's activations") {
  const Config one = config("gpt2_parallel_bench.ini");
  const Config tp = config("gpt2_parallel_bench.ini", {"--parallel.tp", "2"});
  const Config sp = config("gpt2_parallel_bench.ini", {"--parallel.tp", "2", "--parallel.sequence_parallel", "true"});
  const GptDims d = make_dims(one, one.model.vocab_size);
  const LayerActivations a = layer_activations(d, one, true, true), b = layer_activations(d, tp, true, true),
                         c = layer_activations(d, sp, true, true);
  CHECK(2 * b.qkv == a.qkv);
  CHECK(2 * b.mlp == a.mlp);
  CHECK(2 * b.attention_state == a.attention_state);
  CHECK(b.residual == a.residual);      // replicated over tp without sequence parallelism
  CHECK(2 * c.residual == a.residual);  // sharded with it
  CHECK(2 * c.norm1 == a.norm1);        // the norm output too: the backward gathers it again
}

TEST_CASE("memory model: 1F1B holds more micro-batches on earlier pipeline stages (from the schedule)") {
  for (int r = 0; r < 4; ++r) CHECK(in_flight_per_pool(4, 1, 8, r, {0}) == std::vector<int>{4 - r});
  CHECK(in_flight_per_pool(1, 1, 8, 0, {0}) == std::vector<int>{1});
  CHECK(in_flight_per_pool(4, 1, 2, 0, {0}) == std::vector<int>{2});  // never more than the step's micro-batches
  // Interleaved, a pool per chunk: rank 0 holds more than the last rank, and more in its first
  // chunk than its second.
  const std::vector<int> first = in_flight_per_pool(4, 2, 8, 0, {0, 1}), last = in_flight_per_pool(4, 2, 8, 3, {0, 1});
  CHECK(first[0] + first[1] > last[0] + last[1]);
  CHECK(first[0] >= first[1]);
  // One pool for both chunks: the chunks' peaks come at different times, and the shared pool holds
  // what the schedule has in flight at once: its warm-up forwards, (pp-1)*2 + (vpp-1)*pp, and one.
  CHECK(in_flight_per_pool(4, 2, 8, 0, {0, 0}) == std::vector<int>{3 * 2 + 4 + 1});
  CHECK(first[0] + first[1] > 3 * 2 + 4 + 1);
  const MemoryEstimate e = estimate(config("gpt2_parallel_bench.ini", {"--parallel.pp", "4"}), 4);
  REQUIRE(e.stages.size() == 4);
  CHECK(e.micro_batches == 8);
  for (int r = 0; r + 1 < 4; ++r) CHECK(e.stages[r].layer_activations > e.stages[r + 1].layer_activations);
  CHECK(e.stages[3].logits > 0);
  CHECK(e.stages[0].logits == 0);
  CHECK(e.stages[0].params > e.stages[1].params);  // the embedding
}
