// Tests of the log line, the JSONL metrics file and the FLOP count used for MFU.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>
#include <nlohmann/json.hpp>

#include "lib/model/gpt_dims.h"
#include "lib/train/metrics.h"

using namespace mpigpt;

TEST_CASE("log line carries every field") {
  StepMetrics m;
  m.iter = 20;
  m.total_iters = 300;
  m.consumed_samples = 160;
  m.lr = 1e-3;
  m.loss = 2.5;
  m.grad_norm = 0.75;
  m.ms_per_iter = 123.4;
  m.tokens_per_s = 16600;
  m.tflops = 0.05;
  m.mfu = 0.25;
  m.peak_mem_mib = 99;
  m.eta_s = 3725;
  const std::string s = format_step(m);
  for (const char* part : {"iter  20/300", "samples 160", "lr 1.000e-03", "loss 2.5000", "grad norm 0.750",
                           "123.4 ms/iter", "16600 tok/s", "0.050 TFLOP/s", "MFU 25.0%", "mem 99 MiB", "eta 1h02m05s"})
    CHECK_MESSAGE(s.find(part) != std::string::npos, part, " not in: ", s);
  m.mfu = std::nan("");  // no peak to measure against: no MFU at all
  CHECK(format_step(m).find("MFU") == std::string::npos);
  CHECK(format_step(m).find("0.050 TFLOP/s | mem 99 MiB") != std::string::npos);
}

TEST_CASE("metrics file holds one JSON object per line") {
  const auto path = std::filesystem::temp_directory_path() / "mpigpt_metrics_test" / "m.jsonl";
  {
    MetricsWriter w(path.string());
    w.start(0);
    StepMetrics m;
    m.iter = 1;
    m.loss = 3.0;
    m.mfu = 0.5;
    w.step(m);
    w.eval(1, 2.5);
    m.mfu = std::nan("");
    w.step(m);
  }
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  CHECK(nlohmann::json::parse(line)["loss"] == 3.0);
  CHECK(nlohmann::json::parse(line)["mfu"] == 0.5);
  std::getline(in, line);
  CHECK(nlohmann::json::parse(line)["val_loss"] == 2.5);
  std::getline(in, line);
  CHECK_FALSE(nlohmann::json::parse(line).contains("mfu"));  // left out, not null
  std::filesystem::remove_all(path.parent_path());
}

TEST_CASE("a resumed run keeps the metrics up to its iteration; the file is never written through a link") {
  const auto dir = std::filesystem::temp_directory_path() / "mpigpt_metrics_resume_test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "m.jsonl").string();
  std::ofstream(path) << "{\"iter\":1,\"loss\":5}\n{\"iter\":2,\"loss\":4}\n{\"iter\":2,\"val_loss\":4.5}\n"
                      << "{\"iter\":3,\"loss\":3}\n{\"iter\":4,\"lo";  // the last line cut short by a kill
  auto lines = [&] {
    std::vector<std::string> out;
    std::ifstream in(path);
    for (std::string l; std::getline(in, l);) out.push_back(l);
    return out;
  };
  {
    MetricsWriter w(path);
    CHECK(lines().size() == 5);  // untouched until the run starts
    w.start(2);
    StepMetrics m;
    m.iter = 3;
    w.step(m);
  }
  const std::vector<std::string> kept = lines();
  REQUIRE(kept.size() == 4);
  CHECK(kept[2] == "{\"iter\":2,\"val_loss\":4.5}");
  CHECK(nlohmann::json::parse(kept[3])["iter"] == 3);
  {
    MetricsWriter w(path);
    w.start(0);  // from the start: replaced
  }
  CHECK(lines().empty());

  // A link planted at the path (or at its temporary name) is replaced, never written through.
  std::ofstream(dir / "victim") << "keep\n";
  std::filesystem::remove(path);
  std::filesystem::create_symlink(dir / "victim", path);
  std::filesystem::create_symlink(dir / "victim", path + ".tmp");
  {
    MetricsWriter w(path);
    w.start(0);
    w.eval(1, 2.0);
  }
  CHECK_FALSE(std::filesystem::is_symlink(path));
  std::ifstream victim(dir / "victim");
  std::string v;
  std::getline(victim, v);
  CHECK(v == "keep");
  std::filesystem::remove_all(dir);
}

TEST_CASE("MoE runs report the aux loss and expert load in the log line and the metrics file; dense runs do not") {
  StepMetrics m;
  m.iter = 3;
  m.total_iters = 10;
  m.loss = 2.5;
  CHECK(format_step(m).find("aux") == std::string::npos);
  m.has_aux = true;
  m.aux_loss = 0.0123;
  m.expert_load = 1.375;
  CHECK(format_step(m).find("| loss 2.5000 | aux 0.0123 | load 1.38 | grad norm") != std::string::npos);
  const auto path = std::filesystem::temp_directory_path() / "mpigpt_metrics_aux_test" / "m.jsonl";
  {
    MetricsWriter w(path.string());
    w.start(0);
    w.step(m);
    m.has_aux = false;
    w.step(m);
  }
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  CHECK(nlohmann::json::parse(line)["aux_loss"] == 0.0123);
  CHECK(nlohmann::json::parse(line)["expert_load_imbalance"] == 1.375);
  std::getline(in, line);
  CHECK_FALSE(nlohmann::json::parse(line).contains("aux_loss"));
  std::filesystem::remove_all(path.parent_path());
}

TEST_CASE("MoE FLOPs count the router, K experts per token and the shared expert") {
  GptDims d;
  d.L = 2;
  d.C = 64;
  d.NH = 4;
  d.NKV = 4;
  d.F = 256;
  d.T = 32;
  d.Vp = 256;
  const double dense = d.train_flops_per_token();
  d.moe.E = 4;
  d.moe.K = 2;
  d.moe.F = 256;
  d.moe.layers = {false, true};
  // One layer's MLP (2*2*C*F forward, times 3) doubled by K = 2, plus the router 2*C*E.
  CHECK(d.train_flops_per_token() == doctest::Approx(dense + 3.0 * (4.0 * 64 * 256 + 2.0 * 64 * 4)));
}

TEST_CASE("model FLOPs per token follow Megatron's count for the GPT-2 124M shape") {
  GptDims d;
  d.L = 12;
  d.C = 768;
  d.NH = 12;
  d.NKV = 12;
  d.F = 3072;
  d.T = 1024;
  d.Vp = 50304;
  // 6 * (12 * 12 C^2 per layer... ) written out: per layer 24 C^2 + 2 T C (causal), logits 2 C Vp.
  const double fwd = 12 * (24.0 * 768 * 768 + 2.0 * 1024 * 768) + 2.0 * 768 * 50304;
  CHECK(d.train_flops_per_token() == doctest::Approx(3 * fwd));
}
