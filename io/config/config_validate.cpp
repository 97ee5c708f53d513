// Configuration validation: every cross-check between the sections, run once before anything is
// built, so that a bad layout fails at start with the fields, their values and the fix instead
// of hanging or corrupting a run hours later. The first violation throws.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "io/config/config.h"
#include "parallel/rank_grid.h"
#include "lib/core/error.h"

namespace mpigpt {
namespace {

template <class T>
void at_least(const char* name, T value, T min) {
  if (value < min) fail("{} = {} must be at least {}; set it to {} or more", name, value, min, min);
}

void one_of(const char* name, const std::string& value, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed)
    if (value == a) return;
  fail("{} = '{}' is not one of {}; set it to one of these", name, value, fmt::join(allowed, " | "));
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) parts.push_back(part);
  if (!s.empty() && s.back() == sep) parts.push_back("");
  return parts;
}

}  // namespace

std::set<std::string> lora_target_set(const std::string& list) {
  const char* names = "write a comma list of qkv (or q, k, v), proj, fc1 (or gate, up), fc2";
  std::set<std::string> out;
  for (std::string t : split(list, ',')) {
    t.erase(0, t.find_first_not_of(" \t"));
    t.erase(t.find_last_not_of(" \t") + 1);
    static const std::set<std::string> known = {"qkv", "proj", "fc1", "fc2", "q", "k", "v", "gate", "up"};
    if (!known.count(t)) fail("lora.targets = '{}': '{}' is not a linear layer LoRA adapts; {}", list, t, names);
    out.insert(t);
  }
  if (out.empty()) fail("lora.targets = '{}' names no layer; {}", list, names);
  auto both = [&](const char* fused, const char* shared_by, std::initializer_list<const char*> parts) {
    for (const char* p : parts)
      if (out.count(fused) && out.count(p))
        fail("lora.targets = '{}' names both {} (one adapter shared by {}) and {} (an adapter of its own); write one "
             "or the other", list, fused, shared_by, p);
  };
  both("qkv", "q, k and v", {"q", "k", "v"});
  both("fc1", "gate and up", {"gate", "up"});
  return out;
}

