// Hugging Face config.json <-> our ModelConfig, and the check of which of our models a Hugging Face
// class can hold (hf_resolve.h), which the tensor mapping shares.
#include "io/formats/hf_format.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/formats/hf_resolve.h"
#include "lib/core/error.h"

namespace mpigpt {

using nlohmann::json;

namespace hf_detail {

ModelConfig resolved(const ModelConfig& in) {
  Config c;
  c.model = in;
  c.user_set.insert("model.tie_embeddings");  // keep the caller's tying
  c.resolve_defaults();
  ModelConfig& m = c.model;
  if (m.family != "gpt2" && m.family != "llama")
    fail("model.family = '{}' has no Hugging Face mapping; use gpt2 or llama", m.family);
  if (m.num_layers <= 0 || m.hidden <= 0 || m.num_heads <= 0 || m.ffn_hidden <= 0)
    fail("model: num_layers {}, hidden {}, num_heads {}, ffn_hidden {} must all be positive", m.num_layers, m.hidden,
         m.num_heads, m.ffn_hidden);
  if (m.hidden % m.num_heads != 0)
    fail("model.hidden = {} is not a multiple of model.num_heads = {}", m.hidden, m.num_heads);
  if (m.num_kv_heads <= 0 || m.num_heads % m.num_kv_heads != 0)
    fail("model.num_kv_heads = {} must divide model.num_heads = {}", m.num_kv_heads, m.num_heads);
  if (m.family == "gpt2" && m.qkv_bias)
    fail("model.qkv_bias = true is for model.family = llama; GPT-2 has a bias on every projection already");
  if (m.family == "gpt2" && m.num_kv_heads != m.num_heads)
    fail("model.num_kv_heads = {} differs from num_heads = {}: GPT2LMHeadModel has no grouped-query attention; "
         "use family llama or num_kv_heads = num_heads", m.num_kv_heads, m.num_heads);
  if (m.num_experts < 0) fail("model.num_experts = {} must be 0 (dense) or positive", m.num_experts);
  if (m.num_experts > 0) {
    if (m.moe_ffn_hidden == 0) m.moe_ffn_hidden = m.ffn_hidden;  // as make_dims resolves it
    if (m.moe_ffn_hidden < 0) fail("model.moe_ffn_hidden = {} must be positive (or 0: = ffn_hidden)", m.moe_ffn_hidden);
    if (m.moe_shared_expert_ffn < 0)
      fail("model.moe_shared_expert_ffn = {} must be 0 (none) or positive", m.moe_shared_expert_ffn);
    if (m.moe_top_k < 1 || m.moe_top_k > m.num_experts)
      fail("model.moe_top_k = {} must be between 1 and model.num_experts = {}", m.moe_top_k, m.num_experts);
  }
  return c.model;
}

std::vector<bool> moe_layer_flags(const ModelConfig& m) {
  if (m.num_experts <= 0) return std::vector<bool>(size_t(m.num_layers), false);
  return parse_moe_layers(m.moe_layers, m.num_layers);
}

ModelConfig resolved_for_hf(const ModelConfig& in) {
  const ModelConfig m = resolved(in);
  if (m.num_experts == 0) return m;
  const char* not_mixtral = "MixtralForCausalLM (the Hugging Face mixture-of-experts model mpigpt writes)";
  if (m.family != "llama")
    fail("model.num_experts = {} with model.family = {}: Hugging Face has no GPT-2 mixture-of-experts model (mpigpt "
         "writes MoE models as the llama-family MixtralForCausalLM); keep the mpigpt checkpoint, or train with "
         "model.family = llama to export", m.num_experts, m.family);
  if (m.moe_router != "softmax")
    fail("model.moe_router = '{}': {} routes with a softmax over all experts; train with model.moe_router = softmax "
         "to export", m.moe_router, not_mixtral);
  if (!m.moe_norm_topk_prob)
    fail("model.moe_norm_topk_prob = false: {} renormalises the top-k router weights to sum 1 (also for top-1, where "
         "the weight becomes 1); train with model.moe_norm_topk_prob = true to export", not_mixtral);
  const std::vector<bool> moe = moe_layer_flags(m);
  if (const auto dense = std::find(moe.begin(), moe.end(), false); dense != moe.end())
    fail("model.moe_layers = '{}' leaves layer {} dense: every layer of {} is a mixture of experts; train with "
         "model.moe_layers = all to export", m.moe_layers, dense - moe.begin(), not_mixtral);
  if (m.moe_shared_expert_ffn > 0)
    fail("model.moe_shared_expert_ffn = {}: {} has no shared expert; train with model.moe_shared_expert_ffn = 0 to "
         "export", m.moe_shared_expert_ffn, not_mixtral);
  if (m.qkv_bias)
    fail("model.qkv_bias = true: {} has no bias on its query, key and value projections; train with "
         "model.qkv_bias = false to export", not_mixtral);
  return m;
}

void check_vocab(int vocab, int padded_vocab, const char* fn) {
  if (vocab <= 0) fail("{}: vocabulary size {} must be positive", fn, vocab);
  if (padded_vocab < vocab) fail("{}: padded vocabulary {} is smaller than the vocabulary {}", fn, padded_vocab, vocab);
}

}  // namespace hf_detail

using hf_detail::check_vocab;
using hf_detail::resolved_for_hf;

json hf_config(const ModelConfig& in, int vocab) {
  const ModelConfig m = resolved_for_hf(in);
  check_vocab(vocab, vocab, "hf_config");
  const int maxT = m.max_position;
  if (m.family == "gpt2") {
    json j = {{"architectures", {"GPT2LMHeadModel"}},
              {"model_type", "gpt2"},
              {"vocab_size", vocab},
              {"n_positions", maxT},
              {"n_ctx", maxT},
              {"n_embd", m.hidden},
              {"n_layer", m.num_layers},
              {"n_head", m.num_heads},
              {"n_inner", m.ffn_hidden == 4 * m.hidden ? json(nullptr) : json(m.ffn_hidden)},
              {"activation_function", "gelu_new"},
              {"layer_norm_epsilon", m.norm_eps},
              {"initializer_range", m.init_std},
              {"resid_pdrop", 0.0},
              {"embd_pdrop", 0.0},
              {"attn_pdrop", 0.0},
              {"scale_attn_weights", true},
              {"tie_word_embeddings", m.tie_embeddings},
              {"use_cache", true},
              {"torch_dtype", "float32"}};
    if (vocab == 50257) j["bos_token_id"] = j["eos_token_id"] = 50256;  // GPT-2's <|endoftext|>
    return j;
  }
  if (m.num_experts > 0)
    return {{"architectures", {"MixtralForCausalLM"}},
            {"model_type", "mixtral"},
            {"vocab_size", vocab},
            {"hidden_size", m.hidden},
            {"intermediate_size", m.moe_ffn_hidden},  // per expert
            {"num_hidden_layers", m.num_layers},
            {"num_attention_heads", m.num_heads},
            {"num_key_value_heads", m.num_kv_heads},
            {"head_dim", m.hidden / m.num_heads},
            {"num_local_experts", m.num_experts},
            {"num_experts_per_tok", m.moe_top_k},
            {"router_aux_loss_coef", m.moe_aux_loss_coeff},
            {"output_router_logits", false},
            {"router_jitter_noise", 0.0},
            {"max_position_embeddings", maxT},
            {"rms_norm_eps", m.norm_eps},
            {"rope_theta", m.rope_theta},
            {"sliding_window", nullptr},
            {"hidden_act", "silu"},
            {"attention_dropout", 0.0},
            {"initializer_range", m.init_std},
            {"tie_word_embeddings", m.tie_embeddings},
            {"use_cache", true},
            {"torch_dtype", "float32"}};
  json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"vocab_size", vocab},
            {"hidden_size", m.hidden},
            {"intermediate_size", m.ffn_hidden},
            {"num_hidden_layers", m.num_layers},
            {"num_attention_heads", m.num_heads},
            {"num_key_value_heads", m.num_kv_heads},
            {"head_dim", m.hidden / m.num_heads},
            {"max_position_embeddings", maxT},
            {"rms_norm_eps", m.norm_eps},
            {"rope_theta", m.rope_theta},
            {"rope_scaling", nullptr},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"mlp_bias", false},
            {"initializer_range", m.init_std},
            {"tie_word_embeddings", m.tie_embeddings},
            {"use_cache", true},
            {"torch_dtype", "float32"}};
  if (!m.qkv_bias) return j;
  // Qwen2: Llama with biased q/k/v projections (Llama's attention_bias would bias o_proj too).
  for (const char* k : {"head_dim", "attention_bias", "mlp_bias"}) j.erase(k);
  j["architectures"] = {"Qwen2ForCausalLM"}, j["model_type"] = "qwen2";
  j["use_sliding_window"] = false, j["sliding_window"] = nullptr, j["max_window_layers"] = m.num_layers;
  return j;
}

