// The planner's layout enumeration: counts on a small case, every layout valid and distinct, --fix
// pins respected, rejections counted, uneven pipelines balanced; and run_plan's ranking and advice.
#include <doctest/doctest.h>

#include <numeric>
#include <set>

#include "lib/core/error.h"
#include "lib/plan/layouts.h"
#include "lib/plan/planner.h"
#include "lib/train/trainer.h"

using namespace mpigpt;

namespace {

Config tiny(int layers, int global_batch) {
  const std::vector<std::string> args = {"--model.num_layers", std::to_string(layers), "--model.hidden", "32",
                                         "--model.num_heads", "2", "--model.seq_len", "32", "--model.vocab_size",
                                         "257", "--training.global_batch", std::to_string(global_batch)};
  return parse_config_args(args).config;
}

const DimsOf dims = [](const Config& c) { return make_dims(c, c.model.vocab_size); };

}  // namespace

TEST_CASE("layouts: every combination of 2 ranks on a 2-layer model, each valid and distinct") {
  const Config base = tiny(2, 4);
  const Enumeration e = enumerate_layouts(base, 2, 2, 4, {}, dims);
  // By hand: tp1 cp1 pp1 dp2 (mb 1,2; 3 recompute; distopt off/on) 12; tp1 cp1 pp2 (mb 1,2,4; 3) 9;
  // tp1 cp2 (mb 1,2,4; 3) 9; tp2 sp (mb 1,2,4; 3) 9.
  CHECK(e.considered == 39);
  CHECK(e.layouts.size() == 39);
  std::set<std::string> names;
  for (const Config& c : e.layouts) {
    CHECK_NOTHROW(c.validate(2));
    CHECK(c.parallel.tp * c.parallel.cp * c.parallel.pp * c.dp(2) == 2);
    CHECK(c.parallel.sequence_parallel == (c.parallel.tp > 1));
    CHECK(4 % (c.training.micro_batch * c.dp(2)) == 0);
    names.insert(layout_name(c, 2));
  }
  CHECK(names.size() == e.layouts.size());
  CHECK(names.count("tp2 sp cp1 pp1 dp1 mb4 selective"));
  CHECK(names.count("tp1 cp1 pp1 dp2 mb1 full distopt"));
}

TEST_CASE("layouts: --fix pins every field it names") {
  const Config base = tiny(8, 16);
  const LayoutFix fix = parse_layout_fix("tp=2,pp=2,recompute=full,distopt=on");
  const Enumeration e = enumerate_layouts(base, 8, 4, 16, fix, dims);
  REQUIRE(!e.layouts.empty());
  for (const Config& c : e.layouts) {
    CHECK(c.parallel.tp == 2);
    CHECK(c.parallel.pp == 2);
    CHECK(c.engine.recompute == "full");
    CHECK(c.engine.distributed_optimizer);
    CHECK(c.dp(8) > 1);
  }
  // vpp 2 and 4 interleave 8 layers over pp 2; the interleaved ones need micro-batches divisible by pp.
  std::set<int> vpps;
  for (const Config& c : e.layouts) vpps.insert(c.parallel.vpp);
  CHECK(vpps == std::set<int>{1, 2, 4});
  const Enumeration one = enumerate_layouts(base, 8, 4, 16, parse_layout_fix("tp=2,cp=1,pp=2,mb=2,sp=off,recompute=none,distopt=off"), dims);
  REQUIRE(one.layouts.size() == 3);  // vpp 1, 2, 4
  CHECK(!one.layouts[0].parallel.sequence_parallel);
  CHECK(one.layouts[0].training.micro_batch == 2);
  for (const Config& c : one.layouts) CHECK(c.engine.overlap_grad_reduce);  // dp 2: overlapped by default
  for (const Config& c : enumerate_layouts(base, 8, 4, 16, parse_layout_fix("tp=2,pp=2,distopt=on,overlap=off"), dims).layouts)
    CHECK((!c.engine.overlap_grad_reduce && !c.engine.overlap_param_gather));
}

