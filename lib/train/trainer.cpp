// The training loop.
#include "lib/train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <csignal>
#include <thread>
#include <cmath>

#include "io/data/dataset.h"
#include "io/data/loss_mask.h"
#include "io/data/tokenizer.h"
#include "io/formats/hf_format.h"
#include "io/formats/llmc_model.h"
#include "io/formats/peft_format.h"
#include "lib/core/log.h"
#include "lib/core/rng.h"
#include "lib/optim/adamw.h"
#include "lib/optim/lr_schedule.h"
#include "lib/train/checkpointing.h"
#include "lib/train/metrics.h"
#include "lib/train/model_runner.h"
#include "lib/train/peak.h"
#include "parallel/mpi_env.h"

namespace mpigpt {

using Clock = std::chrono::steady_clock;

// Targets that count towards the loss (negative ids are ignored positions).
static int64_t count_targets(const int32_t* begin, const int32_t* end) {
  return std::count_if(begin, end, [](int32_t t) { return t >= 0; });
}
static double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

GptDims make_dims(const Config& cfg, int vocab_size) {
  const ModelConfig& m = cfg.model;
  GptDims d;
  d.family = m.family == "llama" ? Family::Llama : Family::GPT2;
  d.L = m.num_layers;
  d.C = m.hidden;
  d.NH = m.num_heads;
  d.NKV = m.num_kv_heads > 0 ? m.num_kv_heads : m.num_heads;
  d.F = m.ffn_hidden;
  d.T = m.seq_len;
  d.maxT = m.max_position > 0 ? m.max_position : m.seq_len;
  if (m.vocab_size > 0 && m.vocab_size < vocab_size)
    fail("model.vocab_size = {} is smaller than the tokenizer's vocabulary {}; set it to 0 (use the tokenizer's) "
         "or at least {}", m.vocab_size, vocab_size, vocab_size);
  d.V = m.vocab_size > 0 ? m.vocab_size : vocab_size;
  d.Vp = pad_vocab(d.V, m.vocab_multiple * cfg.parallel.tp);
  d.tied = m.tie_embeddings;
  d.eps = float(m.norm_eps);
  d.act = cfg.training.precision == "bf16" ? DType::BF16 : DType::F32;
  d.rope_theta = float(m.rope_theta);
  d.qkv_bias = m.qkv_bias;
  d.init_std = float(m.init_std);
  if (m.num_experts > 0) {
    d.moe.E = m.num_experts;
    d.moe.K = m.moe_top_k;
    d.moe.sigmoid = m.moe_router == "sigmoid";
    d.moe.norm_topk = m.moe_norm_topk_prob;
    d.moe.aux_coeff = float(m.moe_aux_loss_coeff);
    d.moe.z_coeff = float(m.moe_z_loss_coeff);
    d.moe.capacity_factor = float(m.moe_capacity_factor);
    d.moe.drop_position = m.moe_drop_policy == "position";
    d.moe.F = m.moe_ffn_hidden > 0 ? m.moe_ffn_hidden : m.ffn_hidden;
    d.moe.shared_F = m.moe_shared_expert_ffn;
    d.moe.layers = parse_moe_layers(m.moe_layers, m.num_layers);
  }
  if (cfg.lora.rank > 0) {
    d.lora.rank = cfg.lora.rank;
    d.lora.alpha = float(cfg.lora.alpha);
    d.lora.rslora = cfg.lora.rslora;
    static const std::map<std::string, LoraTarget> bits = {
        {"qkv", kLoraQkv}, {"proj", kLoraProj}, {"fc1", kLoraFc1}, {"fc2", kLoraFc2}, {"q", kLoraQ},
        {"k", kLoraK},     {"v", kLoraV},       {"gate", kLoraGate}, {"up", kLoraUp}};
    d.lora.targets = 0;
    for (const std::string& t : lora_target_set(cfg.lora.targets)) d.lora.targets |= bits.at(t);
  }
  return d;
}

namespace {

volatile std::sig_atomic_t g_signal = 0;  // the first SIGTERM or SIGINT received, 0 if none
std::atomic<int64_t> g_signal_ns{0};        // when it came (steady clock; lock-free, so signal-safe)
static_assert(std::atomic<int64_t>::is_always_lock_free);
extern "C" void on_stop_signal(int sig) {
  if (g_signal == 0) {
    g_signal = sig;
    g_signal_ns = std::chrono::steady_clock::now().time_since_epoch().count();
  }
  g_console_best_effort = 1;
  if (sig == SIGINT) std::signal(SIGINT, SIG_DFL);  // a second Ctrl-C stops at once
}

// For the duration of a training run, SIGTERM (Slurm before the time limit, kill, timeout, mpirun
// passing on its own) and SIGINT (Ctrl-C) end the run at the next step boundary, after a save.
// Without SA_RESTART: a write to a console that nobody reads any more returns (log.h).
class TerminationGuard {
 public:
  TerminationGuard() {
    g_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, &term_), sigaction(SIGINT, &sa, &int_);
  }
  ~TerminationGuard() {
    sigaction(SIGTERM, &term_, nullptr), sigaction(SIGINT, &int_, nullptr);
    g_console_best_effort = 0;
  }
  int signal() const { return g_signal; }
  double seconds_since() const {
    const std::chrono::steady_clock::duration since(g_signal_ns.load());
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch() - since).count();
  }

