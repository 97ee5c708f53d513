// Hugging Face <-> mpigpt tensor mapping and config.json translation. One table of links (HF
// tensor = a row block of one of our tensors, possibly transposed) drives both directions.
#include "io/formats/hf_format.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "lib/core/error.h"

namespace mpigpt {

using nlohmann::json;

namespace {

// `m` with the derived defaults filled in and checked for what the parameter table relies on.
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

// Whether layer l of the resolved `m` is a mixture-of-experts layer (lib/model's GptDims::is_moe).
std::vector<bool> moe_layer_flags(const ModelConfig& m) {
  if (m.num_experts <= 0) return std::vector<bool>(size_t(m.num_layers), false);
  return parse_moe_layers(m.moe_layers, m.num_layers);
}

// resolved(in), refusing what the Hugging Face classes cannot represent. Dense models map to
// GPT2LMHeadModel / LlamaForCausalLM; llama-family MoE models to MixtralForCausalLM, whose every
// layer is a softmax-routed MoE with renormalised top-k weights and no shared expert. Capacity
// and the aux/z-loss coefficients change training only, not the function the weights compute.
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
  return m;
}

// One HF tensor: rows [row0, row0 + rows) of our tensor `ours`, transposed for GPT-2's Conv1D.
// A 3-D expert tensor (E, rows, cols) is seen as its (E * rows, cols) row view, so expert e's
// block of it is rows [e * rows + r0, ...). Renames, row splits and transposes only, so a round
// trip is bit-identical.
struct Link {
  std::string hf, ours;
  int64_t row0 = 0, rows = 0;
  bool transpose = false;
  bool vocab = false;  // rows = the vocabulary; our tensor has padded rows beyond
};

// Columns of our tensor's row view: the last dimension (1 for a vector).
int64_t row_cols(const Shape& s) { return s.ndim >= 2 ? s[-1] : 1; }

Shape hf_shape(const Link& l, const Shape& ours) {
  if (ours.ndim == 1) return Shape{l.rows};
  return l.transpose ? Shape{row_cols(ours), l.rows} : Shape{l.rows, row_cols(ours)};
}

std::vector<Link> links(const ModelConfig& m, int vocab) {
  std::vector<Link> out;
  const int64_t C = m.hidden, HD = C / m.num_heads, q = m.num_heads * HD, kv = m.num_kv_heads * HD;
  const int64_t F = m.ffn_hidden;
  auto add = [&](std::string hf, std::string ours, int64_t row0, int64_t rows, bool t = false, bool v = false) {
    out.push_back({std::move(hf), std::move(ours), row0, rows, t, v});
  };
  if (m.family == "gpt2") {
    const int64_t maxT = m.max_position > 0 ? m.max_position : m.seq_len;
    add("transformer.wte.weight", "embedding.word.weight", 0, vocab, false, true);
    add("transformer.wpe.weight", "embedding.position.weight", 0, maxT);
    for (int l = 0; l < m.num_layers; ++l) {
      const std::string h = "transformer.h." + std::to_string(l) + ".", p = "layers." + std::to_string(l) + ".";
      add(h + "ln_1.weight", p + "attn_norm.weight", 0, C);
      add(h + "ln_1.bias", p + "attn_norm.bias", 0, C);
      add(h + "attn.c_attn.weight", p + "attn.qkv.weight", 0, q + 2 * kv, true);
      add(h + "attn.c_attn.bias", p + "attn.qkv.bias", 0, q + 2 * kv);
      add(h + "attn.c_proj.weight", p + "attn.proj.weight", 0, C, true);
      add(h + "attn.c_proj.bias", p + "attn.proj.bias", 0, C);
      add(h + "ln_2.weight", p + "mlp_norm.weight", 0, C);
      add(h + "ln_2.bias", p + "mlp_norm.bias", 0, C);
      add(h + "mlp.c_fc.weight", p + "mlp.fc.weight", 0, F, true);
      add(h + "mlp.c_fc.bias", p + "mlp.fc.bias", 0, F);
      add(h + "mlp.c_proj.weight", p + "mlp.proj.weight", 0, C, true);
      add(h + "mlp.c_proj.bias", p + "mlp.proj.bias", 0, C);
    }
    add("transformer.ln_f.weight", "final_norm.weight", 0, C);
    add("transformer.ln_f.bias", "final_norm.bias", 0, C);
  } else {
    // No q/k permutation: HF stores Llama's weights for rotate_half (element i of a head pairs
    // with i + HD/2), which is how our kernels rotate.
    add("model.embed_tokens.weight", "embedding.word.weight", 0, vocab, false, true);
    for (int l = 0; l < m.num_layers; ++l) {
      const std::string h = "model.layers." + std::to_string(l) + ".", p = "layers." + std::to_string(l) + ".";
      add(h + "input_layernorm.weight", p + "attn_norm.weight", 0, C);
      add(h + "self_attn.q_proj.weight", p + "attn.qkv.weight", 0, q);
      add(h + "self_attn.k_proj.weight", p + "attn.qkv.weight", q, kv);
      add(h + "self_attn.v_proj.weight", p + "attn.qkv.weight", q + kv, kv);
      add(h + "self_attn.o_proj.weight", p + "attn.proj.weight", 0, C);
      add(h + "post_attention_layernorm.weight", p + "mlp_norm.weight", 0, C);
      if (m.num_experts > 0) {  // Mixtral: every layer MoE (resolved_for_hf)
        const int64_t Fe = m.moe_ffn_hidden;
        const std::string b = h + "block_sparse_moe.";
        add(b + "gate.weight", p + "mlp.router.weight", 0, m.num_experts);
        for (int64_t e = 0; e < m.num_experts; ++e) {
          const std::string x = b + "experts." + std::to_string(e) + ".";
          add(x + "w1.weight", p + "mlp.experts.fc.weight", e * 2 * Fe, Fe);       // gate rows of [gate; up]
          add(x + "w3.weight", p + "mlp.experts.fc.weight", e * 2 * Fe + Fe, Fe);  // up rows
          add(x + "w2.weight", p + "mlp.experts.proj.weight", e * C, C);           // (C, Fe) down
        }
        continue;
      }
      add(h + "mlp.gate_proj.weight", p + "mlp.fc.weight", 0, F);
      add(h + "mlp.up_proj.weight", p + "mlp.fc.weight", F, F);
      add(h + "mlp.down_proj.weight", p + "mlp.proj.weight", 0, C);
    }
    add("model.norm.weight", "final_norm.weight", 0, C);
  }
  if (!m.tie_embeddings) add("lm_head.weight", "lm_head.weight", 0, vocab, false, true);
  return out;
}

// HF names that hold buffers, not parameters (older checkpoints saved them).
bool ignorable_buffer(const std::string& name) {
  return name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") ||
         name.ends_with(".self_attn.rotary_emb.inv_freq");
}

// The model_type of `m` (resolved) in Hugging Face terms, for messages.
const char* hf_type(const ModelConfig& m) {
  return m.family == "gpt2" ? "gpt2" : m.num_experts > 0 ? "mixtral" : "llama";
}

// The tied head is the embedding's first `vocab` rows, bit for bit.
const char* tied_hf_name(const ModelConfig& m) {
  return m.family == "gpt2" ? "transformer.wte.weight" : "model.embed_tokens.weight";
}

std::string first_few(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 5; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 5) out += fmt::format(" (and {} more)", names.size() - 5);
  return out;
}

