// The planner on published training runs (lib/plan/testdata/published_layouts.json, A100-80GB, priced
// with the papers' software: lib/plan/testdata/a100_80g_megatron.json, no overlapped reductions).
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lib/plan/planner.h"
#include "lib/train/trainer.h"

using namespace mpigpt;

namespace {

const std::string kDir = std::string(MPIGPT_TEST_DATA_DIR) + "/..";

nlohmann::json published() {
  std::ifstream in(kDir + "/lib/plan/testdata/published_layouts.json");
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

// Megatron's GPT (learned positions, tied embeddings, 4h MLP) at the papers' vocabulary and sequence.
PlanRequest request(const nlohmann::json& row, const DeviceProfile& a100) {
  const std::vector<std::string> args = {
      "--model.family", "gpt2", "--model.num_layers", std::to_string(row["layers"].get<int>()), "--model.hidden",
      std::to_string(row["hidden"].get<int>()), "--model.num_heads", std::to_string(row["heads"].get<int>()),
      "--model.seq_len", "2048", "--model.vocab_size", "51200", "--model.vocab_multiple", "1",
      "--training.precision", "bf16", "--engine.backend", "cuda"};
  PlanRequest r;
  r.base = parse_config_args(args).config;
  r.gpus = row["gpus"], r.per_node = 8, r.global_batch = row["global_batch"];
  r.base.training.global_batch = r.global_batch;
  r.device = a100;
  r.memory_bytes = a100.memory_bytes;
  r.fix.tp = row["tp"].get<int>(), r.fix.pp = row["pp"].get<int>();
  if (row.contains("vpp")) r.fix.vpp = row["vpp"].get<int>();
  return r;
}

const DimsOf dims = [](const Config& c) { return make_dims(c, c.model.vocab_size); };

// A100-80GB with Megatron-LM's attention of 2021-2022 (scores through memory); see its "source".
DeviceProfile megatron_a100() {
  const DeviceProfile p = load_profile(kDir + "/lib/plan/testdata/a100_80g_megatron.json", "");
  REQUIRE(p.memory_bytes > 0);
  return p;
}

// Table 1's rows: predicted TFLOP/s per GPU (the paper's FLOP count) against the published, printed.
// Returns how many are within 15%.
int table1_within_15_percent() {
  const DeviceProfile a100 = megatron_a100();
  fmt::print("| params (B) | GPUs | tp | pp | planned layout | memory/rank | published TFLOP/s | predicted | error |\n"
             "|---|---|---|---|---|---|---|---|---|\n");
  int within = 0, rows = 0;
  const nlohmann::json table = published();
  for (const auto& row : table["megatron_2104_04473_table1"]["rows"]) {
    PlanRequest r = request(row, a100);
    // 2021's Megatron-LM: no sequence or context parallelism, no distributed optimizer, the gradient
    // all-reduce after the backward.
    r.fix.recompute = "full", r.fix.sp = false, r.fix.distopt = false, r.fix.overlap = false, r.fix.cp = 1;
    const PlanResult res = run_plan(r, dims);
    CHECK_MESSAGE(!res.rows.empty(), "no layout of row ", row.dump(), " fits");
    if (res.rows.empty()) continue;
    const PlanRow& best = res.rows.front();
    CHECK(best.cfg.parallel.tp == *r.fix.tp);
    CHECK(best.cfg.parallel.pp == *r.fix.pp);
    // The paper's count: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration.
    const double B = r.global_batch, s = 2048, l = row["layers"], h = row["hidden"], V = 51200;
    const double F = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
    const double tflops = F / best.step / r.gpus / 1e12, paper = row["tflops_per_gpu"];
    const double err = tflops / paper - 1;
    within += std::fabs(err) <= 0.15, ++rows;
    fmt::print("| {} | {} | {} | {} | {} | {:.1f} GiB | {} | {:.0f} | {:+.0f}% |\n", row["params_b"].get<double>(),
               r.gpus, *r.fix.tp, *r.fix.pp, layout_name(best.cfg, r.gpus), best.memory / 1073741824.0, paper,
               tflops, 100 * err);
  }
  fmt::print("{} of {} rows within 15% (issue 46 asks 8 of 10)\n\n", within, rows);
  CHECK(rows == 10);
  return within;
}

}  // namespace

TEST_CASE("planner: Megatron-LM's Table 1 (arXiv 2104.04473), published layouts, full recompute: 8 of 10 within 15%") {
  CHECK(table1_within_15_percent() >= 8);
}

// The same rows with tp, pp, vpp and the micro-batch free (the paper's software and full recompute
// kept): where the paper's (tp, pp) ranks among the planner's layouts, and how much faster the
// planner's first choice is predicted. docs/planner.md discusses the rows where it is not in the top 5.
TEST_CASE("planner: Table 1 with the layout free: the published tp and pp rank near the top") {
  const DeviceProfile a100 = megatron_a100();
  fmt::print("| params (B) | GPUs | published tp, pp | its rank | planner's first | predicted gain |\n"
             "|---|---|---|---|---|---|\n");
  int top5 = 0;
  const nlohmann::json table = published();
  for (const auto& row : table["megatron_2104_04473_table1"]["rows"]) {
    PlanRequest r = request(row, a100);
    r.fix.tp.reset(), r.fix.pp.reset(), r.fix.vpp.reset();  // the layout free
    r.fix.recompute = "full", r.fix.sp = false, r.fix.distopt = false, r.fix.overlap = false, r.fix.cp = 1;
    const PlanResult res = run_plan(r, dims);
    REQUIRE(!res.rows.empty());
    size_t rank = 0;
    while (rank < res.rows.size() && (res.rows[rank].cfg.parallel.tp != row["tp"].get<int>() ||
                                      res.rows[rank].cfg.parallel.pp != row["pp"].get<int>()))
      ++rank;
    REQUIRE(rank < res.rows.size());  // the published layout fits and is priced
    const double gain = res.rows[rank].step / res.rows.front().step - 1;
    top5 += rank < 5;
    fmt::print("| {} | {} | tp{} pp{} | {} | {} | {:.1f}% |\n", row["params_b"].get<double>(), r.gpus,
               row["tp"].get<int>(), row["pp"].get<int>(), rank + 1, layout_name(res.rows.front().cfg, r.gpus),
               100 * gain);
    // The paper's choice is predicted slower by less than the model's own error on these rows (15%):
    // the planner does not claim a win it cannot back.
    CHECK(gain < 0.15);
  }
  fmt::print("{} of 10 published layouts in the top 5\n\n", top5);
}

TEST_CASE("planner: Table 5 of arXiv 2205.05198, sequence parallelism with selective recompute") {
  const DeviceProfile a100 = megatron_a100();
  fmt::print("| model | GPUs | tp | pp | vpp | planned layout | memory/rank | published s/iter | predicted | error |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n");
  int rows = 0;
  const nlohmann::json table = published();
  for (const auto& row : table["korthikanti_2205_05198_table5"]["rows"]) {
    PlanRequest r = request(row, a100);
    r.fix.recompute = "selective", r.fix.sp = true;
    PlanResult res = run_plan(r, dims);
    // Where mpigpt's memory model does not fit a row in 80 GB (reported, not asserted), it is
    // priced on an unbounded device to compare the time.
    const bool fits = !res.rows.empty();
    if (!fits) r.memory_bytes = 1e15, res = run_plan(r, dims);
    REQUIRE(!res.rows.empty());
    const PlanRow& best = res.rows.front();
    const double paper = row["seconds_per_iter"];
    fmt::print("| {} | {} | {} | {} | {} | {} | {:.1f} GiB{} | {} | {:.2f} | {:+.0f}% |\n", row["model"].get<std::string>(),
               r.gpus, *r.fix.tp, *r.fix.pp, r.fix.vpp ? std::to_string(*r.fix.vpp) : "free",
               layout_name(best.cfg, r.gpus), best.memory / 1073741824.0, fits ? "" : " (does not fit)", paper, best.step,
               100 * (best.step / paper - 1));
    CHECK(std::fabs(best.step / paper - 1) <= 0.15);
    ++rows;
  }
  fmt::print("\n");
  CHECK(rows == 4);
}