 private:
  struct sigaction term_ {}, int_ {};
};

// Where the tokens of a step come from: the prepared dataset, or random ids for benchmarks (with a
// random validation stream of its own).
struct Batches {
  std::unique_ptr<GptDataset> train, valid;
  int T = 0, V = 0;
  uint64_t seed = 0;
  // tokens/targets of global sample `index` of the train (or validation) split; with packed
  // sequences (positions given) also the positions within documents, and no target crosses
  // from one document into the next.
  void get(bool is_train, int64_t index, int32_t* tokens, int32_t* targets, int32_t* positions) const {
    const GptDataset* ds = is_train ? train.get() : valid.get();
    if (ds) return ds->get(index, tokens, targets, positions);
    for (int t = 0; positions && t < T; ++t) positions[t] = t;  // random tokens: one document per row
    for (int t = 0; t <= T; ++t) {  // synthetic: a random stream, targets shifted by one
      int32_t id = int32_t(bits_at(seed, is_train ? 1 : 2, uint64_t(index) * (T + 1) + t) % uint64_t(V));
      if (t < T) tokens[t] = id;
      if (t > 0) targets[t - 1] = id;
    }
  }
};

// The tokenizer's vocabulary (the model's, with random tokens).
int vocab_size(const Config& cfg, bool synthetic) {
  if (synthetic) return cfg.model.vocab_size > 0 ? cfg.model.vocab_size : 50257;
  auto tok = make_tokenizer(cfg.data);
  if (cfg.data.path.empty())
    fail("data.path is not set; prepare a dataset with `mpigpt prepare-data --output PREFIX FILES...` and pass "
         "--data.path PREFIX");
  return tok->vocab_size();
}

// The train and validation splits of data.path (or data.valid_path); none with random tokens.
Batches open_batches(const Config& cfg, const GptDims& d, bool synthetic) {
  Batches data;
  data.T = d.T;
  data.V = d.V;
  const uint64_t seed = data.seed = cfg.training.seed;
  if (synthetic) return data;
  auto src = TokenSource::open(cfg.data.path);
  const bool shuffle = cfg.data.shuffle;
  if (!cfg.data.valid_path.empty()) {
    data.train = std::make_unique<GptDataset>(src, Split::Train, 0.0, d.T, seed, d.V, shuffle);
    data.valid = std::make_unique<GptDataset>(TokenSource::open(cfg.data.valid_path), Split::Train, 0.0, d.T, seed,
                                              d.V, shuffle);
  } else {
    const double vf = cfg.data.valid_fraction;
    data.train = std::make_unique<GptDataset>(src, Split::Train, vf, d.T, seed, d.V, shuffle);
    if (vf > 0) data.valid = std::make_unique<GptDataset>(src, Split::Valid, vf, d.T, seed, d.V, shuffle);
  }
  return data;
}

// Warmup, then decay over training.decay_iters, or (0) until the last iteration.
LrSchedule lr_schedule(const TrainingConfig& tc) {
  return {tc.lr, tc.min_lr, tc.warmup_iters,
          tc.decay_iters > 0 ? tc.decay_iters : std::max<int64_t>(tc.train_iters - tc.warmup_iters, 0),
          parse_decay_style(tc.lr_schedule)};
}

