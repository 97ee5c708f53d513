// Configuration validation: every cross-check between the sections, run once before anything is
// built, so that a bad layout fails at start with the fields, their values and the fix instead
// of hanging or corrupting a run hours later. The first violation throws.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <sstream>

#include "io/config.h"
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

void check_no_decay(const std::string& list) {
  for (const std::string& kind : split(list, ','))
    if (kind != "norms" && kind != "biases" && kind != "embeddings")
      fail("training.no_decay = '{}': '{}' is not a parameter kind; write a comma-separated subset of "
           "norms,biases,embeddings (or nothing to decay every parameter)", list, kind);
}

void check_ranges(const Config& c) {
  const ParallelConfig& p = c.parallel;
  const EngineConfig& e = c.engine;
  const TrainingConfig& t = c.training;
  const ModelConfig& m = c.model;

  one_of("model.family", m.family, {"gpt2", "llama"});
  one_of("training.lr_schedule", t.lr_schedule, {"cosine", "linear", "constant"});
  one_of("engine.recompute", e.recompute, {"none", "selective", "full"});
  one_of("engine.grad_accum_dtype", e.grad_accum_dtype, {"fp32", "bf16"});
  one_of("training.precision", t.precision, {"fp32", "bf16"});
  one_of("engine.backend", e.backend, {"cpu", "cuda"});
  one_of("parallel.cp_comm_type", p.cp_comm_type, {"p2p", "all_gather"});
  one_of("data.tokenizer", c.data.tokenizer, {"byte", "gpt2"});
  parse_order(p.order);  // the rank grid's own check
  check_no_decay(t.no_decay);

  at_least("parallel.tp", p.tp, 1);
  at_least("parallel.pp", p.pp, 1);
  at_least("parallel.vpp", p.vpp, 1);
  at_least("parallel.cp", p.cp, 1);
  at_least("parallel.ep", p.ep, 1);
  at_least("parallel.expert_tp", p.expert_tp, 1);
  at_least("engine.bucket_size", e.bucket_size, int64_t{1});
  at_least("engine.threads", e.threads, 0);

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

  at_least("training.micro_batch", t.micro_batch, 1);
  at_least("training.global_batch", t.global_batch, 1);
  at_least("training.train_iters", t.train_iters, int64_t{1});
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

  at_least("checkpoint.save_interval", c.checkpoint.save_interval, int64_t{0});
  at_least("checkpoint.keep_last", c.checkpoint.keep_last, 0);
  {
    const CheckpointConfig& k = c.checkpoint;
    const int starts = !k.load.empty() + !k.init_from_hf.empty() + !k.init_from_llmc.empty();
    if (starts > 1)
      fail("checkpoint.load = '{}', checkpoint.init_from_hf = '{}' and checkpoint.init_from_llmc = '{}': give at most "
           "one place to start from (load resumes a run, init_from_* only takes the weights)", k.load, k.init_from_hf,
           k.init_from_llmc);
  }
  if (c.checkpoint.save_interval > 0 && c.checkpoint.save.empty())
    fail("checkpoint.save_interval = {} but checkpoint.save is empty; set checkpoint.save = DIR to save, "
         "or save_interval = 0", c.checkpoint.save_interval);
}

// Needs check_ranges() first: the sizes here are known positive.
void check_layout(const Config& c, int world_size) {
  const ParallelConfig& p = c.parallel;
  const EngineConfig& e = c.engine;
  const TrainingConfig& t = c.training;
  const ModelConfig& m = c.model;
  const int dp = c.dp(world_size);

  const int dense = world_size / p.pp;  // the expert grid re-divides each pipeline stage's ranks
  if (dense % (p.expert_tp * p.ep) != 0)
    fail("parallel.expert_tp * parallel.ep = {}*{} = {} does not divide the {} ranks of a pipeline stage "
         "(world size {} / parallel.pp {}); choose expert_tp and ep whose product divides {}",
         p.expert_tp, p.ep, p.expert_tp * p.ep, dense, world_size, p.pp, dense);

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

  if (m.num_layers % (p.pp * p.vpp) != 0)
    fail("model.num_layers = {} is not divisible by parallel.pp * parallel.vpp = {}*{} = {}; every "
         "virtual stage needs the same number of layers: change num_layers, pp or vpp",
         m.num_layers, p.pp, p.vpp, p.pp * p.vpp);
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
  if (m.family == "gpt2" && m.max_position < m.seq_len)
    fail("model.max_position = {} is smaller than model.seq_len = {}; the learned position table needs a row "
         "per position: set max_position >= seq_len (or 0 for = seq_len)", m.max_position, m.seq_len);

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

}  // namespace

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
}

}  // namespace mpigpt
