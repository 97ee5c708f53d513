// Hugging Face interchange against an independent oracle: testdata/make_hf_tiny.py (numpy only)
// writes tiny HF models with reference logits for our CPU forward to match, and computes the
// logits of the models we export.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "io/formats/hf_format.h"
#include "io/formats/hf_testing.h"
#include "io/io_testing.h"
#include "lib/core/error.h"
#include "lib/kernels/ops.h"
#include "lib/model/gpt.h"
#include "lib/model/params.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// Our CPU forward: logits (T, V) of one sequence.
std::vector<float> our_logits(const TensorMap& ours, const ModelConfig& m, int V, int Vp,
                              const std::vector<int32_t>& tokens) {
  const int T = int(tokens.size());
  const GptDims d = dims_of(m, V, Vp, T);
  auto ops = make_cpu_ops();
  GPT model(d, *ops, 1);
  REQUIRE(model.params().size() == ours.size());
  for (size_t i = 0; i < model.params().size(); ++i) {
    const ParamInfo& p = model.params()[i];
    REQUIRE(ours.count(p.name));
    const HostTensor& t = ours.at(p.name);
    REQUIRE(t.shape == p.global);
    std::memcpy(model.param(int(i)).f32(), t.data.data(), t.data.size() * 4);
  }
  std::vector<int32_t> targets(tokens.begin() + 1, tokens.end());
  targets.push_back(-1);
  model.forward(tokens.data(), targets.data(), 0.0f);
  const float* lg = model.logits().f32();
  std::vector<float> out;
  for (int t = 0; t < T; ++t) out.insert(out.end(), lg + int64_t(t) * Vp, lg + int64_t(t) * Vp + V);
  return out;
}

template <class T>
std::vector<T> read_raw(const std::string& path) {
  const std::string bytes = read_file(path);
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

// /usr/bin/python3 (or $MPIGPT_PYTHON) when it imports numpy, else "".
std::string python_with_numpy() {
  const char* env = std::getenv("MPIGPT_PYTHON");
  for (const char* p : {env, "/usr/bin/python3"})
    if (p && std::system(fmt::format("{} -c 'import numpy' >/dev/null 2>&1", p).c_str()) == 0) return p;
  return "";
}

std::string oracle_script() { return (repo_root() / "io" / "formats" / "testdata" / "make_hf_tiny.py").string(); }

// io/formats/testdata/make_hf_tiny.py (numpy only) writes tiny HF models with reference logits
// and computes the logits of the models we export. Our CPU forward must match it to 1e-4 absolute
// on logits of magnitude ~5 (fp32 against a float64 reference).
constexpr double kLogitTol = 1e-4;

void compare_logits(const std::vector<float>& ours, const std::vector<double>& ref) {
  REQUIRE(ours.size() == ref.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double diff = std::abs(double(ours[i]) - ref[i]);
    worst = std::isfinite(diff) ? std::max(worst, diff) : INFINITY;  // NaN must not slip through max
    scale = std::max(scale, std::abs(ref[i]));
  }
  MESSAGE("max |logit - reference| = " << worst << " (largest logit " << scale << ")");
  CHECK(scale > 1.0);  // the model is not degenerate
  CHECK(worst <= kLogitTol);
}

}  // namespace

TEST_CASE("hf: our forward on imported models matches a numpy forward of the HF model (oracle)") {
  const std::string py = python_with_numpy();
  if (py.empty()) {
    MESSAGE("skipped: no python3 with numpy (set MPIGPT_PYTHON)");
    return;
  }
  struct Case { const char* family; const char* opts; };
  for (const Case c : {Case{"gpt2", ""}, Case{"gpt2", "--hub-style --dtype BF16 --shards 3"}, Case{"llama", ""},
                       Case{"llama", "--dtype F16 --shards 2"}, Case{"mixtral", ""},
                       Case{"mixtral", "--dtype BF16 --shards 3"}}) {
    const std::string what = std::string(c.family) + " " + c.opts;
    CAPTURE(what);
    TempDir tmp;
    const std::string dir = tmp / "model";
    REQUIRE(std::system(fmt::format("{} {} make {} {} {}", py, oracle_script(), c.family, dir, c.opts).c_str()) == 0);
    int V = 0;
    const ModelConfig m = read_hf_config(dir, &V);
    const int Vp = 64;
    const TensorMap ours = load_hf_model(dir, m, V, Vp);
    const std::vector<int32_t> tokens = read_raw<int32_t>(dir + "/tokens.i32");
    compare_logits(our_logits(ours, m, V, Vp, tokens), read_raw<double>(dir + "/logits.f64"));
  }
}

TEST_CASE("hf: a numpy forward of the models we export matches ours (oracle)") {
  const std::string py = python_with_numpy();
  if (py.empty()) {
    MESSAGE("skipped: no python3 with numpy (set MPIGPT_PYTHON)");
    return;
  }
  const int V = 37, Vp = 64;
  const std::vector<int32_t> tokens = {3, 36, 0, 17, 17, 5, 29, 11};
  for (const ModelConfig& m : {tiny_gpt2(), tiny_llama(), tiny_mixtral()}) {
    CAPTURE(m.family);
    CAPTURE(m.num_experts);
    TempDir tmp;
    std::ofstream(tmp / "tokens.i32", std::ios::binary)
        .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 4));
    // A MoE model's random weights are drawn again until the oracle's router margin (the smallest
    // gap between the k-th and (k+1)-th router logit) exceeds 1e-3, so that no top-k choice can
    // be flipped by fp32 rounding (dense models: margin inf at once).
    TensorMap ours;
    double margin = 0;
    for (uint32_t seed = 9; seed < 29 && !(margin > 1e-3); ++seed) {
      ours = random_ours(m, V, Vp, seed);
      save_hf_model(tmp / "model", ours, m, V);
      REQUIRE(std::system(fmt::format("{} {} logits {} {} {} {}", py, oracle_script(), tmp / "model", tmp / "tokens.i32",
                                      tmp / "logits.f64", tmp / "margin.txt").c_str()) == 0);
      margin = std::stod(read_file(tmp / "margin.txt"));
    }
    MESSAGE("router margin " << margin);
    REQUIRE(margin > 1e-3);
    compare_logits(our_logits(ours, m, V, Vp, tokens), read_raw<double>(tmp / "logits.f64"));
  }
}