// What one training step measured.
struct StepResult {
  double loss = 0, aux = 0, load = 0, norm = 0, lr = 0, ms = 0;
};

// Sums over the steps since the last log line.
struct Interval {
  double loss = 0, ms = 0, aux = 0, load = 0;
  int steps = 0;
};

// One training run: the constructor builds the data, the model shard with its optimizer and the
// metrics from the config and logs them; loop() trains and returns what the run measured.
class TrainingRun {
 public:
  TrainingRun(const Config& cfg, const Mesh& mesh, Ops& backend, const TrainOptions& opts);
  TrainResult loop();

 private:
  bool logs() const { return mesh_.rank() == 0 && !opts_.quiet; }
  void log_setup() const;
  void load_start();
  void warn_data_changes(const Config& saved) const;
  StepResult step(int64_t it);
  int64_t read_batch(int64_t it, bool train);
  void record(int64_t it, const StepResult& s);
  void log_interval(int64_t it, const StepResult& s);
  void validate(int64_t it);
  double evaluate();
  bool save_or_stop(int64_t it, double lr, const TerminationGuard& term);
  void save(int64_t it, double lr);
  void take_backend_notes();

  const Config& cfg_;
  const TrainingConfig& tc_;
  const Mesh& mesh_;
  const TrainOptions& opts_;
  // Losses are summed over the data- and context-parallel ranks (each cp rank holds a share of its
  // rows' tokens); token counts over the data-parallel ranks alone (every cp rank of a data-parallel
  // rank reads the same rows).
  const Comm& dp_cp_;
  const Comm& dp_;
  // The loss lives on the last pipeline stage; one rank there logs.
  const bool last_rank_;
  Ops& ops_;
  const GptDims d_;
  const bool moe_;
  Batches data_;
  const int per_rank_, num_micro_;  // sequences and micro-batches of this data-parallel rank per step
  ModelRunner runner_;
  const LrSchedule sched_;
  const MfuPeak peak_;
  // The groups whose traffic the last step reports (the comm layer counts every call).
  const std::vector<std::pair<std::string, const Comm*>> groups_;
  // A step's (or an evaluation's) rows; positions within documents only when sequences are packed
  // (else every row is one document).
  std::vector<int32_t> tokens_, targets_, positions_;
  MetricsWriter metrics_{std::string()};
  TrainResult result_;
  Interval interval_;
  double total_ms_ = 0;
};

TrainingRun::TrainingRun(const Config& cfg, const Mesh& mesh, Ops& backend, const TrainOptions& opts)
    : cfg_(cfg),
      tc_(cfg.training),
      mesh_(mesh),
      opts_(opts),
      dp_cp_(mesh.dp_cp()),
      dp_(mesh.dp()),
      last_rank_(mesh.coords().pp == cfg.parallel.pp - 1 && mesh.coords().tp == 0 && mesh.coords().cp == 0 &&
                 mesh.coords().dp == 0),
      ops_(backend),
      d_(make_dims(cfg, vocab_size(cfg, opts.synthetic_data))),
      moe_(d_.moe.E > 0),
      data_(open_batches(cfg, d_, opts.synthetic_data)),
      per_rank_(tc_.global_batch / dp_.size()),
      num_micro_(per_rank_ / tc_.micro_batch),
      runner_(cfg, d_, mesh, ops_),
      sched_(lr_schedule(tc_)),
      peak_(mfu_peak(tc_.peak_tflops, backend, node_ranks(mesh.world().mpi()).local_size,
                     std::thread::hardware_concurrency())),
      groups_{{"tp", &mesh.tp()},
              {"pp", &mesh.pp()},
              {"cp", &mesh.cp()},
              {"dp_cp", &mesh.dp_cp()},
              {"embedding", &mesh.embedding()},
              {"mp", &mesh.mp()},
              {"world", &mesh.world()},
              {"ep", &mesh.ep()},
              {"expert_tp", &mesh.expert_tp()},
              {"expert_tp_ep", &mesh.expert_tp_ep()},
              {"expert_dp", &mesh.expert_dp()},
              {"tp_cp", &mesh.tp_cp()}} {
  log_setup();
  const size_t rows = size_t(per_rank_);
  tokens_.resize(rows * d_.T);
  targets_.resize(rows * d_.T);
  positions_.resize(cfg.engine.sequence_packing ? rows * d_.T : 0);
  metrics_ = MetricsWriter(last_rank_ ? tc_.metrics_file : std::string());  // after the setup's log lines
  if (!cfg.checkpoint.save.empty()) check_save_dir(mesh.world(), cfg.checkpoint.save, checkpoint_bytes(d_));
  result_.flops_per_step = d_.train_flops_per_token() * double(tc_.global_batch) * d_.T / mesh.world_size();  // per rank
  result_.peak_flops = peak_.flops;
  result_.memory = runner_.memory();
  result_.bubble = simulate(runner_.schedule(), cfg.parallel.pp, cfg.parallel.vpp, 1.0, 2.0).bubble;
  load_start();
}

