// Configuration: the one option table (name, binding and description of every field) and what
// derives from it besides parsing and validation: text conversion, to_ini(), family defaults and
// option-name resolution with "did you mean" hints.
#include "io/config/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "lib/core/error.h"

namespace mpigpt {
namespace {

enum class Kind { Bool, Int, Int64, UInt64, Double, String };

// A field reached through pointers to members: ref() finds it in any Config, so the table is the
// only place that names a field besides its declaration.
struct Row {
  ConfigOption opt;
  Kind kind;
  void* (*ref)(Config&);
};

template <class T>
constexpr Kind kind_of() {
  if constexpr (std::is_same_v<T, bool>) return Kind::Bool;
  else if constexpr (std::is_same_v<T, int>) return Kind::Int;
  else if constexpr (std::is_same_v<T, int64_t>) return Kind::Int64;
  else if constexpr (std::is_same_v<T, uint64_t>) return Kind::UInt64;
  else if constexpr (std::is_same_v<T, double>) return Kind::Double;
  else {
    static_assert(std::is_same_v<T, std::string>, "config fields are bool, int, int64, uint64, double or string");
    return Kind::String;
  }
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Int64: return "int64";
    case Kind::UInt64: return "uint64";
    case Kind::Double: return "double";
    case Kind::String: return "string";
  }
  return "?";
}

template <auto Section, auto Field>
Row row(const char* section, const char* key, const char* description,
        std::vector<std::string> aliases = {}) {
  using T = std::remove_cvref_t<decltype((std::declval<Config&>().*Section).*Field)>;
  constexpr Kind k = kind_of<T>();
  return Row{ConfigOption{section, key, kind_name(k), description, std::move(aliases)}, k,
             [](Config& c) -> void* { return &((c.*Section).*Field); }};
}

// The section and key are written once, as tokens, so a misspelt field does not compile.
#define MPIGPT_OPTION(sec, key, ...) \
  row<&Config::sec, &decltype(Config::sec)::key>(#sec, #key, __VA_ARGS__)

// Descriptions are the field comments of io/config/config.h word for word (config_test checks it);
// aliases are Megatron-LM's flag names, offered as hints to its users and never accepted.
const std::vector<Row>& rows() {
  static const std::vector<Row> table = {
      MPIGPT_OPTION(parallel, tp, "tensor-parallel size (heads and MLP split over tp ranks)", {"tensor_model_parallel_size"}),
      MPIGPT_OPTION(parallel, pp, "pipeline-parallel stages", {"pipeline_model_parallel_size"}),
      MPIGPT_OPTION(parallel, vpp, "virtual stages (model chunks) per pipeline rank; >1 = interleaved 1F1B", {"virtual_pipeline_model_parallel_size"}),
      MPIGPT_OPTION(parallel, pipeline_layout, "layers per virtual stage in stage order, e.g. 5,7,7,5 (empty: even)"),
      MPIGPT_OPTION(parallel, cp, "context-parallel size (sequence split over cp ranks)", {"context_parallel_size"}),
      MPIGPT_OPTION(parallel, cp_comm_type, "context-parallel attention: p2p (ring) | all_gather"),
      MPIGPT_OPTION(parallel, ep, "expert-parallel size", {"expert_model_parallel_size"}),
      MPIGPT_OPTION(parallel, expert_tp, "tensor-parallel size inside the expert grid", {"expert_tensor_parallel_size"}),
      MPIGPT_OPTION(parallel, sequence_parallel, "shard norms/residual over T within the tp group"),
      MPIGPT_OPTION(parallel, moe_dispatcher, "MoE token dispatcher: alltoall | allgather", {"moe_token_dispatcher_type"}),
      MPIGPT_OPTION(parallel, order, "rank-grid order, leftmost axis varies fastest"),

      MPIGPT_OPTION(engine, backend, "compute backend: cpu | cuda", {"device"}),
      MPIGPT_OPTION(engine, allow_device_sharing, "cuda: more ranks per node than GPUs (tests; GPUs shared round robin)"),
      MPIGPT_OPTION(engine, gemm_autotune, "cuda: time cuBLASLt's candidate algorithms per GEMM shape, keep the fastest"),
      MPIGPT_OPTION(engine, attention_backend, "cuda causal attention: cudnn (cuDNN fused) | builtin (own kernels); unset: cudnn where it runs, else builtin"),
      MPIGPT_OPTION(engine, comm, "communication of device tensors: auto (nccl for cuda) | nccl | mpi (staged through host)", {"distributed_backend"}),
      MPIGPT_OPTION(engine, nccl_init, "cuda + nccl: how each group's NCCL communicator is made: init_rank (its own bootstrap) | split (ncclCommSplit of the world's)"),
      MPIGPT_OPTION(engine, comm_timeout, "seconds a rank may wait for its peers (a collective, a message) before the job is stopped (0: forever)", {"distributed_timeout_minutes"}),
      MPIGPT_OPTION(engine, distributed_optimizer, "shard fp32 master weights and Adam moments over dp (ZeRO-1)", {"use_distributed_optimizer"}),
      MPIGPT_OPTION(engine, overlap_grad_reduce, "start each bucket's gradient reduction during backward"),
      MPIGPT_OPTION(engine, overlap_param_gather, "start next step's parameter all-gather early"),
      MPIGPT_OPTION(engine, bucket_size, "gradient bucket size in elements", {"ddp_bucket_size"}),
      MPIGPT_OPTION(engine, grad_accum_dtype, "gradient accumulation dtype: fp32 | bf16", {"accumulate_allreduce_grads_in_fp32"}),
      MPIGPT_OPTION(engine, recompute, "activation recomputation: none | selective | full", {"recompute_granularity", "recompute_activations"}),
      MPIGPT_OPTION(engine, sequence_packing, "pack documents into rows without padding"),
      MPIGPT_OPTION(engine, threads, "CPU threads per rank (0: OMP_NUM_THREADS or all cores)", {"num_threads"}),

      MPIGPT_OPTION(training, lr, "peak learning rate", {"learning_rate"}),
      MPIGPT_OPTION(training, lr_schedule, "decay after warmup: cosine | linear | constant", {"lr_decay_style"}),
      MPIGPT_OPTION(training, warmup_iters, "linear warmup iterations from 0 to lr", {"lr_warmup_iters"}),
      MPIGPT_OPTION(training, min_lr, "learning rate at the end of decay"),
      MPIGPT_OPTION(training, decay_iters, "iterations of decay after warmup (0: until train_iters)", {"lr_decay_iters"}),
      MPIGPT_OPTION(training, weight_decay, "decoupled AdamW weight decay"),
      MPIGPT_OPTION(training, no_decay, "parameter kinds exempt from weight decay"),
      MPIGPT_OPTION(training, beta1, "Adam beta1", {"adam_beta1"}),
      MPIGPT_OPTION(training, beta2, "Adam beta2", {"adam_beta2"}),
      MPIGPT_OPTION(training, eps, "Adam epsilon", {"adam_eps"}),
      MPIGPT_OPTION(training, clip_grad, "clip the global gradient norm to this (0: off)", {"grad_clip"}),
      MPIGPT_OPTION(training, micro_batch, "sequences per micro-batch per data-parallel rank", {"micro_batch_size"}),
      MPIGPT_OPTION(training, global_batch, "sequences per optimizer step over all dp ranks", {"global_batch_size"}),
      MPIGPT_OPTION(training, train_iters, "optimizer steps to run"),
      MPIGPT_OPTION(training, eval_interval, "run validation every this many steps (0: never)"),
      MPIGPT_OPTION(training, eval_iters, "global batches per validation run (the same samples in every layout)"),
      MPIGPT_OPTION(training, seed, "seed of weight init and data order"),
      MPIGPT_OPTION(training, log_interval, "one log line every this many steps"),
      MPIGPT_OPTION(training, metrics_file, "JSONL file receiving one object per log line (\"\" = none)"),
      MPIGPT_OPTION(training, precision, "compute precision: fp32 | bf16", {"bf16", "fp16", "params_dtype"}),
      MPIGPT_OPTION(training, peak_tflops, "device peak for MFU in TFLOP/s (0: the backend's default)"),

      MPIGPT_OPTION(model, family, "gpt2 (LayerNorm, GELU, learned positions, tied) | llama (RMSNorm, SwiGLU, RoPE, GQA, untied)", {"model_type"}),
      MPIGPT_OPTION(model, num_layers, "transformer blocks"),
      MPIGPT_OPTION(model, hidden, "channels C", {"hidden_size"}),
      MPIGPT_OPTION(model, num_heads, "query heads", {"num_attention_heads"}),
      MPIGPT_OPTION(model, num_kv_heads, "key/value heads for GQA (0: = num_heads)", {"num_query_groups", "num_key_value_heads"}),
      MPIGPT_OPTION(model, ffn_hidden, "MLP hidden size F (0: 4*C for gpt2, llama rule 8C/3 rounded to 64)", {"ffn_hidden_size", "intermediate_size"}),
      MPIGPT_OPTION(model, seq_len, "training sequence length T", {"seq_length"}),
      MPIGPT_OPTION(model, max_position, "learned position table size (0: = seq_len)", {"max_position_embeddings"}),
      MPIGPT_OPTION(model, vocab_size, "tokenizer vocabulary V (0: taken from the tokenizer)"),
      MPIGPT_OPTION(model, vocab_multiple, "pad the vocabulary to a multiple of this (times tp)", {"make_vocab_size_divisible_by"}),
      MPIGPT_OPTION(model, norm_eps, "epsilon of LayerNorm / RMSNorm", {"norm_epsilon", "layernorm_epsilon"}),
      MPIGPT_OPTION(model, rope_theta, "RoPE base (llama)", {"rotary_base"}),
      MPIGPT_OPTION(model, qkv_bias, "llama: a bias on the query, key and value projections (Qwen2)", {"add_qkv_bias"}),
      MPIGPT_OPTION(model, init_std, "std of the normal weight init", {"init_method_std"}),
      MPIGPT_OPTION(model, tie_embeddings, "share input and output embedding (gpt2 default true, llama false)", {"untie_embeddings_and_output_weights"}),
      MPIGPT_OPTION(model, num_experts, "MoE experts E per MoE layer (0: dense MLP everywhere)", {"num_local_experts"}),
      MPIGPT_OPTION(model, moe_top_k, "experts each token is routed to (K)", {"moe_router_topk", "num_experts_per_tok"}),
      MPIGPT_OPTION(model, moe_router, "router scores: softmax | sigmoid", {"moe_router_score_function"}),
      MPIGPT_OPTION(model, moe_layers, "MoE layers: all | every:N (index % N == N-1) | comma list of layer indices", {"moe_layer_freq"}),
      MPIGPT_OPTION(model, moe_ffn_hidden, "hidden size of each expert (0: = ffn_hidden)", {"moe_ffn_hidden_size", "moe_intermediate_size"}),
      MPIGPT_OPTION(model, moe_aux_loss_coeff, "load-balancing (Switch) aux loss coefficient (0: off)", {"router_aux_loss_coef"}),
      MPIGPT_OPTION(model, moe_z_loss_coeff, "router z-loss coefficient (0: off)", {"router_z_loss_coef"}),
      MPIGPT_OPTION(model, moe_capacity_factor, "expert capacity = ceil(factor * tokens * K / E) per micro-batch (0: dropless)", {"moe_expert_capacity_factor"}),
      MPIGPT_OPTION(model, moe_drop_policy, "over capacity keep the highest gates (probs) or the earliest tokens (position)", {"moe_token_drop_policy"}),
      MPIGPT_OPTION(model, moe_shared_expert_ffn, "hidden size of a shared expert every token passes (0: none)", {"moe_shared_expert_intermediate_size"}),
      MPIGPT_OPTION(model, moe_norm_topk_prob, "softmax router: renormalise the K gates to sum 1 (sigmoid always does)", {"norm_topk_prob"}),

      MPIGPT_OPTION(data, path, "dataset prefix (PREFIX.bin/.idx) or an llm.c .bin token file", {"data_path"}),
      MPIGPT_OPTION(data, tokenizer, "byte | gpt2", {"tokenizer_type"}),
      MPIGPT_OPTION(data, vocab_file, "GPT-2 vocab.json / encoder.json (tokenizer = gpt2)"),
      MPIGPT_OPTION(data, merges_file, "GPT-2 merges.txt / vocab.bpe (tokenizer = gpt2)", {"merge_file"}),
      MPIGPT_OPTION(data, valid_fraction, "share of documents held out for validation", {"split"}),
      MPIGPT_OPTION(data, valid_path, "separate validation dataset (overrides valid_fraction)", {"valid_data_path"}),
      MPIGPT_OPTION(data, shuffle, "shuffle documents and samples (false: stream order, as llm.c reads)"),

      MPIGPT_OPTION(checkpoint, save, "directory to save into (\"\" = never save)"),
      MPIGPT_OPTION(checkpoint, save_interval, "save every this many steps (0: only at the end if save is set)"),
      MPIGPT_OPTION(checkpoint, load, "directory to resume from"),
      MPIGPT_OPTION(checkpoint, keep_last, "keep only the newest N saves (0: keep all)"),
      MPIGPT_OPTION(checkpoint, init_from_hf, "start from a Hugging Face model directory (config.json + safetensors)"),
      MPIGPT_OPTION(checkpoint, init_from_llmc, "start from an llm.c GPT-2 model file (gpt2_124M.bin)"),
      MPIGPT_OPTION(checkpoint, init_from_checkpoint, "start from an mpigpt save's weights: fresh optimizer, iteration 0"),
      MPIGPT_OPTION(checkpoint, init_from_peft, "LoRA adapters to start from: a PEFT directory (on an init_from_* base)"),

      MPIGPT_OPTION(lora, rank, "adapter rank r (0: off, every weight is trained)", {"lora_rank", "lora_dim"}),
      MPIGPT_OPTION(lora, alpha, "the adapters' update is scaled by alpha / rank", {"lora_alpha"}),
      MPIGPT_OPTION(lora, rslora, "rank-stabilised LoRA: scale by alpha / sqrt(rank) instead", {"use_rslora"}),
      MPIGPT_OPTION(lora, targets, "linear layers that get adapters: any of qkv (or q, k, v: one each), proj, fc1 (or gate, up), fc2", {"target_modules", "lora_target_modules"}),
      MPIGPT_OPTION(lora, dropout, "dropout on the adapters' input (only 0 is supported)", {"lora_dropout"}),
  };
  return table;
}
#undef MPIGPT_OPTION

const Row& find_row(const std::string& full_name) {
  for (const Row& r : rows())
    if (r.opt.name() == full_name) return r;
  fail("internal: config option '{}' is not in the table of io/config/config.cpp", full_name);
}

// ---- text <-> value ---------------------------------------------------------------------

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// Quoted only when a plain value would not read back: empty, edge spaces, comment characters.
std::string ini_quote(const std::string& s) {
  bool plain = !s.empty() && s.front() != ' ' && s.back() != ' ' && s.front() != '"' &&
               s.find_first_of("#;\n\t\r") == std::string::npos;
  if (plain) return s;
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (ch == '\n') out += "\\n";
    else if (ch == '\t') out += "\\t";
    else if (ch == '\r') out += "\\r";
    else out += ch;
  }
  return out + "\"";
}

std::string text_of(const Row& r, const Config& c) {
  const void* p = r.ref(const_cast<Config&>(c));
  switch (r.kind) {
    case Kind::Bool: return *static_cast<const bool*>(p) ? "true" : "false";
    case Kind::Int: return std::to_string(*static_cast<const int*>(p));
    case Kind::Int64: return std::to_string(*static_cast<const int64_t*>(p));
    case Kind::UInt64: return std::to_string(*static_cast<const uint64_t*>(p));
    case Kind::Double: return fmt::format("{}", *static_cast<const double*>(p));  // shortest round trip
    case Kind::String: return *static_cast<const std::string*>(p);
  }
  return {};
}

template <class T>
void parse_integer(const std::string& text, T& out, const std::string& what, const char* kind) {
  T v{};
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range)
    fail("{} is out of range for {} ({} to {}); use a smaller value", what, kind,
         std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    if (std::is_unsigned_v<T>) fail("{} is not a non-negative integer; write a whole number such as 1234", what);
    fail("{} is not an integer; write a whole number such as 4", what);
  }
  out = v;
}

