// Hugging Face interchange: our tensor table agrees with lib/model's, round trips are bit-identical
// for GPT-2, Llama and Mixtral, config.json translation, errors that name the tensor or field, and
// an independent numpy oracle (testdata/make_hf_tiny.py) for the logits both ways.
#include "io/formats/hf_format.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>

#include "io/io_testing.h"
#include "lib/core/error.h"
#include "lib/kernels/ops.h"
#include "lib/model/gpt.h"
#include "lib/model/params.h"
#include "lib/train/trainer.h"

using namespace mpigpt;
using namespace mpigpt::testing;
using nlohmann::json;

namespace {

ModelConfig tiny_gpt2() {
  ModelConfig m;
  m.family = "gpt2";
  m.num_layers = 2;
  m.hidden = 16;
  m.num_heads = 4;
  m.seq_len = 8;
  m.max_position = 12;
  return m;
}

ModelConfig tiny_llama() {
  ModelConfig m;
  m.family = "llama";
  m.num_layers = 2;
  m.hidden = 16;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.ffn_hidden = 24;
  m.seq_len = 8;
  m.max_position = 32;
  m.tie_embeddings = false;
  m.rope_theta = 500000.0;
  return m;
}

// Llama with every MLP a mixture of 4 experts of width 12, top-2, renormalised: a Mixtral.
ModelConfig tiny_mixtral() {
  ModelConfig m = tiny_llama();
  m.num_experts = 4;
  m.moe_top_k = 2;
  m.moe_ffn_hidden = 12;
  m.moe_norm_topk_prob = true;
  m.moe_aux_loss_coeff = 0.02;
  return m;
}

// The GPT of `m` as training builds it (lib/train's make_dims), with vocabulary V padded to Vp rows
// and activations for T tokens.
GptDims dims_of(const ModelConfig& m, int V, int Vp, int T) {
  Config c;
  c.model = m;
  if (c.model.ffn_hidden <= 0) c.model.ffn_hidden = 4 * m.hidden;
  c.model.vocab_size = V;
  GptDims d = make_dims(c, V);
  d.Vp = Vp;
  d.T = T;
  return d;
}

// Random parameters with the shapes of param_shapes: norm weights near 1, vocabulary padding zero.
TensorMap random_ours(const ModelConfig& m, int V, int Vp, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  TensorMap out;
  for (const auto& [name, s] : param_shapes(m, Vp)) {
    HostTensor t{s, std::vector<float>(size_t(s.numel()))};
    const bool norm = name.find("norm.weight") != std::string::npos, bias = name.ends_with(".bias");
    for (float& x : t.data) x = norm ? 1.f + 0.1f * n(gen) : (bias ? 0.1f : 0.3f) * n(gen);
    if (name == "embedding.word.weight" || name == "lm_head.weight")
      std::fill(t.data.begin() + int64_t(V) * s[1], t.data.end(), 0.f);
    out[name] = std::move(t);
  }
  return out;
}

void check_bit_identical(const TensorMap& a, const TensorMap& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    CAPTURE(name);
    REQUIRE(b.count(name));
    CHECK(b.at(name).shape == t.shape);
    REQUIRE(b.at(name).data.size() == t.data.size());
    CHECK(std::memcmp(b.at(name).data.data(), t.data.data(), t.data.size() * 4) == 0);
  }
}

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

TEST_CASE("hf: param_shapes mirrors lib/model's build_param_table") {
  // MoE beyond what Mixtral holds too: dense layers between, shared experts, GPT-2 experts.
  ModelConfig moe_every2 = tiny_mixtral();
  moe_every2.moe_layers = "every:2";
  moe_every2.moe_shared_expert_ffn = 8;
  ModelConfig gpt2_moe = tiny_gpt2();
  gpt2_moe.num_experts = 3;
  gpt2_moe.moe_top_k = 1;
  gpt2_moe.moe_layers = "0";
  gpt2_moe.moe_shared_expert_ffn = 20;  // moe_ffn_hidden 0: = ffn_hidden (4C)
  for (ModelConfig m : {tiny_gpt2(), tiny_llama(), tiny_mixtral(), moe_every2, gpt2_moe}) {
    for (bool tied : {true, false}) {
      m.tie_embeddings = tied;
      CAPTURE(m.family);
      CAPTURE(m.num_experts);
      CAPTURE(m.moe_layers);
      CAPTURE(tied);
      const auto ours = param_shapes(m, 64);
      const auto table = build_param_table(dims_of(m, 37, 64, 8));
      REQUIRE(ours.size() == table.size());
      for (size_t i = 0; i < table.size(); ++i) {
        CHECK(ours[i].first == table[i].name);
        CHECK(ours[i].second == table[i].global);
      }
    }
  }
}