TEST_CASE("layouts: what validation rejects is counted by the field it names") {
  // Global batch 3 on 2 ranks: dp 2 does not divide it.
  const Enumeration e = enumerate_layouts(tiny(2, 3), 2, 2, 3, {}, dims);
  CHECK(e.rejected.at("training.global_batch") == 1);
  CHECK(e.considered == int64_t(e.layouts.size()) + 1);
  // Interleaving with 1 micro-batch per pipeline rank of 2: the interleaved schedule's check.
  const Enumeration v = enumerate_layouts(tiny(4, 2), 2, 2, 2, parse_layout_fix("pp=2,vpp=2"), dims);
  CHECK(v.rejected.size() == 1);
  CHECK(v.layouts.size() == 3);  // micro-batch 1 (2 micro-batches) with 3 recompute modes
}

TEST_CASE("layouts: layers that pp does not divide get a balanced pipeline_layout") {
  const Enumeration e = enumerate_layouts(tiny(5, 4), 2, 2, 4, parse_layout_fix("pp=2"), dims);
  REQUIRE(!e.layouts.empty());
  for (const Config& c : e.layouts) {
    const std::vector<int> layers = pipeline_layers(c.parallel, 5);
    CHECK(layers.size() == 2);
    CHECK(std::accumulate(layers.begin(), layers.end(), 0) == 5);
    CHECK(!c.parallel.pipeline_layout.empty());
  }
}

TEST_CASE("layouts: --fix errors name the option, the key or value and the fields") {
  CHECK_THROWS_WITH_AS(parse_layout_fix("tp=2,tpp=4"), doctest::Contains("'tpp' is not a layout field"), Error);
  CHECK_THROWS_WITH_AS(parse_layout_fix("tp=0"), doctest::Contains("--fix tp=0"), Error);
  CHECK_THROWS_WITH_AS(parse_layout_fix("recompute=some"), doctest::Contains("none, selective or full"), Error);
  CHECK_THROWS_WITH_AS(parse_layout_fix("sp"), doctest::Contains("not key=value"), Error);
}

TEST_CASE("planner: ranks what fits by step time and advises when nothing fits") {
  PlanRequest r;
  r.base = tiny(4, 8);
  r.gpus = 4, r.per_node = 4, r.global_batch = 8;
  DeviceProfile& p = r.device;
  p.name = "toy";
  p.peak_flops = 1e12;
  p.gemm = {{256, 256, 256, 2.0 * 256 * 256 * 256 / 1e12}};
  p.ops = {1e-9, 1e-12, 1e-12, 1e-9, 1e-9, 1e-10};
  p.intra_node = {5e-6, 10e9};
  p.inter_node = {20e-6, 1e9};
  r.memory_bytes = 1e12;
  const PlanResult all = run_plan(r, dims);
  REQUIRE(int64_t(all.rows.size()) + all.dominated == all.valid);
  CHECK(all.dominated > 0);  // with this much memory every layout fits without recompute
  for (const PlanRow& w : all.rows) CHECK(w.cfg.engine.recompute == "none");
  for (size_t i = 1; i < all.rows.size(); ++i) CHECK(all.rows[i - 1].step <= all.rows[i].step);
  CHECK(all.rows.front().mfu > 0);
  // The least memory any layout needs: on a device of 1 byte nothing fits and the planner names it.
  r.memory_bytes = 1;
  const PlanResult tiny_device = run_plan(r, dims);
  CHECK(tiny_device.rows.empty());
  CHECK(tiny_device.rejected.at("memory") == tiny_device.valid);
  REQUIRE(tiny_device.least_memory);
  const int64_t least = tiny_device.least_memory->memory;
  for (const PlanRow& w : all.rows) CHECK(w.memory >= least);
  // A device just that large: exactly the least layout fits (with full recompute and micro-batch 1).
  r.memory_bytes = double(least);
  const PlanResult just = run_plan(r, dims);
  REQUIRE(!just.rows.empty());
  for (const PlanRow& w : just.rows) CHECK(w.memory == least);
  CHECK(just.rows.front().cfg.engine.recompute == "full");
  CHECK(just.rows.front().cfg.training.micro_batch == 1);
  // One byte less: nothing fits, the least-memory layout and more GPUs are named.
  r.memory_bytes = double(least) - 1;
  const PlanResult none = run_plan(r, dims);
  CHECK(none.rows.empty());
  const std::vector<std::string> advice = plan_advice(r, none, dims);
  REQUIRE(advice.size() >= 2);
  CHECK(advice[0].find("needing least memory") != std::string::npos);
  CHECK(advice.back().find("fits on 8 GPUs") != std::string::npos);
}