namespace {

struct Fields {
  const json& j;
  const std::string& where;
  bool has(const char* k) const { return j.contains(k) && !j[k].is_null(); }
  int integer(const char* k) const {
    if (!has(k)) fail("{}: field \"{}\" is missing; it is required for this model_type", where, k);
    if (!j[k].is_number_integer() || j[k].get<int64_t>() <= 0 || j[k].get<int64_t>() > (int64_t(1) << 30))
      fail("{}: field \"{}\" = {} is not a positive integer", where, k, j[k].dump());
    return j[k].get<int>();
  }
  int integer(const char* k, int def) const { return has(k) ? integer(k) : def; }
  double number(const char* k, double def) const {
    if (!has(k)) return def;
    if (!j[k].is_number() || j[k].get<double>() <= 0) fail("{}: field \"{}\" = {} is not a positive number", where, k, j[k].dump());
    return j[k].get<double>();
  }
  double nonnegative(const char* k, double def) const {
    if (!has(k)) return def;
    if (!j[k].is_number() || j[k].get<double>() < 0)
      fail("{}: field \"{}\" = {} is not a number >= 0", where, k, j[k].dump());
    return j[k].get<double>();
  }
  bool boolean(const char* k, bool def) const {
    if (!has(k)) return def;
    if (!j[k].is_boolean()) fail("{}: field \"{}\" = {} is not true or false", where, k, j[k].dump());
    return j[k].get<bool>();
  }
  std::string text(const char* k, const std::string& def) const {
    if (!has(k)) return def;
    if (!j[k].is_string()) fail("{}: field \"{}\" = {} is not a string", where, k, j[k].dump());
    return j[k].get<std::string>();
  }
  void require(const char* k, bool ok, const std::string& value, const char* why) const {
    if (!ok) fail("{}: field \"{}\" = {} is not supported: {}", where, k, value, why);
  }
};

// GPT2LMHeadModel's fields.
void gpt2_from_hf(const Fields& f, ModelConfig& m) {
  m.family = "gpt2";
  m.hidden = f.integer("n_embd");
  m.num_layers = f.integer("n_layer");
  m.num_heads = f.integer("n_head");
  m.num_kv_heads = m.num_heads;
  m.ffn_hidden = f.integer("n_inner", 4 * m.hidden);
  m.max_position = f.integer("n_positions", f.integer("n_ctx", 1024));
  m.seq_len = m.max_position;
  m.norm_eps = f.number("layer_norm_epsilon", 1e-5);
  m.tie_embeddings = f.boolean("tie_word_embeddings", true);
  const std::string act = f.text("activation_function", "gelu_new");
  f.require("activation_function", act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast",
            "\"" + act + "\"", "mpigpt's GPT-2 uses GELU with the tanh approximation (gelu_new)");
  f.require("scale_attn_weights", f.boolean("scale_attn_weights", true), "false", "attention is scaled by 1/sqrt(HD)");
  f.require("scale_attn_by_inverse_layer_idx", !f.boolean("scale_attn_by_inverse_layer_idx", false), "true",
            "attention is not scaled by the layer index");
  f.require("add_cross_attention", !f.boolean("add_cross_attention", false), "true", "decoder-only models only");
}

// The sliding window of Mistral, Mixtral and Qwen2: refused, as mpigpt's attention is full causal.
void no_sliding_window(const Fields& f, const std::string& type) {
  const char* fix = "mpigpt's attention is full causal, without a sliding window (a window at least as long as every "
                    "sequence you run changes nothing: then set it to null)";
  if (type == "qwen2") {  // the window applies only with use_sliding_window (off in every released Qwen2)
    f.require("use_sliding_window", !f.boolean("use_sliding_window", false), "true", fix);
    if (f.has("layer_types"))  // transformers >= 4.53 spells the layers out
      for (const json& t : f.j["layer_types"])
        f.require("layer_types", t == "full_attention", t.dump(), fix);
    return;
  }
  // A missing field is MixtralConfig's default, no window, but MistralConfig's, a window of 4096.
  const bool none = !f.has("sliding_window") && (type == "mixtral" || f.j.contains("sliding_window"));
  f.require("sliding_window", none, f.j.value("sliding_window", json(4096)).dump(), fix);
}

// LlamaForCausalLM's fields. MistralForCausalLM is Llama with a sliding window (none in Mistral
// 7B v0.2 on), Qwen2ForCausalLM Llama with biased q/k/v projections, and MixtralForCausalLM Llama
// with every MLP a mixture of experts (modeling_mistral.py, modeling_qwen2.py, modeling_mixtral.py).
void llama_from_hf(const Fields& f, const std::string& type, ModelConfig& m) {
  const json& j = f.j;
  const std::string& where = f.where;
  const bool mixtral = type == "mixtral";
  m.family = "llama";
  m.qkv_bias = type == "qwen2";
  m.hidden = f.integer("hidden_size");
  m.num_layers = f.integer("num_hidden_layers");
  m.num_heads = f.integer("num_attention_heads");
  m.num_kv_heads = f.integer("num_key_value_heads", m.num_heads);
  m.ffn_hidden = f.integer("intermediate_size");
  // transformers' defaults: LlamaConfig 2048 / 1e-6 / 1e4, MixtralConfig 4096 * 32 / 1e-5 / 1e6,
  // MistralConfig 4096 * 32 / 1e-6 / 1e4, Qwen2Config 32768 / 1e-6 / 1e4.
  m.max_position = f.integer("max_position_embeddings", type == "llama" ? 2048 : type == "qwen2" ? 32768 : 4096 * 32);
  m.seq_len = std::min(m.max_position, 2048);
  m.norm_eps = f.number("rms_norm_eps", mixtral ? 1e-5 : 1e-6);
  m.rope_theta = f.number("rope_theta", mixtral ? 1e6 : 10000.0);
  m.tie_embeddings = f.boolean("tie_word_embeddings", false);
  const std::string act = f.text("hidden_act", "silu");
  f.require("hidden_act", act == "silu", "\"" + act + "\"", "the MLP is SwiGLU (silu)");
  f.require("attention_bias", !f.boolean("attention_bias", false), "true",
            "Llama's attention_bias also biases o_proj, which mpigpt's llama family has not (Qwen2's q/k/v biases "
            "are read as model_type qwen2)");
  f.require("mlp_bias", !f.boolean("mlp_bias", false), "true", "Llama projections have no bias");
  if (type != "llama") no_sliding_window(f, type);
  if (f.has("head_dim"))
    f.require("head_dim", f.integer("head_dim") * m.num_heads == m.hidden, j["head_dim"].dump(),
              "the head size must be hidden_size / num_attention_heads");
  // transformers >= 5 moves rope_theta into rope_parameters.
  for (const char* k : {"rope_scaling", "rope_parameters"}) {
    if (!f.has(k)) continue;
    const json& r = j[k];
    const char* tk = r.is_object() && r.contains("rope_type") ? "rope_type" : "type";  // older configs: "type"
    const bool plain = r.is_object() && (r.contains(tk) ? r[tk] == "default" : !r.contains("factor"));
    f.require(k, plain, r.dump(),
              "only plain RoPE (no scaling: linear, dynamic, yarn, llama3) is implemented");
    if (r.contains("rope_theta")) m.rope_theta = Fields{r, where}.number("rope_theta", m.rope_theta);
  }
  if (mixtral) {
    m.num_experts = f.integer("num_local_experts", 8);
    m.moe_top_k = f.integer("num_experts_per_tok", 2);
    if (m.moe_top_k > m.num_experts)
      fail("{}: num_experts_per_tok = {} exceeds num_local_experts = {}", where, m.moe_top_k, m.num_experts);
    m.moe_ffn_hidden = m.ffn_hidden;  // intermediate_size is per expert; no layer is dense
    m.moe_router = "softmax";
    m.moe_norm_topk_prob = true;
    m.moe_layers = "all";
    m.moe_shared_expert_ffn = 0;
    m.moe_capacity_factor = 0.0;  // dropless, as Mixtral routes
    m.moe_z_loss_coeff = 0.0;
    m.moe_aux_loss_coeff = f.nonnegative("router_aux_loss_coef", 0.001);
  }
}

}  // namespace

