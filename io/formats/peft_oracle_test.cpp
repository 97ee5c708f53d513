// The PEFT adapters we export against an independent oracle: the HF base weights plus the adapter
// files read back, merged in double by PEFT's rule, run by testdata/make_hf_tiny.py (numpy), give
// the logits of our CPU forward of the adapted model.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "io/formats/hf_format.h"
#include "io/formats/hf_testing.h"
#include "io/formats/peft_format.h"
#include "io/formats/safetensors.h"
#include "io/io_testing.h"
#include "lib/model/params.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// PEFT's merge: W += (lora_alpha / r) B A, transposed for fan_in_fan_out (GPT-2's Conv1D), in double.
TensorMap merge_peft(TensorMap hf, const std::string& dir) {
  std::ifstream in(dir + "/" + kPeftConfigFile);
  const nlohmann::json cfg = nlohmann::json::parse(in);
  const double scale = cfg.at("lora_alpha").get<double>() / cfg.at("r").get<double>();
  const bool fan_in_fan_out = cfg.at("fan_in_fan_out").get<bool>();
  const TensorMap ad = read_safetensors(dir + "/" + kPeftWeightsFile);
  for (const auto& [key, A] : ad) {
    if (!key.ends_with(".lora_A.weight")) continue;
    const std::string module = key.substr(17, key.size() - 17 - 14);  // strip base_model.model. and .lora_A.weight
    const HostTensor& B = ad.at("base_model.model." + module + ".lora_B.weight");
    HostTensor& W = hf.at(module + ".weight");
    const int64_t r = A.shape[0], n_in = A.shape[1], n_out = B.shape[0];
    for (int64_t o = 0; o < n_out; ++o)
      for (int64_t i = 0; i < n_in; ++i) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k) acc += double(B.data[size_t(o * r + k)]) * double(A.data[size_t(k * n_in + i)]);
        float& w = W.data[size_t(fan_in_fan_out ? i * n_out + o : o * n_in + i)];
        w = float(double(w) + scale * acc);
      }
  }
  return hf;
}

}  // namespace

TEST_CASE("peft: a numpy forward of the HF base with our exported PEFT adapter merged gives our logits (oracle)") {
  const std::string py = python_with_numpy();
  if (py.empty()) {
    MESSAGE("skipped: no python3 with numpy (set MPIGPT_PYTHON)");
    return;
  }
  const int V = 37, Vp = 64;
  const std::vector<int32_t> tokens = {3, 36, 0, 17, 17, 5, 29, 11};
  for (const ModelConfig& m : {tiny_gpt2(), tiny_llama()}) {
    CAPTURE(m.family);
    TempDir tmp;
    const TensorMap ours = random_ours(m, V, Vp, 11);
    LoraConfig l;
    l.rank = 4;
    l.alpha = 8;
    // Adapters as after training: both factors random (a fresh B is zero and would test nothing).
    TensorMap lora;
    {
      GptDims d = dims_of(m, V, Vp, 8);
      d.lora.rank = 4;
      std::mt19937 gen(5);
      std::normal_distribution<float> n(0.f, 0.2f);
      for (const ParamInfo& p : build_param_table(d))
        if (is_lora_param(p.name)) {
          HostTensor t{p.global, std::vector<float>(size_t(p.global.numel()))};
          for (float& x : t.data) x = n(gen);
          lora[p.name] = std::move(t);
        }
    }
    save_peft_adapter(tmp / "peft", lora, m, l, "");
    std::filesystem::create_directories(tmp / "merged");
    save_hf_model(tmp / "merged", ours, m, V);  // config.json; its weights replaced by the merge below
    write_safetensors(tmp / "merged/model.safetensors",
                      merge_peft(load_safetensors_model(tmp / "merged"), tmp / "peft"));
    std::ofstream(tmp / "tokens.i32", std::ios::binary)
        .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 4));
    REQUIRE(std::system(fmt::format("{} {} logits {} {} {}", py, oracle_script(), tmp / "merged",
                                    tmp / "tokens.i32", tmp / "logits.f64").c_str()) == 0);
    // Our CPU forward of the adapted model: the base and the adapters (rank 4, alpha 8, every target).
    GptDims d = dims_of(m, V, Vp, int(tokens.size()));
    d.lora.rank = 4;
    d.lora.alpha = 8;
    TensorMap params = ours;
    params.insert(lora.begin(), lora.end());
    const LogitError e = logit_error(our_logits(params, d, tokens), read_raw<double>(tmp / "logits.f64"));
    CHECK(e.worst <= 1e-5 * e.scale);  // 1e-5 relative to the logits' magnitude, fp32 against float64
  }
}
