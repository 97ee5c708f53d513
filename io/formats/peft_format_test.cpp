// PEFT adapter interchange: ours -> PEFT -> ours bit-identical for GPT-2 and Llama, PEFT's names
// and config fields, a PEFT-trained adapter (an A per projection), and the adapters mpigpt cannot
// represent refused naming the key or field.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>

#include "io/formats/hf_testing.h"
#include "io/formats/peft_format.h"
#include "io/formats/safetensors.h"
#include "io/io_testing.h"
#include "lib/core/error.h"

using namespace mpigpt;
using namespace mpigpt::testing;
using nlohmann::json;

namespace {

LoraConfig lora(int r, double alpha, const std::string& targets) {
  LoraConfig l;
  l.rank = r;
  l.alpha = alpha;
  l.targets = targets;
  return l;
}

// Random adapters of every adapted layer of `m` (B non-zero, as after training; with an adapter
// per projection (q, k, v, gate, up) each projection's rows of B in its own block of columns).
TensorMap random_adapters(const ModelConfig& m, const LoraConfig& l, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> n(0.f, 0.3f);
  const std::set<std::string> want = lora_target_set(l.targets);
  const int64_t C = m.hidden, kv = (m.num_kv_heads > 0 ? m.num_kv_heads : m.num_heads) * (C / m.num_heads);
  const int64_t F = m.ffn_hidden > 0 ? m.ffn_hidden : 4 * C, r = l.rank;
  const bool g = m.family == "gpt2";
  const int64_t E = m.num_experts, Fe = m.moe_ffn_hidden;  // Mixtral: every layer's MLP is E experts
  const char *fc = E ? "mlp.experts.fc" : "mlp.fc", *proj = E ? "mlp.experts.proj" : "mlp.proj";
  const int64_t H = E ? Fe : F;
  struct Layer {
    std::string target, stem;
    int64_t in;
    std::vector<int64_t> rows;
    std::vector<std::string> own;  // the projections' own targets (none: one projection)
  };
  TensorMap out;
  for (int layer = 0; layer < m.num_layers; ++layer)
    for (const Layer& a : {Layer{"qkv", "attn.qkv", C, {C, kv, kv}, {"q", "k", "v"}}, Layer{"proj", "attn.proj", C, {C}, {}},
                           g ? Layer{"fc1", fc, C, {F}, {}} : Layer{"fc1", fc, C, {H, H}, {"gate", "up"}},
                           Layer{"fc2", proj, H, {C}, {}}}) {
      std::vector<int> block(a.rows.size(), want.count(a.target) ? 0 : -1);
      int blocks = want.count(a.target) ? 1 : 0;
      for (size_t i = 0; i < a.own.size() && !want.count(a.target); ++i)
        if (want.count(a.own[i])) block[i] = blocks++;
      if (blocks == 0) continue;
      const int64_t w = blocks * r, o = std::accumulate(a.rows.begin(), a.rows.end(), int64_t(0));
      const std::string p = "layers." + std::to_string(layer) + "." + a.stem;
      const bool expert = a.stem.find("experts") != std::string::npos;
      const Shape sa = expert ? Shape{E, w, a.in} : Shape{w, a.in}, sb = expert ? Shape{E, o, w} : Shape{o, w};
      HostTensor A{sa, std::vector<float>(size_t(sa.numel()))}, B{sb, std::vector<float>(size_t(sb.numel()))};
      for (float& x : A.data) x = n(gen);
      for (int64_t k = 0; k < sb.numel(); ++k) {
        int64_t row = k / w % o, part = 0;
        while (row >= a.rows[size_t(part)]) row -= a.rows[size_t(part++)];
        if (k % w / r == block[size_t(part)]) B.data[size_t(k)] = n(gen);
      }
      out[p + ".lora_A.weight"] = std::move(A);
      out[p + ".lora_B.weight"] = std::move(B);
    }
  return out;
}

bool bitwise_equal(const TensorMap& a, const TensorMap& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || !(it->second.shape == t.shape) || t.data.size() != it->second.data.size() ||
        std::memcmp(t.data.data(), it->second.data.data(), t.data.size() * 4) != 0)
      return false;
  }
  return true;
}