void parse_into(const Row& r, Config& c, const std::string& text, const std::string& where) {
  void* p = r.ref(c);
  const std::string what = fmt::format("{}{} = '{}'", where.empty() ? "" : where + ": ", r.opt.name(), text);
  switch (r.kind) {
    case Kind::Bool: {
      const std::string t = lower(text);
      if (t == "true" || t == "1" || t == "yes" || t == "on") *static_cast<bool*>(p) = true;
      else if (t == "false" || t == "0" || t == "no" || t == "off") *static_cast<bool*>(p) = false;
      else fail("{} is not a boolean; write true/false, 1/0, yes/no or on/off", what);
      return;
    }
    case Kind::Int: parse_integer(text, *static_cast<int*>(p), what, "an int"); return;
    case Kind::Int64: parse_integer(text, *static_cast<int64_t*>(p), what, "a 64-bit int"); return;
    case Kind::UInt64: parse_integer(text, *static_cast<uint64_t*>(p), what, "an unsigned 64-bit int"); return;
    case Kind::Double: {
      double v = 0;
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec != std::errc() || end != text.data() + text.size() || text.empty() || !std::isfinite(v))
        fail("{} is not a finite number; write a decimal such as 0.0003 or 3e-4", what);
      *static_cast<double*>(p) = v;
      return;
    }
    case Kind::String: *static_cast<std::string*>(p) = text; return;
  }
}