void check_vocab(int vocab, int padded_vocab, const char* fn) {
  if (vocab <= 0) fail("{}: vocabulary size {} must be positive", fn, vocab);
  if (padded_vocab < vocab) fail("{}: padded vocabulary {} is smaller than the vocabulary {}", fn, padded_vocab, vocab);
}

}  // namespace

std::vector<std::pair<std::string, Shape>> param_shapes(const ModelConfig& in, int padded_vocab) {
  const ModelConfig m = resolved(in);
  const bool g = m.family == "gpt2";
  const int64_t C = m.hidden, HD = C / m.num_heads, q = m.num_heads * HD, kv = m.num_kv_heads * HD;
  const int64_t F = m.ffn_hidden, Vp = padded_vocab, maxT = m.max_position;
  const std::vector<bool> moe = moe_layer_flags(m);
  std::vector<std::pair<std::string, Shape>> t;
  t.push_back({"embedding.word.weight", {Vp, C}});
  if (g) t.push_back({"embedding.position.weight", {maxT, C}});
  for (int l = 0; l < m.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    t.push_back({p + "attn_norm.weight", {C}});
    if (g) t.push_back({p + "attn_norm.bias", {C}});
    t.push_back({p + "attn.qkv.weight", {q + 2 * kv, C}});
    if (g) t.push_back({p + "attn.qkv.bias", {q + 2 * kv}});
    t.push_back({p + "attn.proj.weight", {C, q}});
    if (g) t.push_back({p + "attn.proj.bias", {C}});
    t.push_back({p + "mlp_norm.weight", {C}});
    if (g) t.push_back({p + "mlp_norm.bias", {C}});
    if (moe[size_t(l)]) {  // experts as one (E, ...) tensor per projection; SwiGLU: [gate; up] rows per expert
      const int64_t E = m.num_experts, Fe = m.moe_ffn_hidden, Fs = m.moe_shared_expert_ffn;
      t.push_back({p + "mlp.router.weight", {E, C}});
      t.push_back({p + "mlp.experts.fc.weight", {E, g ? Fe : 2 * Fe, C}});
      if (g) t.push_back({p + "mlp.experts.fc.bias", {E, Fe}});
      t.push_back({p + "mlp.experts.proj.weight", {E, C, Fe}});
      if (g) t.push_back({p + "mlp.experts.proj.bias", {E, C}});
      if (Fs > 0) {
        t.push_back({p + "mlp.shared.fc.weight", {g ? Fs : 2 * Fs, C}});
        if (g) t.push_back({p + "mlp.shared.fc.bias", {Fs}});
        t.push_back({p + "mlp.shared.proj.weight", {C, Fs}});
        if (g) t.push_back({p + "mlp.shared.proj.bias", {C}});
      }
      continue;
    }
    t.push_back({p + "mlp.fc.weight", {g ? F : 2 * F, C}});
    if (g) t.push_back({p + "mlp.fc.bias", {F}});
    t.push_back({p + "mlp.proj.weight", {C, F}});
    if (g) t.push_back({p + "mlp.proj.bias", {C}});
  }
  t.push_back({"final_norm.weight", {C}});
  if (g) t.push_back({"final_norm.bias", {C}});
  if (!m.tie_embeddings) t.push_back({"lm_head.weight", {Vp, C}});
  return t;
}

