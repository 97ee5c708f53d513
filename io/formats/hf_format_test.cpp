// Hugging Face tensors: our table agrees with lib/model's, ours -> HF -> ours is bit-identical for
// GPT-2, Llama and Mixtral, model directories, and errors that name the tensor or field (MoE
// models Mixtral cannot represent among them).
#include "io/formats/hf_format.h"

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>

#include "io/formats/hf_testing.h"
#include "io/io_testing.h"
#include "lib/core/error.h"
#include "lib/model/params.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

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

TEST_CASE("hf: a grown vocabulary keeps the rows, gives new words the mean row, and never shrinks") {
  const int V = 37, Vp = 64;
  const TensorMap orig = random_ours(tiny_llama(), V, Vp, 9);
  TensorMap ours = orig;
  grow_vocab(ours, V, 45, 128, "the test model");
  for (const char* name : {"embedding.word.weight", "lm_head.weight"}) {
    CAPTURE(name);
    const HostTensor& a = orig.at(name);
    const HostTensor& b = ours.at(name);
    REQUIRE(b.shape == Shape{128, 16});
    for (int64_t i = 0; i < V * 16; ++i) REQUIRE(b.data[size_t(i)] == a.data[size_t(i)]);
    for (int64_t c = 0; c < 16; ++c) {
      double mean = 0;
      for (int64_t r = 0; r < V; ++r) mean += a.data[size_t(r * 16 + c)];
      for (int64_t r = V; r < 45; ++r) CHECK(b.data[size_t(r * 16 + c)] == float(mean / V));
      for (int64_t r = 45; r < 128; ++r) CHECK(b.data[size_t(r * 16 + c)] == 0.0f);
    }
  }
  ours = orig;
  grow_vocab(ours, V, V, Vp, "the test model");  // the same size: a re-pad
  check_bit_identical(orig, ours);
  CHECK_THROWS_WITH_AS(grow_vocab(ours, V, 30, Vp, "hf_dir"),
                       doctest::Contains("model.vocab_size = 30 is smaller than the 37 words of hf_dir"), Error);
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