// ---- names and "did you mean" ----------------------------------------------------------

// Users type Megatron's dashed spellings and mixed case; compare in one canonical form.
std::string canonical(std::string s) {
  s = lower(std::move(s));
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
}

// Damerau-Levenshtein distance (optimal string alignment): transposed letters count as one typo.
size_t typo_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i)
    for (size_t j = 1; j <= m; ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

// "learning_rate" -> "lr": our short keys are often the initials of the long spelling.
std::string initials(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] != '_' && (i == 0 || s[i - 1] == '_')) out += s[i];
  return out;
}

// How far `word` (canonical; "section.key" or "key") is from an option; smaller is closer.
size_t closeness(const std::string& word, const ConfigOption& o) {
  const size_t dot = word.rfind('.');
  const std::string key = dot == std::string::npos ? word : word.substr(dot + 1);
  const std::string section = dot == std::string::npos ? "" : word.substr(0, dot);
  size_t d = typo_distance(key, o.key);
  for (const std::string& alias : o.aliases) d = std::min(d, typo_distance(key, canonical(alias)));
  if (key.find('_') != std::string::npos && initials(key) == o.key) d = std::min<size_t>(d, 1);
  if (key.size() >= 4 && (o.key.ends_with("_" + key) || o.key.starts_with(key + "_")))
    d = std::min<size_t>(d, 2);  // "layers" -> num_layers, "vocab" -> vocab_size
  if (!section.empty() && section != o.section) d += 1;  // prefer the section the user named
  return d;
}

}  // namespace