namespace {

void check_no_decay(const std::string& list) {
  for (const std::string& kind : split(list, ','))
    if (kind != "norms" && kind != "biases" && kind != "embeddings")
      fail("training.no_decay = '{}': '{}' is not a parameter kind; write a comma-separated subset of "
           "norms,biases,embeddings (or nothing to decay every parameter)", list, kind);
}

// engine.attention_backend = cudnn asks for cuDNN's fused attention in the causal ops: bf16 data on
// the GPU, and whole sequences (context parallelism and packed documents run the blockwise kernels).
void check_cudnn_attention(const Config& c) {
  const EngineConfig& e = c.engine;
  auto refuse = [&](const std::string& why) {
    fail("engine.attention_backend = cudnn, but {}; set engine.attention_backend = builtin, or leave it unset "
         "(cuDNN where it runs, the builtin kernels elsewhere)", why);
  };
  if (e.backend != "cuda") refuse(fmt::format("engine.backend = {}: cuDNN runs on the GPU", e.backend));
  if (c.training.precision != "bf16")
    refuse(fmt::format("training.precision = {}: cuDNN's fused attention takes bf16 data", c.training.precision));
  if (c.parallel.cp > 1)
    refuse(fmt::format("parallel.cp = {}: context parallelism runs the blockwise (ring) attention kernels, which "
                       "are builtin", c.parallel.cp));
  if (e.sequence_packing)
    refuse("engine.sequence_packing = true: packed documents run the blockwise (masked) attention kernels, which "
           "are builtin");
}

// Enumerations, the grid and the engine.
void check_engine_ranges(const Config& c) {
  const ParallelConfig& p = c.parallel;
  const EngineConfig& e = c.engine;
  const TrainingConfig& t = c.training;

  one_of("model.family", c.model.family, {"gpt2", "llama"});
  one_of("training.lr_schedule", t.lr_schedule, {"cosine", "linear", "constant"});
  one_of("engine.recompute", e.recompute, {"none", "selective", "full"});
  one_of("engine.grad_accum_dtype", e.grad_accum_dtype, {"fp32", "bf16"});
  one_of("training.precision", t.precision, {"fp32", "bf16"});
  one_of("engine.backend", e.backend, {"cpu", "cuda"});
  one_of("engine.comm", e.comm, {"auto", "nccl", "mpi"});
  one_of("engine.nccl_init", e.nccl_init, {"init_rank", "split"});
  if (!e.attention_backend.empty()) one_of("engine.attention_backend", e.attention_backend, {"cudnn", "builtin"});
  one_of("parallel.cp_comm_type", p.cp_comm_type, {"p2p", "all_gather"});
  one_of("data.tokenizer", c.data.tokenizer, {"byte", "gpt2"});
  parse_order(p.order);  // the rank grid's own check
  check_no_decay(t.no_decay);
  if (e.comm_timeout < 0)  // (the parser takes finite numbers only)
    fail("engine.comm_timeout = {} must be a number of seconds, 0 or more (0: ranks wait for each other forever); "
         "the default is 600", e.comm_timeout);

  at_least("parallel.tp", p.tp, 1);
  at_least("parallel.pp", p.pp, 1);
  at_least("parallel.vpp", p.vpp, 1);
  at_least("parallel.cp", p.cp, 1);
  at_least("parallel.ep", p.ep, 1);
  at_least("parallel.expert_tp", p.expert_tp, 1);
  at_least("engine.bucket_size", e.bucket_size, int64_t{1});
  at_least("engine.threads", e.threads, 0);
}

void check_model_ranges(const ModelConfig& m) {
  at_least("model.num_layers", m.num_layers, 1);
  at_least("model.hidden", m.hidden, 1);
  at_least("model.num_heads", m.num_heads, 1);
  at_least("model.num_kv_heads", m.num_kv_heads, 1);  // 0 was replaced by resolve_defaults()
  at_least("model.ffn_hidden", m.ffn_hidden, 1);
  at_least("model.seq_len", m.seq_len, 1);
  at_least("model.max_position", m.max_position, 1);
  at_least("model.vocab_size", m.vocab_size, 0);
  at_least("model.vocab_multiple", m.vocab_multiple, 1);
  if (!(m.norm_eps > 0)) fail("model.norm_eps = {} must be positive; the usual value is 1e-5", m.norm_eps);
  if (!(m.rope_theta > 0)) fail("model.rope_theta = {} must be positive; the usual value is 10000", m.rope_theta);
  if (m.init_std < 0) fail("model.init_std = {} must not be negative; the usual value is 0.02", m.init_std);
}

void check_training_ranges(const Config& c) {
  const TrainingConfig& t = c.training;
  at_least("training.micro_batch", t.micro_batch, 1);
  at_least("training.global_batch", t.global_batch, 1);
  at_least("training.train_iters", t.train_iters, int64_t{0});
  if (t.train_iters == 0 && c.checkpoint.save.empty())
    fail("training.train_iters = 0 trains nothing: it saves the initial model (random, or from "
         "checkpoint.init_from_*) to checkpoint.save, which is not set; set it, or train for some steps");
  at_least("training.warmup_iters", t.warmup_iters, int64_t{0});
  at_least("training.decay_iters", t.decay_iters, int64_t{0});
  at_least("training.eval_interval", t.eval_interval, int64_t{0});
  at_least("training.eval_iters", t.eval_iters, int64_t{t.eval_interval > 0 ? 1 : 0});
  at_least("training.log_interval", t.log_interval, int64_t{1});
  if (t.lr < 0) fail("training.lr = {} must not be negative; set the peak learning rate, e.g. 3e-4", t.lr);
  if (t.min_lr < 0) fail("training.min_lr = {} must not be negative; set it to 0 or more", t.min_lr);
  if (t.min_lr > t.lr)
    fail("training.min_lr = {} exceeds training.lr = {}; the schedule decays from lr down to min_lr, "
         "so set min_lr <= lr", t.min_lr, t.lr);
  if (t.beta1 < 0 || t.beta1 >= 1) fail("training.beta1 = {} must lie in [0, 1); the usual value is 0.9", t.beta1);
  if (t.beta2 < 0 || t.beta2 >= 1) fail("training.beta2 = {} must lie in [0, 1); the usual values are 0.95 or 0.999", t.beta2);
  if (!(t.eps > 0)) fail("training.eps = {} must be positive; the usual value is 1e-8", t.eps);
  if (t.clip_grad < 0) fail("training.clip_grad = {} must not be negative; set 0 to turn clipping off", t.clip_grad);
  if (t.weight_decay < 0) fail("training.weight_decay = {} must not be negative; set 0 to turn it off", t.weight_decay);
  if (t.peak_tflops < 0) fail("training.peak_tflops = {} must not be negative; set 0 for the backend's default", t.peak_tflops);
  if (c.data.valid_fraction < 0 || c.data.valid_fraction >= 1)
    fail("data.valid_fraction = {} must lie in [0, 1); e.g. 0.05 holds out 5% of the documents", c.data.valid_fraction);
}

// The checkpoint fields, and the places a run may start from.
void check_checkpoint_ranges(const Config& c) {
  at_least("checkpoint.save_interval", c.checkpoint.save_interval, int64_t{0});
  at_least("checkpoint.keep_last", c.checkpoint.keep_last, 0);
  {
    const CheckpointConfig& k = c.checkpoint;
    // A LoRA run resumes its adapters (load) on the base they were trained on (init_from_*).
    const int bases = !k.init_from_hf.empty() + !k.init_from_llmc.empty() + !k.init_from_checkpoint.empty();
    const int starts = bases + (c.lora.rank > 0 ? 0 : !k.load.empty());
    if (starts > 1)
      fail("checkpoint.load = '{}', checkpoint.init_from_hf = '{}', checkpoint.init_from_llmc = '{}' and "
           "checkpoint.init_from_checkpoint = '{}': give at most one place to start from (load resumes a run, "
           "init_from_* only takes the weights; with lora.rank > 0 load resumes adapters on one init_from_* base)",
           k.load, k.init_from_hf, k.init_from_llmc, k.init_from_checkpoint);
  }
  if (const CheckpointConfig& k = c.checkpoint; !k.init_from_peft.empty()) {
    if (!k.load.empty())
      fail("checkpoint.init_from_peft = '{}' and checkpoint.load = '{}': the adapters start from one of them; "
           "give one", k.init_from_peft, k.load);
    if (k.init_from_hf.empty() && k.init_from_llmc.empty() && k.init_from_checkpoint.empty())
      fail("checkpoint.init_from_peft = '{}' needs the base model the adapter was trained on: set "
           "checkpoint.init_from_hf (--init-from-hf DIR) or another checkpoint.init_from_*", k.init_from_peft);
    if (c.lora.rank == 0)
      fail("checkpoint.init_from_peft = '{}' with lora.rank = 0: PEFT adapters are trained as LoRA adapters; leave "
           "lora.rank out (mpigpt train takes the adapter's) or set it to the adapter's r", k.init_from_peft);
  }
  if (c.checkpoint.save_interval > 0 && c.checkpoint.save.empty())
    fail("checkpoint.save_interval = {} but checkpoint.save is empty; set checkpoint.save = DIR to save, "
         "or save_interval = 0", c.checkpoint.save_interval);
}

void check_ranges(const Config& c) {
  check_engine_ranges(c);
  check_model_ranges(c.model);
  check_training_ranges(c);
  check_checkpoint_ranges(c);
}

// The expert grid (expert_tp x ep x expert-dp) must re-divide each pipeline stage's ranks.
void check_expert_grid(const ParallelConfig& p, int world_size, int dp) {
  const int dense = world_size / p.pp;  // the expert grid re-divides each pipeline stage's ranks
  if (dense % (p.expert_tp * p.ep) != 0)
    fail("parallel.expert_tp * parallel.ep = {}*{} = {} does not divide the {} ranks of a pipeline stage "
         "(world size {} / parallel.pp {} = tp {} x cp {} x dp {}); choose expert_tp and ep whose product divides {}",
         p.expert_tp, p.ep, p.expert_tp * p.ep, dense, world_size, p.pp, p.tp, p.cp, dp, dense);
  if (p.ep * p.expert_tp > 1) {
    // The expert grid (expert_tp, ep, expert-dp) must re-divide the same ranks of each pipeline
    // stage as the dense grid (tp, cp, dp): both grids must give every rank the same pp coordinate,
    // so the axes before pp in parallel.order must hold the same number of ranks in both.
    int dense_stride = 1, expert_stride = 1;
    std::vector<std::string> before;
    for (const std::string& a : parse_order(p.order)) {
      if (a == "pp") break;
      before.push_back(a);
      dense_stride *= a == "tp" ? p.tp : a == "cp" ? p.cp : a == "dp" ? dp : 1;
      expert_stride *= a == "tp" ? p.expert_tp : a == "ep" ? p.ep : a == "dp" ? dense / (p.expert_tp * p.ep) : 1;
    }
    if (dense_stride != expert_stride)
      fail("parallel.order = {} cannot hold expert parallelism here: the axes before pp ({}) span {} ranks of the "
           "dense grid (tp {}, cp {}, dp {}) but {} of the expert grid (expert_tp {}, ep {}, expert-dp {}), so an "
           "expert group would straddle pipeline stages{}; put pp last in parallel.order (e.g. tp-cp-ep-dp-pp)",
           p.order, before.empty() ? std::string("none") : fmt::format("{}", fmt::join(before, "-")), dense_stride,
           p.tp, p.cp, dp, expert_stride, p.expert_tp, p.ep, dense / (p.expert_tp * p.ep),
           p.cp > 1 ? " (the expert grid has no cp axis: ep takes the place of cp and dp)" : "");
  }
}

// The model's dimensions must split over the layout: layers over the pipeline, heads and MLP over
// tp, the sequence over cp.
void check_model_split(const ModelConfig& m, const ParallelConfig& p) {
  pipeline_layers(p, m.num_layers);
  if (m.num_heads % p.tp != 0)
    fail("model.num_heads = {} is not divisible by parallel.tp = {}; each tp rank holds whole heads: "
         "choose a tp that divides num_heads", m.num_heads, p.tp);
  if (m.num_kv_heads % p.tp != 0)
    fail("model.num_kv_heads = {} is not divisible by parallel.tp = {}; each tp rank holds whole key/value "
         "heads: choose a tp that divides num_kv_heads", m.num_kv_heads, p.tp);
  if (m.ffn_hidden % p.tp != 0)
    fail("model.ffn_hidden = {} is not divisible by parallel.tp = {}; each tp rank holds an equal share of the "
         "MLP columns: choose ffn_hidden as a multiple of {}", m.ffn_hidden, p.tp, p.tp);
  if (m.num_heads % m.num_kv_heads != 0)
    fail("model.num_heads = {} is not divisible by model.num_kv_heads = {}; each key/value head serves a "
         "whole group of query heads: choose num_kv_heads dividing num_heads", m.num_heads, m.num_kv_heads);
  if (m.hidden % m.num_heads != 0)
    fail("model.hidden = {} is not divisible by model.num_heads = {}; the head dimension hidden/num_heads "
         "must be whole: change hidden or num_heads", m.hidden, m.num_heads);
  if (m.family == "llama" && (m.hidden / m.num_heads) % 2 != 0)
    fail("model.hidden / model.num_heads = {}/{} = {} is odd; RoPE (model.family = llama) rotates pairs of "
         "channels, so make the head dimension even", m.hidden, m.num_heads, m.hidden / m.num_heads);
  if (p.cp > 1 && m.seq_len % (2 * p.cp) != 0)
    fail("model.seq_len = {} is not divisible by 2 * parallel.cp = {}; context parallelism splits the "
         "sequence into 2*cp load-balanced chunks: make seq_len a multiple of {}", m.seq_len, 2 * p.cp, 2 * p.cp);
  if (m.family == "gpt2" && m.qkv_bias)
    fail("model.qkv_bias = true is for model.family = llama (Qwen2's biased query, key and value projections); "
         "GPT-2 has a bias on every projection already: leave qkv_bias out");
  if (m.family == "gpt2" && m.max_position < m.seq_len)
    fail("model.max_position = {} is smaller than model.seq_len = {}; the learned position table needs a row "
         "per position: set max_position >= seq_len (or 0 for = seq_len)", m.max_position, m.seq_len);
}

// Needs check_ranges() first: the sizes here are known positive.
void check_layout(const Config& c, int world_size) {
  const ParallelConfig& p = c.parallel;
  const EngineConfig& e = c.engine;
  const TrainingConfig& t = c.training;
  const ModelConfig& m = c.model;
  const int dp = c.dp(world_size);

  check_expert_grid(p, world_size, dp);

  if (e.comm == "nccl" && e.backend != "cuda")
    fail("engine.comm = nccl needs engine.backend = cuda (it is {}): NCCL moves GPU memory, host tensors always go "
         "through MPI; set engine.comm = auto (or mpi), or engine.backend = cuda", e.backend);
  if (e.attention_backend == "cudnn") check_cudnn_attention(c);
  if (e.overlap_param_gather && !(e.distributed_optimizer && e.overlap_grad_reduce))
    fail("engine.overlap_param_gather = true needs engine.distributed_optimizer = true and "
         "engine.overlap_grad_reduce = true (they are {} and {}); turn both on or overlap_param_gather off",
         e.distributed_optimizer, e.overlap_grad_reduce);
  if (t.precision == "bf16" && e.grad_accum_dtype != "fp32")
    fail("training.precision = bf16 needs engine.grad_accum_dtype = fp32 (it is {}): bf16 gradients lose "
         "small updates when accumulated; set engine.grad_accum_dtype = fp32", e.grad_accum_dtype);

  const int64_t per_step = int64_t{t.micro_batch} * dp;
  if (t.global_batch % per_step != 0)
    fail("training.global_batch = {} is not divisible by training.micro_batch * dp = {}*{} = {} "
         "(dp = world size {} / (tp*pp*cp)); set global_batch to a multiple of {}",
         t.global_batch, t.micro_batch, dp, per_step, world_size, per_step);

  check_model_split(m, p);

  if (p.ep > 1 && p.tp > 1 && !p.sequence_parallel)
    fail("parallel.ep = {} with parallel.tp = {} needs parallel.sequence_parallel = true (the MoE token "
         "dispatch works on tp-sharded sequences); turn sequence_parallel on", p.ep, p.tp);
  // sequence_parallel at tp = 1 is accepted and does nothing (Megatron turns it off with a warning).
  if (p.sequence_parallel && p.tp > 1 && (m.seq_len / p.cp) % p.tp != 0) {
    if (p.cp > 1)
      fail("model.seq_len / parallel.cp = {}/{} = {} is not divisible by parallel.tp = {}; sequence_parallel "
           "shards each rank's tokens over tp: make seq_len a multiple of cp*tp = {}",
           m.seq_len, p.cp, m.seq_len / p.cp, p.tp, p.cp * p.tp);
    fail("model.seq_len = {} is not divisible by parallel.tp = {}; parallel.sequence_parallel shards the "
         "sequence over tp: make seq_len a multiple of {} or turn sequence_parallel off", m.seq_len, p.tp, p.tp);
  }

  if (p.vpp > 1) {
    if (p.pp == 1)
      fail("parallel.vpp = {} needs parallel.pp > 1 (it is 1); virtual stages interleave pipeline ranks: "
           "set vpp = 1 or pp > 1", p.vpp);
    const int64_t micro = t.global_batch / per_step;
    if (micro % p.pp != 0)
      fail("the interleaved schedule (parallel.vpp = {}) needs the number of micro-batches, "
           "training.global_batch / (training.micro_batch * dp) = {}/({}*{}) = {}, to be divisible by "
           "parallel.pp = {}; make global_batch a multiple of {}", p.vpp, t.global_batch, t.micro_batch, dp,
           micro, p.pp, per_step * p.pp);
  }
}

void check_moe(const Config& c) {
  const ModelConfig& m = c.model;
  const ParallelConfig& p = c.parallel;
  one_of("parallel.moe_dispatcher", p.moe_dispatcher, {"alltoall", "allgather"});
  at_least("model.num_experts", m.num_experts, 0);
  if (m.num_experts == 0) {
    if (p.ep > 1 || p.expert_tp > 1)
      fail("parallel.ep = {} and parallel.expert_tp = {} split the experts of a mixture-of-experts model, but "
           "model.num_experts = 0 (dense); set num_experts > 0 or ep = expert_tp = 1", p.ep, p.expert_tp);
    return;
  }
  one_of("model.moe_router", m.moe_router, {"softmax", "sigmoid"});
  one_of("model.moe_drop_policy", m.moe_drop_policy, {"probs", "position"});
  at_least("model.moe_top_k", m.moe_top_k, 1);
  if (m.moe_top_k > m.num_experts)
    fail("model.moe_top_k = {} exceeds model.num_experts = {}; each token is routed to K distinct experts: set "
         "moe_top_k <= {}", m.moe_top_k, m.num_experts, m.num_experts);
  at_least("model.moe_ffn_hidden", m.moe_ffn_hidden, 0);
  at_least("model.moe_shared_expert_ffn", m.moe_shared_expert_ffn, 0);
  if (m.moe_aux_loss_coeff < 0)
    fail("model.moe_aux_loss_coeff = {} must not be negative; the usual value is 0.01 (0: off)", m.moe_aux_loss_coeff);
  if (m.moe_z_loss_coeff < 0)
    fail("model.moe_z_loss_coeff = {} must not be negative; the usual value is 1e-3 (0: off)", m.moe_z_loss_coeff);
  if (m.moe_capacity_factor < 0)
    fail("model.moe_capacity_factor = {} must not be negative; set 0 for dropless routing or e.g. 1.25",
         m.moe_capacity_factor);
  if (c.user_set.count("model.moe_capacity_factor") && m.moe_capacity_factor <= 0 &&
      c.user_set.count("model.moe_drop_policy"))
    fail("model.moe_drop_policy = {} is set but model.moe_capacity_factor = {} means dropless routing (nothing is "
         "dropped); set a capacity factor > 0 (e.g. 1.25) or leave moe_drop_policy out", m.moe_drop_policy,
         m.moe_capacity_factor);
  parse_moe_layers(m.moe_layers, m.num_layers);
  if (m.num_experts % p.ep != 0)
    fail("model.num_experts = {} is not divisible by parallel.ep = {}; each expert-parallel rank holds an equal "
         "share of the experts: choose ep dividing num_experts", m.num_experts, p.ep);
  const int expert_ffn = m.moe_ffn_hidden > 0 ? m.moe_ffn_hidden : m.ffn_hidden;
  if (p.expert_tp > 1 && expert_ffn % p.expert_tp != 0)
    fail("model.moe_ffn_hidden = {} is not divisible by parallel.expert_tp = {}; each expert-tp rank holds an equal "
         "share of every expert's hidden units: choose moe_ffn_hidden as a multiple of {}", expert_ffn, p.expert_tp,
         p.expert_tp);
  if (p.tp > 1 && !p.sequence_parallel)
    fail("model.num_experts = {} with parallel.tp = {} needs parallel.sequence_parallel = true: each tp rank must "
         "route its own share of the tokens (as Megatron requires); turn sequence_parallel on", m.num_experts, p.tp);
}

void check_lora(const Config& c) {
  const LoraConfig& l = c.lora;
  const ModelConfig& m = c.model;
  at_least("lora.rank", l.rank, 0);
  if (l.rank == 0) return;
  if (!(l.alpha > 0)) fail("lora.alpha = {} must be positive; the adapters' update is scaled by alpha / rank (e.g. 16)", l.alpha);
  if (l.dropout != 0)
    fail("lora.dropout = {} is not supported: the adapters train without dropout; set lora.dropout = 0", l.dropout);
  const std::set<std::string> targets = lora_target_set(l.targets);
  int smallest = m.hidden;  // every target reads or writes the C channels; the MLP's also the F hidden units
  for (const std::string& t : targets) {
    if ((t == "gate" || t == "up") && m.family != "llama")
      fail("lora.targets = '{}': '{}' is a projection of SwiGLU's MLP; a model.family = {} MLP has one up projection: "
           "adapt it as fc1", l.targets, t, m.family);
    if (t == "qkv" || t == "q" || t == "k" || t == "v" || t == "proj") continue;
    smallest = std::min(smallest, m.ffn_hidden);
    if (m.num_experts > 0 && m.moe_ffn_hidden > 0) smallest = std::min(smallest, m.moe_ffn_hidden);  // per expert
  }
  if (l.rank > smallest)
    fail("lora.rank = {} is larger than the smallest adapted layer's {} features (model.hidden = {}, model.ffn_hidden "
         "= {}{}): a low-rank update needs rank <= {}; lower lora.rank (e.g. 8 or 16)", l.rank, smallest, m.hidden,
         m.ffn_hidden, m.num_experts > 0 ? fmt::format(", model.moe_ffn_hidden = {}", m.moe_ffn_hidden) : "", smallest);
}

}  // namespace