TEST_CASE("hf: ours -> HF -> ours is bit-identical, with HF's names and layouts") {
  const int V = 37, Vp = 64;
  SUBCASE("gpt2") {
    const ModelConfig m = tiny_gpt2();
    const TensorMap ours = random_ours(m, V, Vp, 1);
    const TensorMap hf = to_hf(ours, m, V);
    CHECK(hf.size() == 4 + 12 * 2);
    CHECK_FALSE(hf.count("lm_head.weight"));  // tied: transformers ties it on load
    CHECK(hf.at("transformer.wte.weight").shape == Shape{V, 16});
    CHECK(hf.at("transformer.wpe.weight").shape == Shape{12, 16});
    CHECK(hf.at("transformer.h.1.attn.c_attn.weight").shape == Shape{16, 48});  // Conv1D: (in, out)
    CHECK(hf.at("transformer.h.1.mlp.c_fc.weight").shape == Shape{16, 64});
    CHECK(hf.at("transformer.h.1.mlp.c_proj.weight").shape == Shape{64, 16});
    // c_attn[c][r] = qkv[r][c]: row 20 (a key row) of ours is column 20 of HF's.
    const auto& qkv = ours.at("layers.1.attn.qkv.weight").data;
    const auto& ca = hf.at("transformer.h.1.attn.c_attn.weight").data;
    CHECK(ca[3 * 48 + 20] == qkv[20 * 16 + 3]);
    check_bit_identical(ours, from_hf(hf, m, V, Vp));

    // Checkpoints saved from GPT2Model (the hub's gpt2) have no prefix and carry mask buffers.
    TensorMap hub;
    for (const auto& [name, t] : hf) hub[name.substr(std::string("transformer.").size())] = t;
    hub["h.0.attn.bias"] = HostTensor{Shape{1, 1, 2, 2}, {1, 0, 1, 1}};
    hub["h.0.attn.masked_bias"] = HostTensor{Shape{}, {-1e4f}};
    hub["lm_head.weight"] = hf.at("transformer.wte.weight");  // tied copy: checked, then dropped
    check_bit_identical(ours, from_hf(hub, m, V, Vp));
    hub["lm_head.weight"].data[5] += 1.0f;
    CHECK_THROWS_WITH_AS(from_hf(hub, m, V, Vp), doctest::Contains("lm_head.weight differs from transformer.wte.weight"),
                         Error);

    ModelConfig untied = m;  // GPT-2 with its own head
    untied.tie_embeddings = false;
    const TensorMap ours_u = random_ours(untied, V, Vp, 2);
    const TensorMap hf_u = to_hf(ours_u, untied, V);
    CHECK(hf_u.at("lm_head.weight").shape == Shape{V, 16});
    check_bit_identical(ours_u, from_hf(hf_u, untied, V, Vp));
  }
  SUBCASE("llama") {
    ModelConfig m = tiny_llama();
    const TensorMap ours = random_ours(m, V, Vp, 3);
    const TensorMap hf = to_hf(ours, m, V);
    CHECK(hf.size() == 3 + 9 * 2);
    CHECK(hf.at("model.layers.0.self_attn.q_proj.weight").shape == Shape{16, 16});
    CHECK(hf.at("model.layers.0.self_attn.k_proj.weight").shape == Shape{8, 16});  // 2 kv heads of 4
    CHECK(hf.at("model.layers.0.mlp.gate_proj.weight").shape == Shape{24, 16});
    CHECK(hf.at("model.layers.0.mlp.down_proj.weight").shape == Shape{16, 24});
    CHECK(hf.at("lm_head.weight").shape == Shape{V, 16});
    // k_proj is rows [16, 24) of qkv, up_proj rows [24, 48) of [gate; up]; no transpose, no permutation.
    CHECK(hf.at("model.layers.1.self_attn.k_proj.weight").data[0] == ours.at("layers.1.attn.qkv.weight").data[16 * 16]);
    CHECK(hf.at("model.layers.1.self_attn.v_proj.weight").data[17] ==
          ours.at("layers.1.attn.qkv.weight").data[24 * 16 + 17]);
    CHECK(hf.at("model.layers.1.mlp.up_proj.weight").data[5] == ours.at("layers.1.mlp.fc.weight").data[24 * 16 + 5]);
    check_bit_identical(ours, from_hf(hf, m, V, Vp));

    TensorMap with_buffer = hf;  // older checkpoints saved the RoPE frequencies
    with_buffer["model.layers.0.self_attn.rotary_emb.inv_freq"] = HostTensor{Shape{2}, {1.f, 0.01f}};
    check_bit_identical(ours, from_hf(with_buffer, m, V, Vp));

    m.tie_embeddings = true;  // Llama 3.2 style
    const TensorMap ours_t = random_ours(m, V, Vp, 4);
    const TensorMap hf_t = to_hf(ours_t, m, V);
    CHECK_FALSE(hf_t.count("lm_head.weight"));
    check_bit_identical(ours_t, from_hf(hf_t, m, V, Vp));
  }
  SUBCASE("mixtral") {
    ModelConfig m = tiny_mixtral();  // 2 layers, E = 4 experts of F = 12, top-2, 4 query / 2 kv heads
    const TensorMap ours = random_ours(m, V, Vp, 10);
    CHECK(ours.at("layers.1.mlp.experts.fc.weight").shape == Shape{4, 24, 16});
    CHECK(ours.at("layers.1.mlp.experts.proj.weight").shape == Shape{4, 16, 12});
    const TensorMap hf = to_hf(ours, m, V);
    CHECK(hf.size() == 3 + (6 + 1 + 3 * 4) * 2);  // attention + norms, router, w1/w2/w3 per expert
    CHECK_FALSE(hf.count("model.layers.0.mlp.gate_proj.weight"));
    CHECK(hf.at("model.layers.0.self_attn.k_proj.weight").shape == Shape{8, 16});
    CHECK(hf.at("model.layers.0.block_sparse_moe.gate.weight").shape == Shape{4, 16});
    for (int e = 0; e < 4; ++e) {
      const std::string x = "model.layers.1.block_sparse_moe.experts." + std::to_string(e) + ".";
      CHECK(hf.at(x + "w1.weight").shape == Shape{12, 16});
      CHECK(hf.at(x + "w3.weight").shape == Shape{12, 16});
      CHECK(hf.at(x + "w2.weight").shape == Shape{16, 12});
    }
    // Expert e's w1 is rows [e*2F, e*2F + F) of the (E*2F, C) row view of [gate; up], w3 the next
    // F rows, w2 rows [e*C, (e+1)*C) of the (E*C, F) view of proj: no transposes.
    const auto& fc = ours.at("layers.1.mlp.experts.fc.weight").data;
    const auto& proj = ours.at("layers.1.mlp.experts.proj.weight").data;
    CHECK(hf.at("model.layers.1.block_sparse_moe.experts.2.w1.weight").data[5 * 16 + 7] == fc[(2 * 24 + 5) * 16 + 7]);
    CHECK(hf.at("model.layers.1.block_sparse_moe.experts.2.w3.weight").data[5 * 16 + 7] ==
          fc[(2 * 24 + 12 + 5) * 16 + 7]);
    CHECK(hf.at("model.layers.1.block_sparse_moe.experts.3.w2.weight").data[10 * 12 + 4] == proj[(3 * 16 + 10) * 12 + 4]);
    CHECK(hf.at("model.layers.0.block_sparse_moe.gate.weight").data == ours.at("layers.0.mlp.router.weight").data);
    check_bit_identical(ours, from_hf(hf, m, V, Vp));

    // Training-only settings do not change the exported function: a capacity factor (the HF
    // model routes dropless), the z-loss, "every:1" (= all layers), top-1.
    m.moe_capacity_factor = 1.25;
    m.moe_z_loss_coeff = 1e-3;
    m.moe_layers = "every:1";
    m.moe_top_k = 1;
    m.tie_embeddings = true;
    const TensorMap ours_t = random_ours(m, V, Vp, 11);
    const TensorMap hf_t = to_hf(ours_t, m, V);
    CHECK_FALSE(hf_t.count("lm_head.weight"));
    check_bit_identical(ours_t, from_hf(hf_t, m, V, Vp));
  }
}