ModelConfig model_config_from_hf(const json& j, int* vocab, const std::string& where) {
  if (!j.is_object()) fail("{}: not a JSON object", where);
  const Fields f{j, where};
  const std::string type = f.text("model_type", "");
  ModelConfig m;
  if (type == "gpt2") {
    gpt2_from_hf(f, m);
  } else if (type == "llama" || type == "mixtral" || type == "mistral" || type == "qwen2") {
    llama_from_hf(f, type, m);
  } else if (type == "qwen2_moe" || type == "deepseek_v2") {
    fail("{}: model_type \"{}\" is a mixture-of-experts model mpigpt does not read (shared experts, its own "
         "routing); mpigpt reads mixture-of-experts checkpoints as mixtral (MixtralForCausalLM)", where, type);
  } else {
    fail("{}: model_type \"{}\" is not supported; mpigpt reads gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM), "
         "mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM) and mixtral (MixtralForCausalLM)", where, type);
  }
  m.vocab_size = f.integer("vocab_size");
  if (f.has("initializer_range")) m.init_std = f.number("initializer_range", m.init_std);
  if (m.hidden % m.num_heads != 0)
    fail("{}: hidden size {} is not a multiple of the {} attention heads", where, m.hidden, m.num_heads);
  if (m.num_heads % m.num_kv_heads != 0)
    fail("{}: num_key_value_heads = {} does not divide num_attention_heads = {}", where, m.num_kv_heads, m.num_heads);
  if (vocab) *vocab = m.vocab_size;
  return m;
}

ModelConfig read_hf_config(const std::string& dir, int* vocab) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) fail("cannot open {}: {}; a Hugging Face model directory holds config.json beside its weights", path,
                std::strerror(errno));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("{} is not valid JSON: {}", path, e.what());
  }
  return model_config_from_hf(j, vocab, path);
}

}  // namespace mpigpt
