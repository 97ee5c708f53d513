// Hugging Face interchange against an independent oracle: testdata/make_hf_tiny.py (numpy only)
// writes tiny HF models with reference logits for our CPU forward to match, and computes the
// logits of the models we export.
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>

#include "io/formats/hf_format.h"
#include "io/formats/hf_testing.h"
#include "io/io_testing.h"
#include "lib/core/error.h"
#include "lib/model/params.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// io/formats/testdata/make_hf_tiny.py (numpy only) writes tiny HF models with reference logits
// and computes the logits of the models we export. Our CPU forward must match it to 1e-4 absolute
// on logits of magnitude ~5 (fp32 against a float64 reference).
constexpr double kLogitTol = 1e-4;

void compare_logits(const std::vector<float>& ours, const std::vector<double>& ref) {
  CHECK(logit_error(ours, ref).worst <= kLogitTol);
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
                       Case{"llama", "--dtype F16 --shards 2"}, Case{"mistral", ""}, Case{"qwen2", ""},
                       Case{"qwen2", "--dtype BF16 --shards 2"}, Case{"mixtral", ""},
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
    compare_logits(our_logits(ours, dims_of(m, V, Vp, int(tokens.size())), tokens),
                   read_raw<double>(dir + "/logits.f64"));
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
  for (const ModelConfig& m : {tiny_gpt2(), tiny_llama(), tiny_qwen2(), tiny_mixtral()}) {
    CAPTURE(m.family);
    CAPTURE(m.num_experts);
    CAPTURE(m.qkv_bias);
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
    compare_logits(our_logits(ours, dims_of(m, V, Vp, int(tokens.size())), tokens),
                   read_raw<double>(tmp / "logits.f64"));
  }
}