TensorMap to_hf(const TensorMap& ours, const ModelConfig& in, int vocab) {
  const ModelConfig m = resolved_for_hf(in);
  check_vocab(vocab, vocab, "to_hf");
  // Our shapes with the vocabulary rows as the tensors have them (any padding >= vocab).
  auto it_wte = ours.find("embedding.word.weight");
  if (it_wte == ours.end()) fail("to_hf: tensor embedding.word.weight is missing");
  const int64_t rows = it_wte->second.shape.ndim == 2 ? it_wte->second.shape[0] : 0;
  if (rows < vocab)
    fail("to_hf: embedding.word.weight has shape {}, fewer rows than the vocabulary {}", it_wte->second.shape.str(),
         vocab);
  const auto shapes = param_shapes(m, int(rows));
  for (const auto& [name, s] : shapes) {
    auto it = ours.find(name);
    if (it == ours.end()) fail("to_hf: tensor {} of shape {} is missing", name, s.str());
    Shape want = s;
    if (name == "lm_head.weight" && it->second.shape.ndim == 2 && it->second.shape[0] >= vocab) want.d[0] = it->second.shape[0];
    if (!(it->second.shape == want))
      fail("to_hf: tensor {} has shape {}, the model config says {}", name, it->second.shape.str(), want.str());
    if (int64_t(it->second.data.size()) != want.numel())
      fail("to_hf: tensor {} holds {} values, its shape {} needs {}", name, it->second.data.size(), want.str(), want.numel());
  }
  if (ours.size() != shapes.size()) {
    std::vector<std::string> extra;
    for (const auto& [name, t] : ours)
      if (std::none_of(shapes.begin(), shapes.end(), [&](const auto& s) { return s.first == name; })) extra.push_back(name);
    fail("to_hf: tensors that are not parameters of this {} model: {}", hf_type(m), first_few(extra));
  }
  TensorMap out;
  for (const Link& l : links(m, vocab)) {
    const HostTensor& src = ours.at(l.ours);
    HostTensor t;
    t.shape = hf_shape(l, src.shape);
    const int64_t cols = row_cols(src.shape);
    const float* from = src.data.data() + l.row0 * cols;
    if (!l.transpose) {
      t.data.assign(from, from + l.rows * cols);
    } else {
      t.data.resize(size_t(l.rows * cols));
      for (int64_t r = 0; r < l.rows; ++r)
        for (int64_t c = 0; c < cols; ++c) t.data[size_t(c * l.rows + r)] = from[r * cols + c];
    }
    out[l.hf] = std::move(t);
  }
  return out;
}