std::vector<bool> parse_moe_layers(const std::string& spec, int num_layers) {
  std::vector<bool> moe(static_cast<size_t>(std::max(num_layers, 0)), false);
  const char* syntax = "write all, every:N (the layers whose index % N == N-1) or a comma list of layer indices "
                       "such as 1,3";
  auto number = [&](const std::string& t) {
    int v = -1;
    auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (t.empty() || ec != std::errc() || end != t.data() + t.size() || v < 0)
      fail("model.moe_layers = '{}': '{}' is not a non-negative integer; {}", spec, t, syntax);
    return v;
  };
  if (spec == "all") {
    moe.assign(moe.size(), true);
  } else if (spec.rfind("every:", 0) == 0) {
    const int n = number(spec.substr(6));
    if (n < 1) fail("model.moe_layers = '{}': N must be at least 1; {}", spec, syntax);
    for (int l = 0; l < num_layers; ++l) moe[l] = l % n == n - 1;
  } else {
    for (const std::string& t : split(spec, ',')) {
      const int l = number(t);
      if (l >= num_layers)
        fail("model.moe_layers = '{}' names layer {} but model.num_layers = {} (layers 0..{}); name existing layers",
             spec, l, num_layers, num_layers - 1);
      moe[l] = true;
    }
  }
  if (std::find(moe.begin(), moe.end(), true) == moe.end())
    fail("model.moe_layers = '{}' selects no layer of model.num_layers = {}; {}", spec, num_layers, syntax);
  return moe;
}

