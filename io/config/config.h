// Configuration: a few small structs, one comment per field, filled from INI files and the
// command line (Boost.Program_options) and cross-checked by one validate() whose errors name
// the fields, the values and the fix.
#pragma once
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace mpigpt {

// How the ranks are arranged.
struct ParallelConfig {
  int tp = 1;                           // tensor-parallel size (heads and MLP split over tp ranks)
  int pp = 1;                           // pipeline-parallel stages
  int vpp = 1;                          // virtual stages (model chunks) per pipeline rank; >1 = interleaved 1F1B
  std::string pipeline_layout;          // layers per virtual stage in stage order, e.g. 5,7,7,5 (empty: even)
  int cp = 1;                           // context-parallel size (sequence split over cp ranks)
  std::string cp_comm_type = "p2p";     // context-parallel attention: p2p (ring) | all_gather
  int ep = 1;                           // expert-parallel size
  int expert_tp = 1;                    // tensor-parallel size inside the expert grid
  bool sequence_parallel = false;       // shard norms/residual over T within the tp group
  std::string moe_dispatcher = "alltoall"; // MoE token dispatcher: alltoall | allgather
  std::string order = "tp-cp-ep-dp-pp"; // rank-grid order, leftmost axis varies fastest
};

// How the engine runs the model.
struct EngineConfig {
  std::string backend = "cpu";          // compute backend: cpu | cuda
  bool allow_device_sharing = false;    // cuda: more ranks per node than GPUs (tests; GPUs shared round robin)
  bool gemm_autotune = true;            // cuda: time cuBLASLt's candidate algorithms per GEMM shape, keep the fastest
  std::string attention_backend;       // cuda causal attention: cudnn (cuDNN fused) | builtin (own kernels); unset: cudnn where it runs, else builtin
  std::string comm = "auto";            // communication of device tensors: auto (nccl for cuda) | nccl | mpi (staged through host)
  std::string nccl_init = "init_rank";  // cuda + nccl: how each group's NCCL communicator is made: init_rank (its own bootstrap) | split (ncclCommSplit of the world's)
  double comm_timeout = 600;            // seconds a rank may wait for its peers (a collective, a message) before the job is stopped (0: forever)
  bool distributed_optimizer = false;   // shard fp32 master weights and Adam moments over dp (ZeRO-1)
  bool overlap_grad_reduce = false;     // start each bucket's gradient reduction during backward
  bool overlap_param_gather = false;    // start next step's parameter all-gather early
  int64_t bucket_size = 40000000;       // gradient bucket size in elements
  std::string grad_accum_dtype = "fp32";// gradient accumulation dtype: fp32 | bf16
  std::string recompute = "none";       // activation recomputation: none | selective | full
  bool sequence_packing = false;        // pack documents into rows without padding
  int threads = 0;                      // CPU threads per rank (0: OMP_NUM_THREADS or all cores)
};

// The optimisation run.
struct TrainingConfig {
  double lr = 3e-4;                     // peak learning rate
  std::string lr_schedule = "cosine";   // decay after warmup: cosine | linear | constant
  int64_t warmup_iters = 0;             // linear warmup iterations from 0 to lr
  double min_lr = 0.0;                  // learning rate at the end of decay
  int64_t decay_iters = 0;              // iterations of decay after warmup (0: until train_iters)
  double weight_decay = 0.1;            // decoupled AdamW weight decay
  std::string no_decay = "norms,biases,embeddings"; // parameter kinds exempt from weight decay
  double beta1 = 0.9;                   // Adam beta1
  double beta2 = 0.95;                  // Adam beta2
  double eps = 1e-8;                    // Adam epsilon
  double clip_grad = 1.0;               // clip the global gradient norm to this (0: off)
  int micro_batch = 4;                  // sequences per micro-batch per data-parallel rank
  int global_batch = 4;                 // sequences per optimizer step over all dp ranks
  int64_t train_iters = 100;            // optimizer steps to run
  int64_t eval_interval = 50;           // run validation every this many steps (0: never)
  int64_t eval_iters = 10;              // global batches per validation run (the same samples in every layout)
  uint64_t seed = 1234;                 // seed of weight init and data order
  int64_t log_interval = 10;            // one log line every this many steps
  std::string metrics_file;             // JSONL file receiving one object per log line ("" = none)
  std::string precision = "fp32";       // compute precision: fp32 | bf16
  double peak_tflops = 0;               // device peak for MFU in TFLOP/s (0: the backend's default)
};

// The network.
struct ModelConfig {
  std::string family = "gpt2";          // gpt2 (LayerNorm, GELU, learned positions, tied) | llama (RMSNorm, SwiGLU, RoPE, GQA, untied)
  int num_layers = 4;                   // transformer blocks
  int hidden = 256;                     // channels C
  int num_heads = 4;                    // query heads
  int num_kv_heads = 0;                 // key/value heads for GQA (0: = num_heads)
  int ffn_hidden = 0;                   // MLP hidden size F (0: 4*C for gpt2, llama rule 8C/3 rounded to 64)
  int seq_len = 256;                    // training sequence length T
  int max_position = 0;                 // learned position table size (0: = seq_len)
  int vocab_size = 0;                   // tokenizer vocabulary V (0: taken from the tokenizer)
  int vocab_multiple = 128;             // pad the vocabulary to a multiple of this (times tp)
  double norm_eps = 1e-5;               // epsilon of LayerNorm / RMSNorm
  double rope_theta = 10000.0;          // RoPE base (llama)
  bool qkv_bias = false;                // llama: a bias on the query, key and value projections (Qwen2)
  double init_std = 0.02;               // std of the normal weight init
  bool tie_embeddings = true;           // share input and output embedding (gpt2 default true, llama false)
  int num_experts = 0;                  // MoE experts E per MoE layer (0: dense MLP everywhere)
  int moe_top_k = 2;                    // experts each token is routed to (K)
  std::string moe_router = "softmax";   // router scores: softmax | sigmoid
  std::string moe_layers = "all";       // MoE layers: all | every:N (index % N == N-1) | comma list of layer indices
  int moe_ffn_hidden = 0;               // hidden size of each expert (0: = ffn_hidden)
  double moe_aux_loss_coeff = 0.01;     // load-balancing (Switch) aux loss coefficient (0: off)
  double moe_z_loss_coeff = 0.0;        // router z-loss coefficient (0: off)
  double moe_capacity_factor = 0.0;     // expert capacity = ceil(factor * tokens * K / E) per micro-batch (0: dropless)
  std::string moe_drop_policy = "probs"; // over capacity keep the highest gates (probs) or the earliest tokens (position)
  int moe_shared_expert_ffn = 0;        // hidden size of a shared expert every token passes (0: none)
  bool moe_norm_topk_prob = false;      // softmax router: renormalise the K gates to sum 1 (sigmoid always does)
};

// Where the tokens come from.
struct DataConfig {
  std::string path;                     // dataset prefix (PREFIX.bin/.idx) or an llm.c .bin token file
  std::string tokenizer = "byte";       // byte | gpt2
  std::string vocab_file;               // GPT-2 vocab.json / encoder.json (tokenizer = gpt2)
  std::string merges_file;              // GPT-2 merges.txt / vocab.bpe (tokenizer = gpt2)
  double valid_fraction = 0.05;         // share of documents held out for validation
  std::string valid_path;               // separate validation dataset (overrides valid_fraction)
  bool shuffle = true;                  // shuffle documents and samples (false: stream order, as llm.c reads)
};

// Where checkpoints go.
struct CheckpointConfig {
  std::string save;                     // directory to save into ("" = never save)
  int64_t save_interval = 0;            // save every this many steps (0: only at the end if save is set)
  std::string load;                     // directory to resume from
  int keep_last = 0;                    // keep only the newest N saves (0: keep all)
  std::string init_from_hf;             // start from a Hugging Face model directory (config.json + safetensors)
  std::string init_from_llmc;           // start from an llm.c GPT-2 model file (gpt2_124M.bin)
  std::string init_from_checkpoint;     // start from an mpigpt save's weights: fresh optimizer, iteration 0
  std::string init_from_peft;           // LoRA adapters to start from: a PEFT directory (on an init_from_* base)
};

// LoRA fine-tuning: low-rank adapters trained on a frozen model.
struct LoraConfig {
  int rank = 0;                         // adapter rank r (0: off, every weight is trained)
  double alpha = 16.0;                  // the adapters' update is scaled by alpha / rank
  bool rslora = false;                  // rank-stabilised LoRA: scale by alpha / sqrt(rank) instead
  std::string targets = "qkv,proj,fc1,fc2"; // linear layers that get adapters: any of qkv (or q, k, v: one each), proj, fc1 (or gate, up), fc2
  double dropout = 0.0;                 // dropout on the adapters' input (only 0 is supported)
};

// lora.targets as its set of names: qkv, proj, fc1, fc2 (one adapter per linear layer, the fused
// qkv and SwiGLU's [gate; up] sharing one A), or q, k, v, gate, up in place of qkv / fc1 (an
// adapter of its own on each of those projections, as PEFT's q_proj, ...). Fails naming the field.
std::set<std::string> lora_target_set(const std::string& list);

struct Config {
  ParallelConfig parallel;
  EngineConfig engine;
  TrainingConfig training;
  ModelConfig model;
  DataConfig data;
  CheckpointConfig checkpoint;
  LoraConfig lora;
  std::vector<std::string> sources;     // config files read, for messages
  // Options given in a file or on the command line ("model.tie_embeddings"), so that a family
  // default never overrides what the user wrote; config_set() records them.
  std::set<std::string> user_set;

  // Fill derived defaults (num_kv_heads, ffn_hidden, max_position, tie_embeddings per family).
  // tie_embeddings follows the family (gpt2 true, llama false) unless user_set names it.
  void resolve_defaults();
  // Take the model's shape from a model being imported (`source`: its path, for messages):
  // fields the user did not set are copied, a field the user set to another value is an error.
  void adopt_model(const ModelConfig& m, const std::string& source);
  // Cross-check everything for `world_size` ranks; throws mpigpt::Error naming the fields.
  void validate(int world_size) const;
  // Data-parallel size implied by the world size and the model-parallel sizes.
  int dp(int world_size) const;
  // The resolved configuration as INI text (printed once at start, stored in checkpoints).
  std::string to_ini() const;
};

// Which of `num_layers` layers are mixture-of-experts layers under model.moe_layers ("all",
// "every:N" = the layers l with l % N == N-1, or a comma list of layer indices); a flag per layer.
// Throws naming model.moe_layers on bad syntax or a layer >= num_layers.
std::vector<bool> parse_moe_layers(const std::string& spec, int num_layers);

// The number of layers of each of the pp * vpp virtual stages, in stage order (stage v*pp + r is
// rank r's chunk v): parallel.pipeline_layout, or num_layers split evenly when it is empty. Throws
// naming parallel.pipeline_layout (or the sizes) when the counts are not whole, are negative, are
// not one per virtual stage or do not add up to num_layers.
std::vector<int> pipeline_layers(const ParallelConfig& p, int num_layers);

// Parse `args` (everything after the subcommand) into a Config: `--config FILE` (repeatable,
// later files override earlier ones) and then `--section.key value` / `--key value` overrides.
// Unknown keys are errors that suggest the closest valid key. `--help` fills help_text instead.
struct ParsedArgs {
  Config config;
  bool help = false;
  std::string help_text;                // --help output, grouped by section
  std::vector<std::string> positional;  // words that are not options
  // For a positional word that followed a boolean option (`--x maybe`), that option's name.
  std::map<size_t, std::string> after_bool;
  // Subcommand flags that are not config fields (e.g. --dry-run, --bench-steps N).
  std::vector<std::pair<std::string, std::string>> flags;
};
// extra_flags: names of subcommand flags (without --) accepted besides config keys; a flag
// ending in '!' takes no value ("dry-run!").
ParsedArgs parse_config_args(const std::vector<std::string>& args,
                             const std::vector<std::string>& extra_flags = {});
// The configuration in INI `text` (a checkpoint's saved one), `name` naming it in messages.
Config parse_config_text(const std::string& text, const std::string& name);
// For commands that take no positional words: fails naming the first one (a word after a
// boolean option as that option's bad value), with `usage`.
void reject_positional(const ParsedArgs& parsed, const std::string& usage);

// One option of the single table in io/config/config.cpp: a field of the structs above, named
// section.key. The parser, --help, to_ini() and the tests all derive from that table.
struct ConfigOption {
  std::string section;                // "training"
  std::string key;                    // "lr"
  std::string type;                   // int | int64 | uint64 | double | bool | string
  std::string description;            // the field's comment in this header
  std::vector<std::string> aliases;   // Megatron-LM spellings, only for "did you mean" hints
  std::string name() const { return section + "." + key; }
};
// Every option, in declaration order, sections in the order of Config's members.
const std::vector<ConfigOption>& config_options();
// The sections (parallel, engine, ...) with their struct's comment, in order.
const std::vector<std::pair<std::string, std::string>>& config_sections();
// A field's value as INI text ("0.0003", "true", "gpt2"); `name` as for config_set.
std::string config_get(const Config& c, const std::string& name);
// Sets the field `name` (section.key, or a bare key when unambiguous) from text and records it
// in c.user_set. `where` ("tiny.ini:7", "command line") opens the message of a bad value.
void config_set(Config& c, const std::string& name, const std::string& text, const std::string& where = "");
// The full option name that `word` means: a full name as itself, a bare key as the one option
// with that key. Throws naming `where`: unknown words with the closest option ("did you mean"),
// ambiguous bare keys with the candidates. `dashes` ("--" on the command line) prefixes names.
std::string resolve_option_name(const std::string& word, const std::vector<ConfigOption>& options,
                                const std::string& where, const std::string& dashes = "");

}  // namespace mpigpt
