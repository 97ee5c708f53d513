// Hugging Face <-> mpigpt tensor mapping and model directories. One table of links (HF tensor =
// a row block of one of our tensors, possibly transposed) drives both directions.
#include "io/formats/hf_format.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/formats/hf_resolve.h"
#include "lib/core/error.h"
#include "lib/core/new_file.h"

namespace mpigpt {

using hf_detail::check_vocab;
using hf_detail::moe_layer_flags;
using hf_detail::resolved;
using hf_detail::resolved_for_hf;

namespace {

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
      if (m.qkv_bias) {  // Qwen2
        add(h + "self_attn.q_proj.bias", p + "attn.qkv.bias", 0, q);
        add(h + "self_attn.k_proj.bias", p + "attn.qkv.bias", q, kv);
        add(h + "self_attn.v_proj.bias", p + "attn.qkv.bias", q + kv, kv);
      }
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
  return m.family == "gpt2" ? "gpt2" : m.num_experts > 0 ? "mixtral" : m.qkv_bias ? "qwen2" : "llama";
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
    if (g || m.qkv_bias) t.push_back({p + "attn.qkv.bias", {q + 2 * kv}});
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

void grow_vocab(TensorMap& ours, int vocab, int new_vocab, int padded_vocab, const std::string& source) {
  if (new_vocab < vocab)
    fail("model.vocab_size = {} is smaller than the {} words of {}: a vocabulary cannot shrink; leave "
         "model.vocab_size out, or give {} or more for a tokenizer with added tokens", new_vocab, vocab, source, vocab);
  check_vocab(new_vocab, padded_vocab, "grow_vocab");
  repad_vocab(ours, vocab, vocab);  // exactly the words' rows (any padding checked zero)
  for (const char* name : {"embedding.word.weight", "lm_head.weight"}) {
    auto it = ours.find(name);
    if (it == ours.end()) continue;
    HostTensor& t = it->second;
    const int64_t C = t.shape[1];
    std::vector<double> mean(size_t(C), 0.0);
    for (int64_t r = 0; r < vocab; ++r)
      for (int64_t c = 0; c < C; ++c) mean[size_t(c)] += t.data[size_t(r * C + c)];
    t.data.resize(size_t(int64_t(padded_vocab) * C), 0.0f);
    for (int64_t r = vocab; r < new_vocab; ++r)
      for (int64_t c = 0; c < C; ++c) t.data[size_t(r * C + c)] = float(mean[size_t(c)] / vocab);
    t.shape = Shape{padded_vocab, C};
  }
}

void save_hf_model(const std::string& dir, const TensorMap& ours, const ModelConfig& m, int vocab,
                   uint64_t shard_bytes) {
  const TensorMap hf = to_hf(ours, m, vocab);
  save_safetensors_model(dir, hf, shard_bytes);
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  NewFile out(path);
  out.write(hf_config(m, vocab).dump(2) + "\n");
  out.commit();
}

TensorMap load_hf_model(const std::string& dir, const ModelConfig& m, int vocab, int padded_vocab) {
  return from_hf(load_safetensors_model(dir), m, vocab, padded_vocab);
}

}  // namespace mpigpt