void write_json(const std::string& path, const json& j) { std::ofstream(path) << j.dump(2); }

}  // namespace

TEST_CASE("peft: ours -> PEFT files -> ours is bit-identical (GPT-2 and Llama, all and some targets)") {
  for (const ModelConfig& m : {tiny_gpt2(), tiny_llama()}) {
    std::vector<std::string> lists = {"qkv,proj,fc1,fc2", "proj,fc1", "fc2"};
    if (m.family == "llama")  // an adapter per projection (PEFT's default for Llama: q and v)
      lists.insert(lists.end(), {"q,v,proj,gate,up,fc2", "k", "q,k,v,up"});
    for (const std::string& targets : lists) {
      CAPTURE(m.family);
      CAPTURE(targets);
      const LoraConfig l = lora(4, 8, targets);
      const TensorMap ours = random_adapters(m, l, 7);
      TempDir tmp;
      save_peft_adapter(tmp / "peft", ours, m, l, "/models/base");
      std::string base;
      const LoraConfig back = read_peft_config(tmp / "peft", m, &base);
      CHECK(back.rank == 4);
      CHECK(back.alpha == 8);
      CHECK(back.targets == targets);
      CHECK(base == "/models/base");
      CHECK(bitwise_equal(load_peft_adapter(tmp / "peft", m, back), ours));
    }
  }
}

