// Hugging Face config.json both ways: what we write for GPT-2, Llama, Qwen2 and Mixtral, the hub's own
// configs read back, transformers' defaults for what a config leaves out, and errors naming the field.
#include <doctest/doctest.h>

#include "io/formats/hf_format.h"
#include "io/formats/hf_testing.h"
#include "lib/core/error.h"

using namespace mpigpt;
using namespace mpigpt::testing;
using nlohmann::json;

namespace {

json with(json base, const char* key, json value) {
  base[key] = std::move(value);
  return base;
}

void fails(const json& j, const char* what) {
  CAPTURE(what);
  CHECK_THROWS_WITH_AS(model_config_from_hf(j, nullptr, "x/config.json"), doctest::Contains(what), Error);
}

}  // namespace

TEST_CASE("hf: config.json written for GPT-2, Llama and Mixtral") {
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
}

TEST_CASE("hf: config.json of GPT-2 and Llama read, unsupported fields refused") {
  const json g = hf_config(tiny_gpt2(), 50257);
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
}

TEST_CASE("hf: config.json of Mixtral read, with transformers' defaults") {
  // The hub's config of mistralai/Mixtral-8x7B-v0.1.
  const json mx = json::parse(R"({"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": true,
    "vocab_size": 32000})");
  int vocab = 0;
  ModelConfig m = model_config_from_hf(mx, &vocab);
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

TEST_CASE("hf: config.json of Qwen2 and Mistral read; q/k/v biases written as Qwen2") {
  // The hub's configs of Qwen/Qwen2.5-0.5B and mistralai/Mistral-7B-v0.3.
  const json qw = json::parse(R"({"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  int vocab = 0;
  ModelConfig m = model_config_from_hf(qw, &vocab);
  CHECK(vocab == 151936);
  CHECK(m.family == "llama");
  CHECK(m.qkv_bias);
  CHECK(m.num_kv_heads == 2);
  CHECK(m.tie_embeddings);
  CHECK(m.rope_theta == 1e6);
  CHECK(m.norm_eps == 1e-6);
  CHECK(m.max_position == 32768);
  json bare = qw;  // Qwen2Config's defaults
  for (const char* k : {"rope_theta", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"}) bare.erase(k);
  m = model_config_from_hf(bare);
  CHECK(m.rope_theta == 10000.0);
  CHECK(m.max_position == 32768);
  CHECK_FALSE(m.tie_embeddings);
  fails(with(qw, "use_sliding_window", true), "x/config.json: field \"use_sliding_window\" = true is not supported");
  fails(with(qw, "layer_types", {"full_attention", "sliding_attention"}), "field \"layer_types\" = \"sliding_attention\"");
  CHECK(model_config_from_hf(with(qw, "layer_types", {"full_attention", "full_attention"})).qkv_bias);

  const json mi = json::parse(R"({"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 32768})");
  m = model_config_from_hf(mi, &vocab);
  CHECK(vocab == 32768);
  CHECK(m.family == "llama");
  CHECK_FALSE(m.qkv_bias);
  CHECK(m.num_kv_heads == 8);
  CHECK(m.rope_theta == 1e6);
  // Mistral 7B v0.1 attends within a window of 4096, and MistralConfig's default is that window.
  fails(with(mi, "sliding_window", 4096), "field \"sliding_window\" = 4096 is not supported: mpigpt's attention is full");
  json no_window = mi;
  no_window.erase("sliding_window");
  fails(no_window, "field \"sliding_window\" = 4096");

  // Ours with q/k/v biases is Qwen2, and reads back as it was.
  const json q = hf_config(tiny_qwen2(), 37);
  CHECK(q["model_type"] == "qwen2");
  CHECK(q["architectures"] == json({"Qwen2ForCausalLM"}));
  CHECK(q["use_sliding_window"] == false);
  CHECK(q["tie_word_embeddings"] == true);
  m = model_config_from_hf(q);
  CHECK(m.qkv_bias);
  CHECK(m.num_kv_heads == 2);
  CHECK(m.ffn_hidden == 24);
  CHECK(m.rope_theta == 500000.0);
  ModelConfig moe = tiny_mixtral();
  moe.qkv_bias = true;
  CHECK_THROWS_WITH_AS(hf_config(moe, 37), doctest::Contains("model.qkv_bias = true: MixtralForCausalLM"), Error);
  ModelConfig gpt2 = tiny_gpt2();
  gpt2.qkv_bias = true;
  CHECK_THROWS_WITH_AS(hf_config(gpt2, 37), doctest::Contains("model.qkv_bias = true is for model.family = llama"),
                       Error);
}