std::vector<int> pipeline_layers(const ParallelConfig& p, int num_layers) {
  const int stages = p.pp * p.vpp;
  if (p.pipeline_layout.empty()) {
    if (num_layers % stages != 0)
      fail("model.num_layers = {} is not divisible by parallel.pp * parallel.vpp = {}*{} = {}; every virtual stage "
           "needs the same number of layers: change num_layers, pp or vpp, or give each stage its count in "
           "parallel.pipeline_layout", num_layers, p.pp, p.vpp, stages);
    return std::vector<int>(size_t(stages), num_layers / stages);
  }
  const std::string& spec = p.pipeline_layout;
  std::vector<int> layers;
  for (const std::string& t : split(spec, ',')) {
    int v = -1;
    auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (t.empty() || ec != std::errc() || end != t.data() + t.size() || v < 0)
      fail("parallel.pipeline_layout = '{}': '{}' is not a number of layers (0 or more); write one count per "
           "virtual stage, e.g. 5,7,7,5", spec, t);
    layers.push_back(v);
  }
  if (int(layers.size()) != stages)
    fail("parallel.pipeline_layout = '{}' has {} entries, but parallel.pp * parallel.vpp = {}*{} = {} virtual "
         "stages need one each (stage v*pp + r is pipeline rank r's chunk v)", spec, layers.size(), p.pp, p.vpp, stages);
  const int total = std::accumulate(layers.begin(), layers.end(), 0);
  if (total != num_layers)
    fail("parallel.pipeline_layout = '{}' adds up to {} layers, but model.num_layers = {}: make the counts add up to "
         "{}", spec, total, num_layers, num_layers);
  return layers;
}

int Config::dp(int world_size) const {
  const ParallelConfig& p = parallel;
  if (world_size < 1) fail("the world size {} must be at least 1; launch with mpirun -np N", world_size);
  if (p.tp < 1 || p.pp < 1 || p.cp < 1)
    fail("parallel.tp, parallel.pp and parallel.cp must be at least 1 (they are {}, {}, {})", p.tp, p.pp, p.cp);
  const int64_t model_parallel = int64_t{p.tp} * p.pp * p.cp;
  if (world_size % model_parallel != 0)
    fail("parallel.tp * parallel.pp * parallel.cp = {}*{}*{} = {} does not divide the world size {}; "
         "launch a multiple of {} ranks or change the sizes", p.tp, p.pp, p.cp, model_parallel, world_size,
         model_parallel);
  return static_cast<int>(world_size / model_parallel);
}

void Config::validate(int world_size) const {
  check_ranges(*this);
  check_layout(*this, world_size);
  check_moe(*this);
  check_lora(*this);
}

}  // namespace mpigpt