TEST_CASE("hf: model directories (config.json + sharded safetensors) and vocabulary re-padding") {
  TempDir tmp;
  const int V = 37, Vp = 64;
  for (const ModelConfig& m : {tiny_gpt2(), tiny_llama(), tiny_mixtral()}) {
    CAPTURE(m.family);
    CAPTURE(m.num_experts);
    const TensorMap ours = random_ours(m, V, Vp, 5);
    const std::string dir = tmp / m.family;
    save_hf_model(dir, ours, m, V, 4096);
    CHECK(std::filesystem::exists(dir + "/model.safetensors.index.json"));
    int vocab = 0;
    const ModelConfig back = read_hf_config(dir, &vocab);
    CHECK(vocab == V);
    CHECK(back.family == m.family);
    CHECK(back.num_layers == m.num_layers);
    CHECK(back.hidden == m.hidden);
    CHECK(back.num_heads == m.num_heads);
    CHECK(back.num_kv_heads == (m.num_kv_heads ? m.num_kv_heads : m.num_heads));
    CHECK(back.max_position == m.max_position);
    CHECK(back.tie_embeddings == m.tie_embeddings);
    CHECK(back.norm_eps == m.norm_eps);
    if (m.family == "llama") CHECK(back.rope_theta == m.rope_theta);
    CHECK(back.num_experts == m.num_experts);
    if (m.num_experts == 0) {
      CHECK(back.ffn_hidden == (m.ffn_hidden ? m.ffn_hidden : 4 * m.hidden));
    } else {  // Mixtral's intermediate_size is the expert width; no layer is dense
      CHECK(back.ffn_hidden == m.moe_ffn_hidden);
      CHECK(back.moe_ffn_hidden == m.moe_ffn_hidden);
      CHECK(back.moe_top_k == m.moe_top_k);
      CHECK(back.moe_router == "softmax");
      CHECK(back.moe_norm_topk_prob);
      CHECK(back.moe_layers == "all");
      CHECK(back.moe_shared_expert_ffn == 0);
      CHECK(back.moe_capacity_factor == 0.0);
      CHECK(back.moe_aux_loss_coeff == m.moe_aux_loss_coeff);
    }
    check_bit_identical(ours, load_hf_model(dir, back, vocab, Vp));
  }

  TensorMap ours = random_ours(tiny_llama(), V, Vp, 6);
  const TensorMap orig = ours;
  repad_vocab(ours, V, 40);
  CHECK(ours.at("embedding.word.weight").shape == Shape{40, 16});
  CHECK(ours.at("lm_head.weight").shape == Shape{40, 16});
  repad_vocab(ours, V, Vp);
  check_bit_identical(orig, ours);
  ours.at("lm_head.weight").data[50 * 16] = 1.0f;
  CHECK_THROWS_WITH_AS(repad_vocab(ours, V, 48), doctest::Contains("lm_head.weight row 50 beyond the vocabulary 37"),
                       Error);
}

