// The training loop.
#include "lib/train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>

#include "io/data/dataset.h"
#include "io/data/tokenizer.h"
#include "io/formats/hf_format.h"
#include "io/formats/llmc_model.h"
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
  return d;
}

namespace {

volatile std::sig_atomic_t g_terminate = 0;
extern "C" void on_sigterm(int) { g_terminate = 1; }

// Installs the SIGTERM handler for the duration of a training run.
class TerminationGuard {
 public:
  TerminationGuard() {
    g_terminate = 0;
    previous_ = std::signal(SIGTERM, on_sigterm);
  }
  ~TerminationGuard() { std::signal(SIGTERM, previous_); }
  bool requested() const { return g_terminate != 0; }

 private:
  void (*previous_)(int) = SIG_DFL;
};

// Where the tokens of a step come from: the prepared dataset, or random ids for benchmarks.
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

}  // namespace

TrainResult train(const Config& cfg, const Mesh& mesh, Ops& backend, const TrainOptions& opts) {
  // Losses are summed over the data- and context-parallel ranks (each cp rank holds a share of its
  // rows' tokens); token counts over the data-parallel ranks alone (every cp rank of a data-parallel
  // rank reads the same rows).
  const Comm& world = mesh.dp_cp();
  const Comm& dp_only = mesh.dp();
  const TrainingConfig& tc = cfg.training;
  const ParallelConfig& pc = cfg.parallel;
  // The loss lives on the last pipeline stage; one rank there logs.
  const Coords& co = mesh.coords();
  const bool last_rank = co.pp == pc.pp - 1 && co.tp == 0 && co.cp == 0 && co.dp == 0;
  Ops* const ops = &backend;
  if (cfg.engine.threads > 0) omp_set_num_threads(cfg.engine.threads);

  // ---- data -------------------------------------------------------------------------------
  Batches data;
  int vocab = 0;
  if (opts.synthetic_data) {
    vocab = cfg.model.vocab_size > 0 ? cfg.model.vocab_size : 50257;
  } else {
    auto tok = make_tokenizer(cfg.data);
    vocab = tok->vocab_size();
    if (cfg.data.path.empty())
      fail("data.path is not set; prepare a dataset with `mpigpt prepare-data --output PREFIX FILES...` and pass "
           "--data.path PREFIX");
  }
  const GptDims d = make_dims(cfg, vocab);
  data.T = d.T;
  data.V = d.V;
  data.seed = tc.seed;
  if (!opts.synthetic_data) {
    auto src = TokenSource::open(cfg.data.path);
    if (!cfg.data.valid_path.empty()) {
      data.train = std::make_unique<GptDataset>(src, Split::Train, 0.0, d.T, tc.seed, d.V);
      data.valid = std::make_unique<GptDataset>(TokenSource::open(cfg.data.valid_path), Split::Train, 0.0, d.T,
                                                tc.seed, d.V);
    } else {
      data.train = std::make_unique<GptDataset>(src, Split::Train, cfg.data.valid_fraction, d.T, tc.seed, d.V);
      if (cfg.data.valid_fraction > 0)
        data.valid = std::make_unique<GptDataset>(src, Split::Valid, cfg.data.valid_fraction, d.T, tc.seed, d.V);
    }
  }

  // ---- model and optimizer ------------------------------------------------------------------
  const int dp = dp_only.size();
  const int MB = tc.micro_batch, GB = tc.global_batch;
  const int per_rank = GB / dp, num_micro = per_rank / MB;
  ModelRunner runner(cfg, d, mesh, *ops);
  LrSchedule sched{tc.lr, tc.min_lr, tc.warmup_iters,
                   tc.decay_iters > 0 ? tc.decay_iters : std::max<int64_t>(tc.train_iters - tc.warmup_iters, 0),
                   parse_decay_style(tc.lr_schedule)};
  const double peak = tc.peak_tflops > 0 ? tc.peak_tflops * 1e12 : measured_peak_flops(backend);
  const double flops_per_step = d.train_flops_per_token() * double(GB) * d.T / mesh.world_size();  // per rank
  if (mesh.rank() == 0 && !opts.quiet) {
    log_line("mesh: {}", mesh.describe());
    log_line("model: {} {} layers, {} channels, {} heads ({} kv), ffn {}, seq {}, vocab {} (padded {}), {:.2f}M "
             "parameters", d.gpt2() ? "gpt2" : "llama", d.L, d.C, d.NH, d.NKV, d.F, d.T, d.V, d.Vp,
             d.num_params() / 1e6);
    if (d.moe.E > 0) {
      std::string layers;
      for (int l = 0; l < d.L; ++l)
        if (d.is_moe(l)) layers += (layers.empty() ? "" : ",") + std::to_string(l);
      log_line("moe: {} experts, top-{} ({} router), expert ffn {}{}, layers {}, aux {} z {}, {}", d.moe.E, d.moe.K,
               d.moe.sigmoid ? "sigmoid" : "softmax", d.moe.F,
               d.moe.shared_F > 0 ? fmt::format(", shared expert ffn {}", d.moe.shared_F) : std::string(), layers,
               d.moe.aux_coeff, d.moe.z_coeff,
               d.moe.capacity_factor > 0 ? fmt::format("capacity factor {} ({} drop)", d.moe.capacity_factor,
                                                       d.moe.drop_position ? "position" : "probs")
                                         : std::string("dropless"));
    }
    log_line("batch: global {} = {} data-parallel ranks x {} micro-batches x {} sequences of {} tokens", GB, dp,
             num_micro, MB, d.T);
    if (data.train)
      log_line("data: {} ({} train samples per epoch{})", cfg.data.path, data.train->samples_per_epoch(),
               data.valid ? fmt::format(", {} validation", data.valid->samples_per_epoch()) : std::string());
    const DpMemory mem = runner.memory();
    // In bf16 the compute copy of the weights comes on top of the fp32 masters.
    const int64_t copy = d.act == DType::F32 ? 0 : mem.params / 4 * int64_t(dtype_size(d.act));
    log_line("memory per rank: parameters {:.1f} MiB{}, gradients {:.1f} MiB, optimizer state {:.1f} MiB{}; peak "
             "for MFU {:.1f} GFLOP/s per rank", mem.params / 1048576.0,
             copy > 0 ? fmt::format(" + {:.1f} MiB {} copy", copy / 1048576.0, dtype_name(d.act)) : std::string(),
             mem.grads / 1048576.0, mem.optimizer / 1048576.0,
             cfg.engine.distributed_optimizer ? " (distributed)" : "", peak / 1e9);
  }

  // ---- loop -----------------------------------------------------------------------------------
  const size_t rows = size_t(std::max<int64_t>(per_rank, tc.eval_iters * MB));
  std::vector<int32_t> tokens(rows * d.T), targets(rows * d.T);
  // Positions within documents, only when sequences are packed (else every row is one document).
  std::vector<int32_t> positions(cfg.engine.sequence_packing ? rows * d.T : 0);
  int32_t* pos = positions.empty() ? nullptr : positions.data();
  MetricsWriter metrics(last_rank ? tc.metrics_file : std::string());
  TrainResult result;
  result.flops_per_step = flops_per_step;
  result.peak_flops = peak;

  // Mean loss over `count` validation micro-batches per rank.
  auto evaluate = [&]() {
    const int64_t n = tc.eval_iters * MB;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = j / MB, b = j % MB;
      data.get(false, (k * dp + dp_only.rank()) * MB + b, tokens.data() + j * d.T, targets.data() + j * d.T,
               pos ? pos + j * d.T : nullptr);
    }
    double loss = runner.forward_only(tokens.data(), targets.data(), pos, int(tc.eval_iters));
    double count = double(count_targets(targets.data(), targets.data() + n * d.T));
    world.allreduce_sum(&loss, 1);
    dp_only.allreduce_sum(&count, 1);
    return loss / std::max(count, 1.0);
  };

  StepMetrics m;
  m.total_iters = tc.train_iters;
  double interval_loss = 0, interval_ms = 0, total_ms = 0, interval_aux = 0, interval_load = 0;
  const bool moe = d.moe.E > 0;
  int interval_steps = 0;
  // The groups whose traffic the last step reports (the comm layer counts every call).
  const std::vector<std::pair<std::string, const Comm*>> groups = {
      {"tp", &mesh.tp()}, {"pp", &mesh.pp()}, {"cp", &mesh.cp()}, {"dp_cp", &mesh.dp_cp()}, {"embedding", &mesh.embedding()},
      {"mp", &mesh.mp()}, {"world", &mesh.world()}, {"ep", &mesh.ep()}, {"expert_tp", &mesh.expert_tp()},
      {"expert_tp_ep", &mesh.expert_tp_ep()}, {"expert_dp", &mesh.expert_dp()}, {"tp_cp", &mesh.tp_cp()}};
  result.memory = runner.memory();
  result.bubble = simulate(runner.schedule(), pc.pp, pc.vpp, 1.0, 2.0).bubble;
  // Resume: the weights, Adam state and step count from the save; the data order and the
  // learning rate follow from the iteration alone.
  int64_t first_it = 1;
  const CheckpointConfig& ck = cfg.checkpoint;
  if (!ck.init_from_hf.empty()) {
    load_weights(runner, load_hf_model(ck.init_from_hf, cfg.model, d.V, d.Vp), ck.init_from_hf);
    if (mesh.rank() == 0 && !opts.quiet) log_line("weights: from the Hugging Face model {}", ck.init_from_hf);
  } else if (!ck.init_from_llmc.empty()) {
    TensorMap w = read_llmc_model(ck.init_from_llmc, nullptr, nullptr, nullptr);
    repad_vocab(w, d.V, d.Vp);  // llm.c pads to 128, this layout to 128 * tp
    load_weights(runner, w, ck.init_from_llmc);
    if (mesh.rank() == 0 && !opts.quiet) log_line("weights: from the llm.c model {}", ck.init_from_llmc);
  }
  if (!ck.load.empty()) {
    const CheckpointMeta meta = load_checkpoint(ck.load, runner, cfg);
    first_it = meta.iteration + 1;
    if (mesh.rank() == 0 && !opts.quiet)
      log_line("checkpoint: resumed from {} at iteration {} ({} samples consumed)", resolve_checkpoint(ck.load),
               meta.iteration, meta.consumed_samples);
  }
  result.first_iter = first_it;
  // SIGTERM (what Slurm sends before the time limit): finish the step, save, exit cleanly.
  TerminationGuard term;
  auto save = [&](int64_t it, double lr) {
    CheckpointMeta meta{it, it * GB, it * GB * d.T, lr};
    const SaveStats st = save_checkpoint(ck.save, meta, runner, cfg, ck.keep_last);
    result.saves.push_back(st);
    if (mesh.rank() == 0 && !opts.quiet)
      log_line("checkpoint: saved iteration {} to {}/{} ({:.1f} MiB in {:.2f} s, {:.0f} MB/s)", it, ck.save,
               checkpoint_dir_name(it), st.bytes / 1048576.0, st.seconds, st.bytes / 1e6 / st.seconds);
  };
  // What the backend chose by measuring (with engine.gemm_autotune, the bias-gradient way), logged
  // by rank 0; each rank measures and chooses for itself.
  auto backend_notes = [&] {
    for (std::string& note : ops->take_notes()) {
      if (mesh.rank() == 0 && !opts.quiet) log_line("{}", note);
      if (mesh.rank() == 0) result.backend_notes.push_back(std::move(note));
    }
  };
  for (int64_t it = first_it; it <= tc.train_iters; ++it) {
    if (it == tc.train_iters)
      for (const auto& g : groups) g.second->reset_stats();
    if (opts.profile_ops) ops->profile_ops(true);  // the last step's times are reported
    const auto t0 = Clock::now();
    // This rank's samples of the global batch: the global batch index alone decides them.
    for (int j = 0; j < per_rank; ++j)
      data.get(true, (it - 1) * GB + int64_t(dp_only.rank()) * per_rank + j, tokens.data() + size_t(j) * d.T,
               targets.data() + size_t(j) * d.T, pos ? pos + size_t(j) * d.T : nullptr);
    int64_t counts[1] = {count_targets(targets.data(), targets.data() + size_t(per_rank) * d.T)};
    dp_only.allreduce_sum(counts, 1);
    const float dloss = 1.0f / float(std::max<int64_t>(counts[0], 1));

    double loss_sum = runner.forward_backward(tokens.data(), targets.data(), pos, num_micro, dloss);
    world.allreduce_sum(&loss_sum, 1);
    // MoE: the aux + z losses of all MoE layers, averaged over the global batch's micro-batches
    // (every cp and tp rank of a data-parallel rank holds the same figure: sum over dp only).
    double moe_stats[2] = {runner.moe_loss_sum(), runner.moe_load_imbalance()};
    if (moe) dp_only.allreduce_sum(moe_stats, 2);
    const double aux = moe_stats[0] / double(GB / MB), load = moe_stats[1] / dp_only.size();
    const double loss = loss_sum / double(std::max<int64_t>(counts[0], 1));
    const double norm = runner.grad_norm();
    if (!std::isfinite(loss) || !std::isfinite(norm))
      fail("iteration {}: loss {} / gradient norm {} is not finite; lower training.lr (now {}) or raise "
           "training.warmup_iters", it, loss, norm, tc.lr);
    const double lr = sched.at(it);
    runner.optimizer_step(float(lr), clip_scale(norm, tc.clip_grad));
    ops->synchronize();  // a GPU step ends when its queued work does
    const double ms = ms_since(t0);
    backend_notes();
    if (it == tc.train_iters)
      for (const auto& g : groups) result.comm_bytes.emplace_back(g.first, g.second->stats().total());

    result.losses.push_back(loss);
    if (moe) result.aux_losses.push_back(aux), result.expert_loads.push_back(load);
    interval_aux += aux;
    interval_load += load;
    result.grad_norms.push_back(norm);
    result.step_ms.push_back(ms);
    interval_loss += loss;
    interval_ms += ms;
    total_ms += ms;
    ++interval_steps;
    if (it % tc.log_interval == 0 || it == tc.train_iters) {
      m.iter = it;
      m.consumed_samples = it * GB;
      m.lr = lr;
      m.loss = interval_loss / interval_steps;
      m.has_aux = moe;
      m.aux_loss = interval_aux / interval_steps;
      m.expert_load = interval_load / interval_steps;
      m.grad_norm = norm;
      m.ms_per_iter = interval_ms / interval_steps;
      m.tokens_per_s = double(GB) * d.T / (m.ms_per_iter / 1e3);
      m.tflops = flops_per_step / (m.ms_per_iter / 1e3) / 1e12;
      m.mfu = m.tflops * 1e12 / peak;
      m.peak_mem_mib = peak_rss_mib();
      m.eta_s = double(tc.train_iters - it) * total_ms / double(it - first_it + 1) / 1e3;
      if (last_rank && !opts.quiet) log_line("{}", format_step(m));
      metrics.step(m);
      interval_loss = interval_ms = interval_aux = interval_load = 0;
      interval_steps = 0;
    }
    if (data.valid && tc.eval_interval > 0 && (it % tc.eval_interval == 0 || it == tc.train_iters)) {
      const double vl = evaluate();
      backend_notes();
      result.val_losses.emplace_back(it, vl);
      if (last_rank && !opts.quiet) log_line("validation at iter {}: loss {:.4f} (perplexity {:.2f})", it, vl, std::exp(vl));
      metrics.eval(it, vl);
    }
    // Every rank must agree to stop: the signal may reach the ranks at different moments.
    int64_t stop = term.requested() ? 1 : 0;
    mesh.world().allreduce_sum(&stop, 1);
    const bool scheduled = ck.save_interval > 0 && it % ck.save_interval == 0;
    if (!ck.save.empty() && (scheduled || it == tc.train_iters || stop)) save(it, lr);
    if (stop) {
      if (mesh.rank() == 0)
        log_line("SIGTERM: stopped after iteration {}{}", it,
                 ck.save.empty() ? " (checkpoint.save is not set: nothing saved)" : ", checkpoint saved");
      result.stopped = true;
      break;
    }
  }
  result.activation_bytes = int64_t(runner.activation_bytes());
  result.device_peak_bytes = int64_t(ops->peak_allocated());
  if (opts.profile_ops) {
    result.op_times = ops->op_times();
    ops->profile_ops(false);
  }
  return result;
}

}  // namespace mpigpt