TEST_CASE("peft: PEFT's key names, split qkv and [gate; up], config fields") {
  const LoraConfig l = lora(2, 4, "qkv,proj,fc1,fc2");
  const ModelConfig ll = tiny_llama();  // C 16, 4 heads, 2 kv heads: q 16, kv 8; F 24
  const TensorMap ours = random_adapters(ll, l, 3);
  const TensorMap p = to_peft(ours, ll, l);
  CHECK(p.size() == 2u * 2 * 7);
  const std::string q = "base_model.model.model.layers.1.self_attn.";
  REQUIRE(p.count(q + "k_proj.lora_B.weight"));
  CHECK(p.at(q + "k_proj.lora_B.weight").shape == Shape{8, 2});
  CHECK(p.at(q + "v_proj.lora_A.weight").data == ours.at("layers.1.attn.qkv.lora_A.weight").data);
  const std::vector<float>& B = ours.at("layers.1.attn.qkv.lora_B.weight").data;
  CHECK(p.at(q + "k_proj.lora_B.weight").data == std::vector<float>(B.begin() + 16 * 2, B.begin() + 24 * 2));
  const std::vector<float>& fc = ours.at("layers.0.mlp.fc.lora_B.weight").data;
  CHECK(p.at("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight").data ==
        std::vector<float>(fc.begin() + 24 * 2, fc.end()));
  const json cl = peft_config(ll, l, "");
  CHECK(cl["target_modules"] == json({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
  CHECK(cl["fan_in_fan_out"] == false);
  CHECK(cl["base_model_name_or_path"].is_null());
  const ModelConfig g = tiny_gpt2();
  const TensorMap pg = to_peft(random_adapters(g, l, 3), g, l);
  CHECK(pg.count("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"));
  CHECK(pg.at("base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight").shape == Shape{64, 2});
  const json cg = peft_config(g, lora(2, 4, "proj,fc1"), "/b");
  CHECK(cg["target_modules"] == json({"attn.c_proj", "c_fc"}));
  CHECK(cg["fan_in_fan_out"] == true);
  CHECK(cg["peft_type"] == "LORA");
  CHECK(cg["task_type"] == "CAUSAL_LM");
  CHECK(cg["bias"] == "none");
  // PEFT's short "c_proj" adapts both of GPT-2's c_proj modules.
  json c2 = cg;
  c2["target_modules"] = {"c_proj"};
  CHECK(lora_config_from_peft(c2, g, "x").targets == "proj,fc2");
}

TEST_CASE("peft: adapters mpigpt cannot represent are refused naming the key or field") {
  const ModelConfig m = tiny_llama();
  const LoraConfig l = lora(2, 4, "qkv,fc2");
  TempDir tmp;
  save_peft_adapter(tmp / "a", random_adapters(m, l, 5), m, l, "");
  const std::string st = tmp / (std::string("a/") + kPeftWeightsFile);
  const TensorMap good = read_safetensors(st);
  const std::string k = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight";
  TensorMap t = good;
  t.at(k).data[3] += 1.0f;
  CHECK_THROWS_WITH_AS(from_peft(t, m, l, "f"), doctest::Contains((k + " differs from base_model.model.model.layers.1."
                                                                   "self_attn.q_proj.lora_A.weight").c_str()), Error);
  t = good;
  t["base_model.model.lm_head.lora_A.weight"] = HostTensor{Shape{2, 16}, std::vector<float>(32)};
  CHECK_THROWS_WITH_AS(from_peft(t, m, l, "f"), doctest::Contains("tensor base_model.model.lm_head.lora_A.weight is "
                                                                  "not an adapter mpigpt can represent"), Error);
  t = good;
  t.at(k) = HostTensor{Shape{3, 16}, std::vector<float>(48)};
  CHECK_THROWS_WITH_AS(from_peft(t, m, l, "f"), doctest::Contains((k + " has rank 3, r = 2").c_str()), Error);
  t = good;
  t.erase("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight");
  CHECK_THROWS_WITH_AS(from_peft(t, m, l, "f"),
                       doctest::Contains("tensor base_model.model.model.layers.0.mlp.down_proj.lora_B.weight (shape (16, 2)) is missing"), Error);
  const json cfg = peft_config(m, l, "");
  auto refused = [&](const char* field, json value, const char* why) {
    json c = cfg;
    c[field] = std::move(value);
    CAPTURE(field);
    CHECK_THROWS_WITH_AS(lora_config_from_peft(c, m, "cfg.json"), doctest::Contains(why), Error);
  };
  refused("use_dora", true, "use_dora = true: mpigpt computes plain LoRA");
  refused("use_rslora", "yes", "use_rslora = \"yes\": expected true or false");
  refused("lora_dropout", 1.5, "lora_dropout = 1.5: expected a probability in [0, 1)");
  refused("bias", "all", "bias = \"all\"");
  refused("peft_type", "IA3", "peft_type = \"IA3\"");
  refused("rank_pattern", json{{"q_proj", 8}}, "rank_pattern = {\"q_proj\":8}");
  refused("modules_to_save", json{"lm_head"}, "modules_to_save = [\"lm_head\"]");
  refused("target_modules", json{"q_proj", "k_proj", "v_proj", "lm_head"}, "names lm_head, a module mpigpt has no LoRA adapter for");
  refused("target_modules", "all-linear", "mpigpt reads a list of module names");
  write_json(tmp / (std::string("a/") + kPeftConfigFile), json::object({{"peft_type", "LORA"}, {"r", 2}, {"lora_alpha", 4}, {"use_dora", true}}));
  CHECK_THROWS_WITH_AS(read_peft_config(tmp / "a", m), doctest::Contains("adapter_config.json: use_dora = true"), Error);
  // Under a shared target (qkv) the projections' A must be equal; B is zero outside its blocks.
  const LoraConfig split = lora(2, 4, "q,v");
  TensorMap ours = random_adapters(m, split, 5);
  ours.at("layers.0.attn.qkv.lora_B.weight").data[16 * 4 + 1] = 0.5f;  // a k row (k not adapted)
  CHECK_THROWS_WITH_AS(to_peft(ours, m, split), doctest::Contains("to_peft: adapter layers.0.attn.qkv has B[16, 1] = "
                                                                  "0.5 outside self_attn.k_proj's block"), Error);
  CHECK_THROWS_WITH_AS(peft_config(tiny_gpt2(), split, ""),
                       doctest::Contains("lora.targets = 'q,v' gives q, k and v adapters of their own, but a "
                                         "model.family = gpt2 model computes them in one Hugging Face layer"), Error);
}

TEST_CASE("peft: a PEFT-trained adapter (an A per projection, q and v only, dropout) reads as adapters per projection") {
  const ModelConfig m = tiny_llama();  // q 16, kv 8, F 24
  const int64_t r = 2;
  std::mt19937 gen(9);
  std::normal_distribution<float> n(0.f, 0.3f);
  TensorMap peft;  // as PEFT's LoraConfig(r=2, target_modules=["q_proj", "v_proj", "up_proj"]) trains it
  auto put = [&](const std::string& key, int64_t rows) {
    for (auto [f, shape] : {std::pair{".lora_A.weight", Shape{r, 16}}, std::pair{".lora_B.weight", Shape{rows, r}}}) {
      HostTensor t{shape, std::vector<float>(size_t(shape.numel()))};
      for (float& x : t.data) x = n(gen);
      peft[key + f] = std::move(t);
    }
  };
  for (int l = 0; l < m.num_layers; ++l) {
    const std::string p = "base_model.model.model.layers." + std::to_string(l) + ".";
    put(p + "self_attn.q_proj", 16);
    put(p + "self_attn.v_proj", 8);
    put(p + "mlp.up_proj", 24);
  }
  TempDir tmp;
  std::filesystem::create_directories(tmp / "p");
  write_safetensors(tmp / (std::string("p/") + kPeftWeightsFile), peft);
  write_json(tmp / (std::string("p/") + kPeftConfigFile),
             json{{"peft_type", "LORA"}, {"r", 2}, {"lora_alpha", 4}, {"lora_dropout", 0.05}, {"bias", "none"},
                  {"target_modules", {"q_proj", "v_proj", "up_proj"}}, {"task_type", "CAUSAL_LM"}});
  const LoraConfig l = read_peft_config(tmp / "p", m);
  CHECK(l.targets == "q,v,up");
  CHECK(l.rank == 2);
  CHECK(l.dropout == 0.05);
  const TensorMap ours = load_peft_adapter(tmp / "p", m, l);
  CHECK(ours.at("layers.1.attn.qkv.lora_A.weight").shape == Shape{4, 16});
  CHECK(ours.at("layers.1.attn.qkv.lora_B.weight").shape == Shape{32, 4});
  CHECK(ours.at("layers.1.mlp.fc.lora_B.weight").shape == Shape{48, 2});
  // Our B A is each projection's own B_p A_p in its rows (zero for k and gate), as PEFT computes.
  auto product = [](const HostTensor& B, const HostTensor& A, int64_t row, int64_t col) {
    double s = 0;
    for (int64_t k = 0; k < A.shape[0]; ++k) s += double(B.data[size_t(row * A.shape[0] + k)]) * A.data[size_t(k * A.shape[1] + col)];
    return s;
  };
  const std::string q = "base_model.model.model.layers.1.";
  const HostTensor &A = ours.at("layers.1.attn.qkv.lora_A.weight"), &B = ours.at("layers.1.attn.qkv.lora_B.weight"),
                   &Af = ours.at("layers.1.mlp.fc.lora_A.weight"), &Bf = ours.at("layers.1.mlp.fc.lora_B.weight");
  double err = 0;
  for (int64_t col = 0; col < 16; ++col) {
    for (int64_t row = 0; row < 32; ++row) {
      const double want = row < 16 ? product(peft.at(q + "self_attn.q_proj.lora_B.weight"), peft.at(q + "self_attn.q_proj.lora_A.weight"), row, col)
                          : row < 24 ? 0.0
                                     : product(peft.at(q + "self_attn.v_proj.lora_B.weight"), peft.at(q + "self_attn.v_proj.lora_A.weight"), row - 24, col);
      err = std::max(err, std::abs(product(B, A, row, col) - want));
    }
    for (int64_t row = 0; row < 48; ++row) {
      const double want = row < 24 ? 0.0 : product(peft.at(q + "mlp.up_proj.lora_B.weight"), peft.at(q + "mlp.up_proj.lora_A.weight"), row - 24, col);
      err = std::max(err, std::abs(product(Bf, Af, row, col) - want));
    }
  }
  CHECK(err < 1e-6);
  CHECK(bitwise_equal(to_peft(ours, m, l), peft));  // and back to PEFT's tensors, bit for bit
  const json c = peft_config(m, l, "");
  CHECK(c["target_modules"] == json({"q_proj", "v_proj", "up_proj"}));
}

TEST_CASE("peft: Mixtral's routed experts: ours -> PEFT -> ours bit-identical, w1/w3/w2 per expert, errors") {
  const ModelConfig m = tiny_mixtral();  // C 16, E 4, expert F 12, every layer MoE
  for (const char* targets : {"qkv,proj,fc1,fc2", "fc1", "proj,fc2", "q,v,gate,up", "up,fc2"}) {
    CAPTURE(targets);
    const LoraConfig l = lora(2, 4, targets);
    TempDir tmp;
    save_peft_adapter(tmp / "peft", random_adapters(m, l, 11), m, l, "");
    const LoraConfig back = read_peft_config(tmp / "peft", m);
    CHECK(back.targets == std::string(targets));
    CHECK_FALSE(back.rslora);
    CHECK(bitwise_equal(load_peft_adapter(tmp / "peft", m, back), random_adapters(m, l, 11)));
  }
  LoraConfig rs = lora(2, 4, "q,v");  // rank-stabilised: PEFT's use_rslora
  rs.rslora = true;
  CHECK(peft_config(m, rs, "")["use_rslora"] == true);
  CHECK(lora_config_from_peft(peft_config(m, rs, ""), m, "x").rslora);
  const LoraConfig l = lora(2, 4, "qkv,proj,fc1,fc2");
  const TensorMap ours = random_adapters(m, l, 5);
  const TensorMap p = to_peft(ours, m, l);
  CHECK(p.size() == 2u * 2 * (4 + 3 * 4));
  // Expert 2 of layer 1: w1 / w3 share its fc A; their B are its gate / up rows; w2 is its proj.
  const std::string x = "base_model.model.model.layers.1.block_sparse_moe.experts.2.";
  const std::vector<float>&fa = ours.at("layers.1.mlp.experts.fc.lora_A.weight").data,
       &fb = ours.at("layers.1.mlp.experts.fc.lora_B.weight").data,
       &pa = ours.at("layers.1.mlp.experts.proj.lora_A.weight").data,
       &pb = ours.at("layers.1.mlp.experts.proj.lora_B.weight").data;
  auto slice = [](const std::vector<float>& v, int64_t at, int64_t n) {
    return std::vector<float>(v.begin() + at, v.begin() + at + n);
  };
  REQUIRE(p.count(x + "w1.lora_A.weight"));
  CHECK(p.at(x + "w1.lora_A.weight").shape == Shape{2, 16});
  CHECK(p.at(x + "w1.lora_A.weight").data == slice(fa, 2 * 2 * 16, 2 * 16));
  CHECK(p.at(x + "w3.lora_A.weight").data == slice(fa, 2 * 2 * 16, 2 * 16));
  CHECK(p.at(x + "w1.lora_B.weight").shape == Shape{12, 2});
  CHECK(p.at(x + "w1.lora_B.weight").data == slice(fb, 2 * 24 * 2, 12 * 2));
  CHECK(p.at(x + "w3.lora_B.weight").data == slice(fb, 2 * 24 * 2 + 12 * 2, 12 * 2));
  CHECK(p.at(x + "w2.lora_A.weight").shape == Shape{2, 12});
  CHECK(p.at(x + "w2.lora_A.weight").data == slice(pa, 2 * 2 * 12, 2 * 12));
  CHECK(p.at(x + "w2.lora_B.weight").shape == Shape{16, 2});
  CHECK(p.at(x + "w2.lora_B.weight").data == slice(pb, 2 * 16 * 2, 16 * 2));
  const json c = peft_config(m, l, "");
  CHECK(c["target_modules"] == json({"q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"}));
  json c2 = c;
  c2["target_modules"] = {"w2", "w3", "w1"};  // read_peft_config finds their A shared (fc1)
  CHECK(lora_config_from_peft(c2, m, "x").targets == "gate,up,fc2");
  c2["target_modules"] = {"w1", "w2"};
  CHECK(lora_config_from_peft(c2, m, "x").targets == "gate,fc2");

  TensorMap t = p;
  t.at(x + "w3.lora_A.weight").data[1] += 1.0f;
  CHECK_THROWS_WITH_AS(from_peft(t, m, l, "f"),
                       doctest::Contains((x + "w3.lora_A.weight differs from " + x +
                                          "w1.lora_A.weight: lora.targets = qkv,proj,fc1,fc2 gives mlp.experts.fc "
                                          "of expert 2 one adapter whose A is shared").c_str()),
                       Error);
  t = p;
  t.erase(x + "w2.lora_B.weight");
  CHECK_THROWS_WITH_AS(from_peft(t, m, l, "f"),
                       doctest::Contains(("tensor " + x + "w2.lora_B.weight (shape (16, 2)) is missing").c_str()), Error);
  t = p;
  t["base_model.model.model.layers.0.block_sparse_moe.experts.4.w1.lora_A.weight"] = HostTensor{Shape{2, 16}, std::vector<float>(32)};
  CHECK_THROWS_WITH_AS(from_peft(t, m, l, "f"), doctest::Contains("experts.4.w1.lora_A.weight is not an adapter"), Error);
  t = p;
  t.at(x + "w2.lora_A.weight") = HostTensor{Shape{2, 16}, std::vector<float>(32)};
  CHECK_THROWS_WITH_AS(from_peft(t, m, l, "f"),
                       doctest::Contains((x + "w2.lora_A.weight has shape (2, 16), expected (2, 12)").c_str()), Error);

  // GPT-2 MoE has no Hugging Face model, hence no PEFT form.
  ModelConfig g = tiny_gpt2();
  g.num_experts = 4;
  g.moe_ffn_hidden = 12;
  CHECK_THROWS_WITH_AS(peft_config(g, l, ""), doctest::Contains("Hugging Face has no GPT-2 mixture-of-experts model"),
                       Error);
}

TEST_CASE("peft: target_modules as PEFT matches it: full names (a saved all-linear), suffixes; every layer alike") {
  const ModelConfig m = tiny_llama();  // 2 layers
  json c = peft_config(m, lora(2, 4, "qkv,proj,fc1,fc2"), "");
  auto targets = [&](json list) {
    c["target_modules"] = std::move(list);
    return lora_config_from_peft(c, m, "cfg.json").targets;
  };
  // PEFT >= 0.14 saves target_modules="all-linear" as the full name of every linear layer but the head.
  json all = json::array();
  for (int l = 0; l < 2; ++l)
    for (const char* p : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
      all.push_back("model.layers." + std::to_string(l) + "." + p);
  CHECK(targets(all) == "q,k,v,proj,gate,up,fc2");
  CHECK(targets({"q_proj", "self_attn.v_proj", "mlp.down_proj"}) == "q,v,fc2");
  CHECK(targets({"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}) == "q");
  CHECK_THROWS_WITH_AS(targets({"model.layers.1.self_attn.q_proj"}),
                       "cfg.json: target_modules adapts other projections of attn.qkv in layer 1 than in layer 0: "
                       "mpigpt gives every layer (and expert) the same adapters", Error);
  CHECK_THROWS_WITH_AS(targets({"proj"}), doctest::Contains("names proj, a module mpigpt has no LoRA adapter for"), Error);
  // Mixtral: the router is a linear layer (all-linear takes it) that mpigpt does not adapt; experts alike.
  const ModelConfig x = tiny_mixtral();
  json cx = peft_config(x, lora(2, 4, "qkv"), "");
  cx["target_modules"] = {"q_proj", "block_sparse_moe.gate"};
  CHECK_THROWS_WITH_AS(lora_config_from_peft(cx, x, "x"), doctest::Contains("names block_sparse_moe.gate, a module"),
                       Error);
  cx["target_modules"] = {"model.layers.0.block_sparse_moe.experts.0.w1", "model.layers.1.block_sparse_moe.experts.0.w1"};
  CHECK_THROWS_WITH_AS(lora_config_from_peft(cx, x, "x"),
                       doctest::Contains("adapts other projections of mlp.experts.fc in layer 0 expert 1 than in layer "
                                         "0 expert 0"), Error);
}