TEST_CASE("hf: missing, extra and misshapen tensors are errors naming the tensor") {
  const int V = 37, Vp = 64;
  const ModelConfig g = tiny_gpt2();
  const TensorMap ours = random_ours(g, V, Vp, 7);
  TensorMap bad = ours;
  bad.erase("layers.1.mlp.proj.weight");
  CHECK_THROWS_WITH_AS(to_hf(bad, g, V), doctest::Contains("tensor layers.1.mlp.proj.weight of shape (16, 64) is missing"), Error);
  bad = ours;
  bad["layers.2.attn_norm.weight"] = HostTensor{Shape{16}, std::vector<float>(16)};
  CHECK_THROWS_WITH_AS(to_hf(bad, g, V), doctest::Contains("not parameters of this gpt2 model: layers.2.attn_norm.weight"), Error);
  bad = ours;
  bad["layers.0.attn.qkv.weight"].shape = Shape{16, 48};
  CHECK_THROWS_WITH_AS(to_hf(bad, g, V), doctest::Contains("layers.0.attn.qkv.weight has shape (16, 48), the model config says (48, 16)"), Error);
  CHECK_THROWS_WITH_AS(to_hf(ours, g, 65), doctest::Contains("fewer rows than the vocabulary 65"), Error);

  const TensorMap hf = to_hf(ours, g, V);
  TensorMap hbad = hf;
  hbad.erase("transformer.h.1.ln_2.bias");
  CHECK_THROWS_WITH_AS(from_hf(hbad, g, V, Vp), doctest::Contains("tensor transformer.h.1.ln_2.bias (shape (16,)) is missing"), Error);
  hbad = hf;
  hbad["transformer.h.0.attn.c_attn.weight"].shape = Shape{48, 16};  // nn.Linear layout instead of Conv1D
  CHECK_THROWS_WITH_AS(from_hf(hbad, g, V, Vp), doctest::Contains("transformer.h.0.attn.c_attn.weight has shape (48, 16), expected (16, 48)"), Error);
  hbad = hf;
  hbad["transformer.h.2.ln_1.weight"] = HostTensor{Shape{16}, std::vector<float>(16)};
  CHECK_THROWS_WITH_AS(from_hf(hbad, g, V, Vp), doctest::Contains("does not have: transformer.h.2.ln_1.weight"), Error);
  CHECK_THROWS_WITH_AS(from_hf(hf, g, V, 30), doctest::Contains("padded vocabulary 30 is smaller than the vocabulary 37"), Error);
  // The wrong number of kv heads shows in k_proj's shape.
  ModelConfig l = tiny_llama();
  const TensorMap lhf = to_hf(random_ours(l, V, Vp, 8), l, V);
  l.num_kv_heads = 4;
  CHECK_THROWS_WITH_AS(from_hf(lhf, l, V, Vp), doctest::Contains("model.layers.0.self_attn.k_proj.weight has shape (8, 16), expected (16, 16)"), Error);
  ModelConfig gqa = tiny_gpt2();
  gqa.num_kv_heads = 2;
  CHECK_THROWS_WITH_AS(hf_config(gqa, V), doctest::Contains("GPT2LMHeadModel has no grouped-query attention"), Error);
}