void TrainingRun::log_setup() const {
  if (!logs()) return;
  const GptDims& d = d_;
  log_line("mesh: {}", mesh_.describe());
  log_line("model: {}{} {} layers, {} channels, {} heads ({} kv), ffn {}, seq {}, vocab {} (padded {}), {:.2f}M "
           "parameters", d.gpt2() ? "gpt2" : "llama", d.qkv_bias ? " with q/k/v biases" : "", d.L, d.C, d.NH, d.NKV,
           d.F, d.T, d.V, d.Vp, d.num_params() / 1e6);
  if (moe_) {
    std::string layers;
    for (int l = 0; l < d.L; ++l)
      if (d.is_moe(l)) layers += fmt::format("{}{}", layers.empty() ? "" : ",", l);
    log_line("moe: {} experts, top-{} ({} router), expert ffn {}{}, layers {}, aux {} z {}, {}", d.moe.E, d.moe.K,
             d.moe.sigmoid ? "sigmoid" : "softmax", d.moe.F,
             d.moe.shared_F > 0 ? fmt::format(", shared expert ffn {}", d.moe.shared_F) : std::string(), layers,
             d.moe.aux_coeff, d.moe.z_coeff,
             d.moe.capacity_factor > 0 ? fmt::format("capacity factor {} ({} drop)", d.moe.capacity_factor,
                                                     d.moe.drop_position ? "position" : "probs")
                                       : std::string("dropless"));
  }
  if (d.lora.on()) {
    int64_t trained = 0, all = 0;
    for (const ParamInfo& p : build_param_table(d)) all += p.numel(), trained += p.frozen ? 0 : p.numel();
    log_line("lora: rank {}, alpha {} (scale {}), targets {}: {:.3f}M adapter parameters trained ({:.2f}% of {:.2f}M), "
             "the rest frozen", d.lora.rank, d.lora.alpha, d.lora.scale(), cfg_.lora.targets, trained / 1e6,
             100.0 * double(trained) / double(all), all / 1e6);
  }
  log_line("batch: global {} = {} data-parallel ranks x {} micro-batches x {} sequences of {} tokens",
           tc_.global_batch, dp_.size(), num_micro_, tc_.micro_batch, d.T);
  if (data_.train) {
    const LossMask* mask = data_.train->source().loss_mask();
    log_line("data: {} ({} train samples per epoch{}){}", cfg_.data.path, data_.train->samples_per_epoch(),
             data_.valid ? fmt::format(", {} validation", data_.valid->samples_per_epoch()) : std::string(),
             mask ? fmt::format("; loss mask {}: {:.1f}% of the tokens count", mask->path(),
                                100.0 * double(mask->counted()) / double(data_.train->source().num_tokens()))
                  : std::string());
  }
  const DpMemory mem = runner_.memory();
  // In bf16 the compute copy of the weights comes on top of the fp32 masters.
  const int64_t copy = d.act == DType::F32 ? 0 : mem.params / 4 * int64_t(dtype_size(d.act));
  log_line("memory per rank: parameters {:.1f} MiB{}, gradients {:.1f} MiB, optimizer state {:.1f} MiB{}",
           mem.params / 1048576.0,
           copy > 0 ? fmt::format(" + {:.1f} MiB {} copy", copy / 1048576.0, dtype_name(d.act)) : std::string(),
           mem.grads / 1048576.0, mem.optimizer / 1048576.0, cfg_.engine.distributed_optimizer ? " (distributed)" : "");
  if (peak_.flops > 0)
    log_line("MFU: against {:.1f} GFLOP/s per rank ({})", peak_.flops / 1e9, peak_.what);
  else
    log_line("{}", peak_.what);
}