const std::vector<ConfigOption>& config_options() {
  static const std::vector<ConfigOption> options = [] {
    std::vector<ConfigOption> v;
    for (const Row& r : rows()) v.push_back(r.opt);
    return v;
  }();
  return options;
}

const std::vector<std::pair<std::string, std::string>>& config_sections() {
  // The struct comments of io/config/config.h, in the order of Config's members (config_test checks).
  static const std::vector<std::pair<std::string, std::string>> sections = {
      {"parallel", "How the ranks are arranged."},
      {"engine", "How the engine runs the model."},
      {"training", "The optimisation run."},
      {"model", "The network."},
      {"data", "Where the tokens come from."},
      {"checkpoint", "Where checkpoints go."},
      {"lora", "LoRA fine-tuning: low-rank adapters trained on a frozen model."},
  };
  return sections;
}

std::string resolve_option_name(const std::string& word, const std::vector<ConfigOption>& options,
                                const std::string& where, const std::string& dashes) {
  const std::string at = where.empty() ? "" : where + ": ";
  std::vector<std::string> matches;
  for (const ConfigOption& o : options)
    if (word.find('.') != std::string::npos ? o.name() == word : o.key == word) matches.push_back(o.name());
  if (matches.size() == 1) return matches[0];
  if (matches.size() > 1) {
    std::string list;
    for (size_t i = 0; i < matches.size(); ++i)
      list += fmt::format("{}'{}{}'", i == 0 ? "" : i + 1 == matches.size() ? " or " : ", ", dashes, matches[i]);
    fail("{}option '{}{}' is ambiguous: it may mean {}; write the full section.key name", at, dashes, word, list);
  }
  const std::string w = canonical(word);
  const size_t key_len = w.size() - (w.rfind('.') == std::string::npos ? 0 : w.rfind('.') + 1);
  size_t best = 1 + key_len / 4;  // further than this, a suggestion would be a guess
  std::string suggestion;
  for (const ConfigOption& o : options) {
    const size_t d = closeness(w, o);
    if (d <= best && (suggestion.empty() || d < best)) best = d, suggestion = o.name();
  }
  if (!suggestion.empty())
    fail("{}unknown option '{}{}'; did you mean '{}{}'?", at, dashes, word, dashes, suggestion);
  fail("{}unknown option '{}{}'; run with --help to list the options", at, dashes, word);
}