TEST_CASE("hf: config.json both ways") {
  const json g = hf_config(tiny_gpt2(), 50257);
  CHECK(g["model_type"] == "gpt2");
  CHECK(g["architectures"] == json({"GPT2LMHeadModel"}));
  CHECK(g["n_embd"] == 16);
  CHECK(g["n_positions"] == 12);
  CHECK(g["n_inner"].is_null());  // 4 * n_embd
  CHECK(g["activation_function"] == "gelu_new");
  CHECK(g["eos_token_id"] == 50256);
  const json l = hf_config(tiny_llama(), 37);
  CHECK(l["model_type"] == "llama");
  CHECK(l["num_key_value_heads"] == 2);
  CHECK(l["intermediate_size"] == 24);
  CHECK(l["rope_theta"] == 500000.0);
  CHECK(l["tie_word_embeddings"] == false);
  CHECK(l["hidden_act"] == "silu");

  // The hub's configs of gpt2 (124M) and TinyLlama-1.1B.
  int vocab = 0;
  ModelConfig m = model_config_from_hf(json::parse(R"({"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null, "summary_type": "cls_index",
    "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}}, "vocab_size": 50257})"), &vocab);
  CHECK(vocab == 50257);
  CHECK(m.family == "gpt2");
  CHECK(m.num_layers == 12);
  CHECK(m.hidden == 768);
  CHECK(m.ffn_hidden == 3072);
  CHECK(m.max_position == 1024);
  CHECK(m.seq_len == 1024);
  CHECK(m.tie_embeddings);
  CHECK(m.vocab_size == 50257);
  const json tl = json::parse(R"({"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
    "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 22,
    "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 32000})");
  m = model_config_from_hf(tl, &vocab);
  CHECK(vocab == 32000);
  CHECK(m.family == "llama");
  CHECK(m.num_kv_heads == 4);
  CHECK(m.ffn_hidden == 5632);
  CHECK(m.norm_eps == 1e-5);
  CHECK(m.rope_theta == 10000.0);
  CHECK_FALSE(m.tie_embeddings);

  auto with = [&](json base, const char* key, json value) {
    base[key] = std::move(value);
    return base;
  };
  auto fails = [&](const json& j, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(model_config_from_hf(j, nullptr, "x/config.json"), doctest::Contains(what), Error);
  };
  fails(with(tl, "rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}), "x/config.json: field \"rope_scaling\"");
  fails(with(tl, "rope_scaling", {{"type", "linear"}, {"factor", 2.0}}), "only plain RoPE");
  CHECK(model_config_from_hf(with(tl, "rope_scaling", {{"rope_type", "default"}})).family == "llama");
  CHECK(model_config_from_hf(with(tl, "rope_parameters", {{"rope_type", "default"}, {"rope_theta", 5e5}})).rope_theta == 5e5);
  fails(with(tl, "hidden_act", "gelu"), "field \"hidden_act\" = \"gelu\" is not supported");
  fails(with(tl, "attention_bias", true), "field \"attention_bias\" = true");
  fails(with(tl, "head_dim", 128), "field \"head_dim\" = 128");
  fails(with(tl, "num_key_value_heads", 5), "num_key_value_heads = 5 does not divide num_attention_heads = 32");
  fails(with(tl, "num_attention_heads", "32"), "field \"num_attention_heads\" = \"32\" is not a positive integer");
  fails(with(tl, "model_type", "qwen2_moe"), "model_type \"qwen2_moe\" is a mixture-of-experts model mpigpt does not read");
  fails(with(tl, "model_type", "deepseek_v2"), "reads mixture-of-experts checkpoints as mixtral");
  fails(with(tl, "model_type", "bert"), "model_type \"bert\" is not supported");
  json no_embd = g;
  no_embd.erase("n_embd");
  fails(no_embd, "field \"n_embd\" is missing");
  fails(with(g, "activation_function", "gelu"), "field \"activation_function\" = \"gelu\"");
  fails(with(g, "scale_attn_by_inverse_layer_idx", true), "scale_attn_by_inverse_layer_idx");

  const json x = hf_config(tiny_mixtral(), 37);
  CHECK(x["model_type"] == "mixtral");
  CHECK(x["architectures"] == json({"MixtralForCausalLM"}));
  CHECK(x["intermediate_size"] == 12);  // per expert
  CHECK(x["num_local_experts"] == 4);
  CHECK(x["num_experts_per_tok"] == 2);
  CHECK(x["router_aux_loss_coef"] == 0.02);
  CHECK(x["num_key_value_heads"] == 2);
  CHECK(x["sliding_window"].is_null());
  CHECK(x["output_router_logits"] == false);
  CHECK_FALSE(x.contains("mlp_bias"));

  // The hub's config of mistralai/Mixtral-8x7B-v0.1.
  const json mx = json::parse(R"({"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": true,
    "vocab_size": 32000})");
  m = model_config_from_hf(mx, &vocab);
  CHECK(vocab == 32000);
  CHECK(m.family == "llama");
  CHECK(m.num_layers == 32);
  CHECK(m.num_kv_heads == 8);
  CHECK(m.num_experts == 8);
  CHECK(m.moe_top_k == 2);
  CHECK(m.moe_ffn_hidden == 14336);
  CHECK(m.ffn_hidden == 14336);
  CHECK(m.moe_router == "softmax");
  CHECK(m.moe_norm_topk_prob);
  CHECK(m.moe_layers == "all");
  CHECK(m.moe_capacity_factor == 0.0);
  CHECK(m.moe_z_loss_coeff == 0.0);
  CHECK(m.moe_aux_loss_coeff == 0.02);
  CHECK(m.moe_shared_expert_ffn == 0);
  CHECK(m.max_position == 32768);
  CHECK(m.seq_len == 2048);
  CHECK(m.rope_theta == 1e6);
  CHECK(m.norm_eps == 1e-5);
  CHECK_FALSE(m.tie_embeddings);
  // transformers' MixtralConfig defaults for what a config leaves out.
  json bare = mx;
  for (const char* k : {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "rope_theta", "rms_norm_eps",
                        "sliding_window", "max_position_embeddings"})
    bare.erase(k);
  m = model_config_from_hf(bare);
  CHECK(m.num_experts == 8);
  CHECK(m.moe_top_k == 2);
  CHECK(m.moe_aux_loss_coeff == 0.001);
  CHECK(m.rope_theta == 1e6);
  CHECK(m.norm_eps == 1e-5);
  CHECK(m.max_position == 4096 * 32);
  CHECK(model_config_from_hf(with(mx, "router_aux_loss_coef", 0)).moe_aux_loss_coeff == 0.0);
  fails(with(mx, "sliding_window", 4096), "x/config.json: field \"sliding_window\" = 4096 is not supported");
  fails(with(mx, "num_experts_per_tok", 9), "num_experts_per_tok = 9 exceeds num_local_experts = 8");
  fails(with(mx, "num_local_experts", 0), "field \"num_local_experts\" = 0 is not a positive integer");
  fails(with(mx, "router_aux_loss_coef", -1), "field \"router_aux_loss_coef\" = -1 is not a number >= 0");
  fails(with(mx, "hidden_act", "gelu"), "field \"hidden_act\" = \"gelu\" is not supported");
  fails(with(mx, "rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}), "field \"rope_scaling\"");
}

TEST_CASE("hf: MoE models MixtralForCausalLM cannot represent are refused, naming the field and the fix") {
  const int V = 37, Vp = 64;
  auto refused = [&](const ModelConfig& m, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(hf_config(m, V), doctest::Contains(what), Error);
    const TensorMap ours = random_ours(m, V, Vp, 12);  // param_shapes lists any MoE model
    CHECK_THROWS_WITH_AS(to_hf(ours, m, V), doctest::Contains(what), Error);
    CHECK_THROWS_WITH_AS(from_hf(TensorMap{}, m, V, Vp), doctest::Contains(what), Error);
  };
  ModelConfig m = tiny_gpt2();
  m.num_experts = 4;
  refused(m, "model.num_experts = 4 with model.family = gpt2: Hugging Face has no GPT-2 mixture-of-experts model");
  m = tiny_mixtral();
  m.moe_router = "sigmoid";
  refused(m, "model.moe_router = 'sigmoid': MixtralForCausalLM (the Hugging Face mixture-of-experts model mpigpt "
             "writes) routes with a softmax over all experts; train with model.moe_router = softmax to export");
  m = tiny_mixtral();
  m.moe_norm_topk_prob = false;
  refused(m, "model.moe_norm_topk_prob = false: MixtralForCausalLM");
  m.moe_top_k = 1;  // Mixtral's top-1 weight is 1, ours without renormalising the softmax probability
  refused(m, "train with model.moe_norm_topk_prob = true to export");
  m = tiny_mixtral();
  m.moe_layers = "every:2";
  refused(m, "model.moe_layers = 'every:2' leaves layer 0 dense: every layer of MixtralForCausalLM");
  m.moe_layers = "0";
  refused(m, "model.moe_layers = '0' leaves layer 1 dense");
  m = tiny_mixtral();
  m.moe_shared_expert_ffn = 8;
  refused(m, "model.moe_shared_expert_ffn = 8: MixtralForCausalLM (the Hugging Face mixture-of-experts model mpigpt "
             "writes) has no shared expert; train with model.moe_shared_expert_ffn = 0 to export");
  m = tiny_mixtral();
  m.moe_top_k = 5;
  CHECK_THROWS_WITH_AS(param_shapes(m, Vp), doctest::Contains("model.moe_top_k = 5 must be between 1 and model.num_experts = 4"),
                       Error);

  // A checkpoint with another expert count than its config: the first missing or extra tensor.
  m = tiny_mixtral();
  const TensorMap hf = to_hf(random_ours(m, V, Vp, 13), m, V);
  ModelConfig more = m;
  more.num_experts = 5;
  CHECK_THROWS_WITH_AS(from_hf(hf, more, V, Vp),
                       doctest::Contains("model.layers.0.block_sparse_moe.gate.weight has shape (4, 16), expected (5, 16)"),
                       Error);
  TensorMap hbad = hf;
  hbad.erase("model.layers.1.block_sparse_moe.experts.3.w2.weight");
  CHECK_THROWS_WITH_AS(from_hf(hbad, m, V, Vp),
                       doctest::Contains("tensor model.layers.1.block_sparse_moe.experts.3.w2.weight (shape (16, 12)) is "
                                         "missing from the Hugging Face checkpoint; is it a mixtral model with the config's 2 "
                                         "layers and 4 experts?"),
                       Error);
  hbad = hf;
  hbad["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = hf.at("model.layers.0.block_sparse_moe.experts.3.w1.weight");
  CHECK_THROWS_WITH_AS(from_hf(hbad, m, V, Vp),
                       doctest::Contains("tensors that a mixtral model with this config does not have: "
                                         "model.layers.0.block_sparse_moe.experts.4.w1.weight"),
                       Error);
}

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