// The weights to start from, or the state to resume: the weights, Adam state and step count from
// the save; the data order and the learning rate follow from the iteration alone.
void TrainingRun::load_start() {
  const CheckpointConfig& ck = cfg_.checkpoint;
  // A model to start from, its vocabulary grown to model.vocab_size when that is larger (added
  // tokens) and re-padded to this layout's padding (llm.c pads to 128, a layout to 128 * tp).
  const bool hf = !ck.init_from_hf.empty(), llmc = !ck.init_from_llmc.empty();
  if (hf || llmc || !ck.init_from_checkpoint.empty()) {
    const std::string& from = hf ? ck.init_from_hf : llmc ? ck.init_from_llmc : ck.init_from_checkpoint;
    int vocab = 0;
    TensorMap w;
    if (hf) {
      read_hf_config(from, &vocab);
      w = load_hf_model(from, cfg_.model, vocab, vocab);
    } else if (llmc) {
      w = read_llmc_model(from, nullptr, &vocab, nullptr);
    } else {  // an mpigpt save: its weights only (Megatron's --finetune)
      Config saved;
      w = read_model_tensors(from, &saved, "checkpoint.init_from_checkpoint = " + from);
      vocab = saved.model.vocab_size;
    }
    grow_vocab(w, vocab, d_.V, d_.Vp, from);
    if (!ck.init_from_peft.empty()) w.merge(load_peft_adapter(ck.init_from_peft, cfg_.model, cfg_.lora));
    load_weights(runner_, w, from);
    if (logs())
      log_line("weights: from the {} {}{}", hf ? "Hugging Face model" : llmc ? "llm.c model" : "checkpoint", from,
               (ck.init_from_peft.empty() ? std::string() : "; LoRA adapters from the PEFT adapter " + ck.init_from_peft) +
                   (d_.V > vocab ? fmt::format("; vocabulary grown from {} to {} words (each new row the mean of "
                                               "the model's rows)", vocab, d_.V)
                                 : std::string()));
  }
  result_.first_iter = 1;
  if (!ck.load.empty()) {
    const CheckpointMeta meta = load_checkpoint(ck.load, runner_, cfg_);
    result_.first_iter = meta.iteration + 1;
    if (logs()) {
      log_line("checkpoint: resumed from {} at iteration {} ({} samples consumed)", resolve_checkpoint(ck.load),
               meta.iteration, meta.consumed_samples);
      warn_data_changes(parse_config_text(meta.saved_config, ck.load + " (its saved configuration)"));
    }
  }
  metrics_.start(result_.first_iter - 1);
}

// A resumed run goes on with the saved run's data order only if it reads the same data the same
// way; another order may be meant (new data, another seed), so it is said, not refused.
void TrainingRun::warn_data_changes(const Config& saved) const {
  for (const char* name : {"data.path", "data.valid_fraction", "data.shuffle", "training.seed"})
    if (const std::string was = config_get(saved, name), now = config_get(cfg_, name); was != now)
      log_line("checkpoint: warning: {} = {} here, {} in the saved run: from here on the samples differ from those "
               "the saved run would have read next", name, now.empty() ? "\"\"" : now, was.empty() ? "\"\"" : was);
}

TrainResult TrainingRun::loop() {
  // SIGTERM (what Slurm sends before the time limit): finish the step, save, exit cleanly.
  TerminationGuard term;
  if (tc_.train_iters == 0) save(0, 0.0);  // the initial model (validation required checkpoint.save)
  for (int64_t it = result_.first_iter; it <= tc_.train_iters; ++it) {
    const StepResult s = step(it);
    record(it, s);
    const bool has_valid = data_.valid || !data_.train;  // synthetic data has a validation stream too
    if (has_valid && tc_.eval_interval > 0 && (it % tc_.eval_interval == 0 || it == tc_.train_iters)) validate(it);
    if (save_or_stop(it, s.lr, term)) break;
  }
  result_.activation_bytes = int64_t(runner_.activation_bytes());
  result_.device_peak_bytes = int64_t(ops_.peak_allocated());
  if (opts_.profile_ops) {  // the last step's
    result_.op_times = ops_.op_times();
    ops_.profile_ops(false);
  }
  return std::move(result_);
}