std::string config_get(const Config& c, const std::string& name) {
  return text_of(find_row(resolve_option_name(name, config_options(), "")), c);
}

void config_set(Config& c, const std::string& name, const std::string& text, const std::string& where) {
  const std::string full = resolve_option_name(name, config_options(), where);
  parse_into(find_row(full), c, text, where);
  c.user_set.insert(full);
}

void Config::adopt_model(const ModelConfig& m, const std::string& source) {
  auto take = [&](const char* key, auto& mine, const auto& theirs) {
    const std::string name = std::string("model.") + key;
    if (user_set.count(name) && mine != theirs)
      fail("{} = {} but {} holds a model with {} = {}; leave {} out (it is taken from the model) or load a "
           "matching model", name, config_get(*this, name), source, name, fmt::format("{}", theirs), name);
    mine = theirs;
    user_set.insert(name);  // resolve_defaults must not derive it again
  };
  take("family", model.family, m.family);
  take("num_layers", model.num_layers, m.num_layers);
  take("hidden", model.hidden, m.hidden);
  take("num_heads", model.num_heads, m.num_heads);
  take("num_kv_heads", model.num_kv_heads, m.num_kv_heads);
  take("ffn_hidden", model.ffn_hidden, m.ffn_hidden);
  take("max_position", model.max_position, m.max_position);
  // A larger vocabulary is a tokenizer with added tokens: the model grows on load (grow_vocab).
  if (!(user_set.count("model.vocab_size") && model.vocab_size > m.vocab_size)) {
    if (user_set.count("model.vocab_size") && model.vocab_size < m.vocab_size)
      fail("model.vocab_size = {} is smaller than the {} words of {}: a vocabulary cannot shrink; leave "
           "model.vocab_size out, or give {} or more for a tokenizer with added tokens", model.vocab_size,
           m.vocab_size, source, m.vocab_size);
    take("vocab_size", model.vocab_size, m.vocab_size);
  }
  take("norm_eps", model.norm_eps, m.norm_eps);
  take("rope_theta", model.rope_theta, m.rope_theta);
  take("qkv_bias", model.qkv_bias, m.qkv_bias);
  take("tie_embeddings", model.tie_embeddings, m.tie_embeddings);
  take("num_experts", model.num_experts, m.num_experts);
  if (m.num_experts > 0) {  // the mixture-of-experts shape (a Mixtral import, a MoE checkpoint)
    take("moe_top_k", model.moe_top_k, m.moe_top_k);
    take("moe_router", model.moe_router, m.moe_router);
    take("moe_layers", model.moe_layers, m.moe_layers);
    take("moe_ffn_hidden", model.moe_ffn_hidden, m.moe_ffn_hidden);
    take("moe_shared_expert_ffn", model.moe_shared_expert_ffn, m.moe_shared_expert_ffn);
    take("moe_norm_topk_prob", model.moe_norm_topk_prob, m.moe_norm_topk_prob);
    // A training setting: the model's value unless the user chose one.
    if (!user_set.count("model.moe_aux_loss_coeff")) model.moe_aux_loss_coeff = m.moe_aux_loss_coeff;
  }
}