TensorMap from_hf(const TensorMap& hf_in, const ModelConfig& in, int vocab, int padded_vocab) {
  const ModelConfig m = resolved_for_hf(in);
  check_vocab(vocab, padded_vocab, "from_hf");
  // GPT-2 checkpoints saved from GPT2Model (the hub's openai-community/gpt2) lack "transformer.".
  TensorMap renamed;
  const TensorMap* hf = &hf_in;
  if (m.family == "gpt2" && std::any_of(hf_in.begin(), hf_in.end(), [](const auto& kv) {
        return !kv.first.starts_with("transformer.") && kv.first != "lm_head.weight";
      })) {
    for (const auto& [name, t] : hf_in) {
      const std::string n = name.starts_with("transformer.") || name == "lm_head.weight" ? name : "transformer." + name;
      if (renamed.count(n)) fail("from_hf: the checkpoint holds both {} and {}; remove one", name, n);
      renamed[n] = t;
    }
    hf = &renamed;
  }
  const auto shapes = param_shapes(m, padded_vocab);
  TensorMap out;
  for (const auto& [name, s] : shapes) out[name] = HostTensor{s, std::vector<float>(size_t(s.numel()), 0.0f)};
  const std::vector<Link> table = links(m, vocab);
  for (const Link& l : table) {
    auto it = hf->find(l.hf);
    HostTensor& dst = out.at(l.ours);
    const Shape want = hf_shape(l, dst.shape);
    if (it == hf->end())
      fail("from_hf: tensor {} (shape {}) is missing from the Hugging Face checkpoint; is it a {} model with the "
           "config's {} layers{}?", l.hf, want.str(), hf_type(m), m.num_layers,
           m.num_experts > 0 ? fmt::format(" and {} experts", m.num_experts) : std::string());
    const HostTensor& src = it->second;
    if (!(src.shape == want))
      fail("from_hf: tensor {} has shape {}, expected {} from the config (hidden {}, heads {}/{} kv, ffn {}{}, vocab "
           "{}); the config.json does not match the weights", l.hf, src.shape.str(), want.str(), m.hidden, m.num_heads,
           m.num_kv_heads, m.num_experts > 0 ? m.moe_ffn_hidden : m.ffn_hidden,
           m.num_experts > 0 ? fmt::format(", experts {}", m.num_experts) : std::string(), vocab);
    if (int64_t(src.data.size()) != want.numel())
      fail("from_hf: tensor {} holds {} values, its shape {} needs {}", l.hf, src.data.size(), want.str(), want.numel());
    const int64_t cols = row_cols(dst.shape);
    float* to = dst.data.data() + l.row0 * cols;
    if (!l.transpose) {
      std::copy(src.data.begin(), src.data.end(), to);
    } else {
      for (int64_t r = 0; r < l.rows; ++r)
        for (int64_t c = 0; c < cols; ++c) to[r * cols + c] = src.data[size_t(c * l.rows + r)];
    }
  }
  std::vector<std::string> extra;
  for (const auto& [name, t] : *hf) {
    if (ignorable_buffer(name)) continue;
    if (std::any_of(table.begin(), table.end(), [&](const Link& l) { return l.hf == name; })) continue;
    if (name == "lm_head.weight" && m.tie_embeddings) {
      const HostTensor& wte = hf->at(tied_hf_name(m));
      if (!(t.shape == wte.shape) || t.data != wte.data)
        fail("from_hf: lm_head.weight differs from {} but the config ties them (tie_word_embeddings); set "
             "tie_word_embeddings to false in config.json (model.tie_embeddings = false)", tied_hf_name(m));
      continue;
    }
    extra.push_back(name);
  }
  if (!extra.empty())
    fail("from_hf: tensors that a {} model with this config does not have: {}; check model_type and the layer count "
         "in config.json", hf_type(m), first_few(extra));
  return out;
}

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
  return {{"architectures", {"LlamaForCausalLM"}},
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

}  // namespace