// Reads this rank's samples of global batch `it` (1-based) of the training or validation split (the
// global batch index alone decides them) and returns the number of targets of the whole batch.
int64_t TrainingRun::read_batch(int64_t it, bool train) {
  int32_t* pos = positions_.empty() ? nullptr : positions_.data();
  for (int j = 0; j < per_rank_; ++j)
    data_.get(train, (it - 1) * tc_.global_batch + int64_t(dp_.rank()) * per_rank_ + j,
              tokens_.data() + size_t(j) * d_.T, targets_.data() + size_t(j) * d_.T,
              pos ? pos + size_t(j) * d_.T : nullptr);
  int64_t count = count_targets(targets_.data(), targets_.data() + size_t(per_rank_) * d_.T);
  dp_.allreduce_sum(&count, 1);
  return count;
}

StepResult TrainingRun::step(int64_t it) {
  const bool last = it == tc_.train_iters;
  if (last)
    for (const auto& g : groups_) g.second->reset_stats();
  if (opts_.profile_ops) ops_.profile_ops(true);
  const auto t0 = Clock::now();
  const int64_t count = std::max<int64_t>(read_batch(it, true), 1);
  double loss_sum = runner_.forward_backward(tokens_.data(), targets_.data(),
                                             positions_.empty() ? nullptr : positions_.data(), num_micro_,
                                             1.0f / float(count));
  dp_cp_.allreduce_sum(&loss_sum, 1);
  // MoE: the aux + z losses of all MoE layers, averaged over the global batch's micro-batches
  // (every cp and tp rank of a data-parallel rank holds the same figure: sum over dp only).
  double moe_stats[2] = {runner_.moe_loss_sum(), runner_.moe_load_imbalance()};
  if (moe_) dp_.allreduce_sum(moe_stats, 2);
  StepResult s;
  s.aux = moe_stats[0] / double(tc_.global_batch / tc_.micro_batch);
  s.load = moe_stats[1] / dp_.size();
  s.loss = loss_sum / double(count);
  s.norm = runner_.grad_norm();
  if (!std::isfinite(s.loss) || !std::isfinite(s.norm))
    fail("iteration {}: loss {} / gradient norm {} is not finite; lower training.lr (now {}) or raise "
         "training.warmup_iters", it, s.loss, s.norm, tc_.lr);
  s.lr = sched_.at(it);
  runner_.optimizer_step(float(s.lr), clip_scale(s.norm, tc_.clip_grad));
  ops_.synchronize();  // a GPU step ends when its queued work does
  s.ms = ms_since(t0);
  take_backend_notes();
  if (last)
    for (const auto& g : groups_) result_.comm_bytes.emplace_back(g.first, g.second->stats().total());
  return s;
}

void TrainingRun::record(int64_t it, const StepResult& s) {
  result_.losses.push_back(s.loss);
  if (moe_) result_.aux_losses.push_back(s.aux), result_.expert_loads.push_back(s.load);
  result_.grad_norms.push_back(s.norm);
  result_.step_ms.push_back(s.ms);
  interval_.loss += s.loss;
  interval_.ms += s.ms;
  interval_.aux += s.aux;
  interval_.load += s.load;
  ++interval_.steps;
  total_ms_ += s.ms;
  if (it % tc_.log_interval == 0 || it == tc_.train_iters) {
    log_interval(it, s);
    interval_ = {};
  }
}

void TrainingRun::log_interval(int64_t it, const StepResult& s) {
  const int64_t GB = tc_.global_batch;
  StepMetrics m;
  m.total_iters = tc_.train_iters;
  m.iter = it;
  m.consumed_samples = it * GB;
  m.lr = s.lr;
  m.loss = interval_.loss / interval_.steps;
  m.has_aux = moe_;
  m.aux_loss = interval_.aux / interval_.steps;
  m.expert_load = interval_.load / interval_.steps;
  m.grad_norm = s.norm;
  m.ms_per_iter = interval_.ms / interval_.steps;
  m.tokens_per_s = double(GB) * d_.T / (m.ms_per_iter / 1e3);
  m.tflops = result_.flops_per_step / (m.ms_per_iter / 1e3) / 1e12;
  m.mfu = peak_.flops > 0 ? m.tflops * 1e12 / peak_.flops : std::nan("");
  m.peak_mem_mib = peak_rss_mib();
  m.eta_s = double(tc_.train_iters - it) * total_ms_ / double(it - result_.first_iter + 1) / 1e3;
  if (last_rank_ && !opts_.quiet) log_line("{}", format_step(m));
  metrics_.step(m);
}