void Config::resolve_defaults() {
  ModelConfig& m = model;
  if (m.num_kv_heads == 0) m.num_kv_heads = m.num_heads;
  if (m.ffn_hidden == 0) {
    if (m.family == "gpt2") {
      m.ffn_hidden = 4 * m.hidden;
    } else if (m.family == "llama") {
      const int64_t f = 8 * int64_t{m.hidden} / 3;  // SwiGLU keeps the 4C MLP's parameter count
      m.ffn_hidden = static_cast<int>((f + 63) / 64 * 64);
    }  // an unknown family stays 0: validate() names the family first
  }
  if (m.max_position == 0) m.max_position = m.seq_len;
  if (!user_set.count("model.tie_embeddings")) {
    if (m.family == "gpt2") m.tie_embeddings = true;
    if (m.family == "llama") m.tie_embeddings = false;
  }
}

std::string Config::to_ini() const {
  std::string out =
      "# mpigpt configuration, every option; `mpigpt train --config FILE` reads it back.\n";
  for (const auto& [section, description] : config_sections()) {
    out += fmt::format("\n# {}\n[{}]\n", description, section);
    for (const Row& r : rows()) {
      if (r.opt.section != section) continue;
      const std::string value = r.kind == Kind::String ? ini_quote(text_of(r, *this)) : text_of(r, *this);
      out += fmt::format("{:<39} # {}\n", fmt::format("{} = {}", r.opt.key, value), r.opt.description);
    }
  }
  return out;
}

}  // namespace mpigpt