ModelConfig model_config_from_hf(const json& j, int* vocab, const std::string& where) {
  if (!j.is_object()) fail("{}: not a JSON object", where);
  const Fields f{j, where};
  const std::string type = f.text("model_type", "");
  ModelConfig m;
  if (type == "gpt2") {
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
  } else if (type == "llama" || type == "mixtral") {
    // MixtralForCausalLM is Llama with every MLP a mixture of experts (modeling_mixtral.py).
    const bool mixtral = type == "mixtral";
    m.family = "llama";
    m.hidden = f.integer("hidden_size");
    m.num_layers = f.integer("num_hidden_layers");
    m.num_heads = f.integer("num_attention_heads");
    m.num_kv_heads = f.integer("num_key_value_heads", m.num_heads);
    m.ffn_hidden = f.integer("intermediate_size");
    // transformers' defaults: LlamaConfig 2048 / 1e-6 / 1e4, MixtralConfig 4096 * 32 / 1e-5 / 1e6.
    m.max_position = f.integer("max_position_embeddings", mixtral ? 4096 * 32 : 2048);
    m.seq_len = std::min(m.max_position, 2048);
    m.norm_eps = f.number("rms_norm_eps", mixtral ? 1e-5 : 1e-6);
    m.rope_theta = f.number("rope_theta", mixtral ? 1e6 : 10000.0);
    m.tie_embeddings = f.boolean("tie_word_embeddings", false);
    const std::string act = f.text("hidden_act", "silu");
    f.require("hidden_act", act == "silu", "\"" + act + "\"", "the MLP is SwiGLU (silu)");
    f.require("attention_bias", !f.boolean("attention_bias", false), "true", "Llama projections have no bias");
    f.require("mlp_bias", !f.boolean("mlp_bias", false), "true", "Llama projections have no bias");
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
      f.require("sliding_window", !f.has("sliding_window"), j.value("sliding_window", json()).dump(),
                "mpigpt's attention is full causal, without a sliding window (a window at least as long as "
                "every sequence you run changes nothing: then set it to null)");
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
  } else if (type == "qwen2_moe" || type == "deepseek_v2") {
    fail("{}: model_type \"{}\" is a mixture-of-experts model mpigpt does not read (shared experts, its own "
         "routing); mpigpt reads mixture-of-experts checkpoints as mixtral (MixtralForCausalLM)", where, type);
  } else {
    fail("{}: model_type \"{}\" is not supported; mpigpt reads gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM) "
         "and mixtral (MixtralForCausalLM)", where, type);
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

void repad_vocab(TensorMap& ours, int vocab, int padded_vocab) {
  check_vocab(vocab, padded_vocab, "repad_vocab");
  for (const char* name : {"embedding.word.weight", "lm_head.weight"}) {
    auto it = ours.find(name);
    if (it == ours.end()) continue;
    HostTensor& t = it->second;
    if (t.shape.ndim != 2 || t.shape[0] < vocab)
      fail("repad_vocab: {} has shape {}; expected (rows >= {}, C)", name, t.shape.str(), vocab);
    const int64_t C = t.shape[1];
    for (int64_t i = std::min<int64_t>(padded_vocab, t.shape[0]) * C; i < int64_t(t.data.size()); ++i)
      if (t.data[size_t(i)] != 0.0f)
        fail("repad_vocab: {} row {} beyond the vocabulary {} is not zero; the vocabulary size {} is too small", name,
             i / C, vocab, vocab);
    t.data.resize(size_t(padded_vocab * C), 0.0f);
    std::fill(t.data.begin() + vocab * C, t.data.end(), 0.0f);  // padding is zero by definition
    t.shape = Shape{padded_vocab, C};
  }
}

void save_hf_model(const std::string& dir, const TensorMap& ours, const ModelConfig& m, int vocab,
                   uint64_t shard_bytes) {
  const TensorMap hf = to_hf(ours, m, vocab);
  save_safetensors_model(dir, hf, shard_bytes);
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  std::ofstream out(path, std::ios::trunc);
  out << hf_config(m, vocab).dump(2) << "\n";
  out.close();
  if (!out) fail("writing {} failed: {} (disk full?)", path, std::strerror(errno));
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

TensorMap load_hf_model(const std::string& dir, const ModelConfig& m, int vocab, int padded_vocab) {
  return from_hf(load_safetensors_model(dir), m, vocab, padded_vocab);
}

}  // namespace mpigpt