void TrainingRun::validate(int64_t it) {
  const double vl = evaluate();
  take_backend_notes();
  result_.val_losses.emplace_back(it, vl);
  if (last_rank_ && !opts_.quiet) log_line("validation at iter {}: loss {:.4f} (perplexity {:.2f})", it, vl, std::exp(vl));
  metrics_.eval(it, vl);
}

// Mean loss over training.eval_iters global batches of the validation split: the same samples in
// every layout, as in training.
double TrainingRun::evaluate() {
  double loss = 0, count = 0;
  for (int64_t k = 1; k <= tc_.eval_iters; ++k) {
    count += double(read_batch(k, false));
    loss += runner_.forward_only(tokens_.data(), targets_.data(), positions_.empty() ? nullptr : positions_.data(),
                                 num_micro_);
  }
  dp_cp_.allreduce_sum(&loss, 1);
  return loss / std::max(count, 1.0);
}

// Saves when one is due; true when SIGTERM or SIGINT ends the run (after saving).
bool TrainingRun::save_or_stop(int64_t it, double lr, const TerminationGuard& term) {
  // Every rank must agree to stop: the signal may reach the ranks at different moments, or only
  // some of them. SIGTERM, if any rank has it, is the one reported.
  int64_t got[2] = {term.signal() == SIGTERM, term.signal() == SIGINT};
  mesh_.world().allreduce_sum(got, 2);
  const int sig = got[0] ? SIGTERM : got[1] ? SIGINT : 0;
  const CheckpointConfig& ck = cfg_.checkpoint;
  const bool scheduled = ck.save_interval > 0 && it % ck.save_interval == 0;
  if (!ck.save.empty() && (scheduled || it == tc_.train_iters || sig)) save(it, lr);
  if (!sig) return false;
  result_.stop_signal = sig;
  result_.saved = !ck.save.empty();
  if (mesh_.rank() == 0)
    log_line("{}: stopped after iteration {}{}", sig == SIGINT ? "SIGINT" : "SIGTERM", it,
             !result_.saved ? std::string(" (checkpoint.save is not set: nothing saved)")
             : term.signal()  ? fmt::format(", checkpoint saved ({:.1f} s after the signal)", term.seconds_since())
                              : std::string(", checkpoint saved"));
  return true;
}

void TrainingRun::save(int64_t it, double lr) {
  const CheckpointConfig& ck = cfg_.checkpoint;
  const int64_t GB = tc_.global_batch;
  CheckpointMeta meta{it, it * GB, it * GB * d_.T, lr, {}};
  const SaveStats st = save_checkpoint(ck.save, meta, runner_, cfg_, ck.keep_last, opts_.in_save);
  result_.saves.push_back(st);
  if (logs())
    log_line("checkpoint: saved iteration {} to {}/{} ({:.1f} MiB in {:.2f} s, {:.0f} MB/s)", it, ck.save,
             checkpoint_dir_name(it), st.bytes / 1048576.0, st.seconds, st.bytes / 1e6 / st.seconds);
}

// What the backend chose by measuring (with engine.gemm_autotune, the bias-gradient way), logged
// by rank 0; each rank measures and chooses for itself.
void TrainingRun::take_backend_notes() {
  for (std::string& note : ops_.take_notes()) {
    if (logs()) log_line("{}", note);
    if (mesh_.rank() == 0) result_.backend_notes.push_back(std::move(note));
  }
}

}  // namespace

TrainResult train(const Config& cfg, const Mesh& mesh, Ops& backend, const TrainOptions& opts) {
  if (cfg.engine.threads > 0) omp_set_num_threads(cfg.engine.threads);
  TrainingRun run(cfg, mesh, backend, opts);
  return run.loop();
}

}  // namespace mpigpt
