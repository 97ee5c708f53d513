// One rank's share of the model: pipeline stage, gradient reductions, norm and optimizer step.
#include "lib/train/model_runner.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <set>
#include <utility>

#include "parallel/pipeline_parallel.h"

namespace mpigpt {

// The optimizer's view of the parameter table; training.no_decay names the kinds that do not decay.
// AdamW::Piece::param indexes it as it indexes the table.
static std::vector<OptimParam> optim_params(const std::vector<ParamInfo>& table, const std::set<ParamKind>& no_decay) {
  std::vector<OptimParam> out;
  for (const ParamInfo& p : table)  // a frozen parameter (LoRA's base) has no state and no update
    out.push_back({p.name, p.frozen ? 0 : p.offset, p.frozen ? 0 : p.numel(), no_decay.count(p.kind) == 0});
  return out;
}

// The pipeline stage the executor drives: one GPT chunk per virtual stage, the micro-batch's
// tokens from the step's batch (this cp rank's share, with every rank's positions and document
// ids, when the sequence is split or packed), and the data-parallel hooks (parameters gathered
// before first use, gradient buckets started when the last micro-batch's backward completes them).
class ModelRunner::Stage : public PipelineStage {
 public:
  Stage(ModelRunner& r, const int32_t* tokens, const int32_t* targets, const int32_t* positions, float dloss,
        bool train, int num_micro)
      : r_(r), m_(*r.model_), tokens_(tokens), targets_(targets), dloss_(dloss), train_(train),
        num_micro_(num_micro), N_(int64_t(m_.batch()) * m_.dims().T) {
    const int cp = r.mesh_.cp().size();
    if (cp > 1 || r.seq_.packed)
      for (int mb = 0; mb < num_micro; ++mb)
        split_.push_back(cp_split(m_.batch(), m_.dims().T, cp, r.mesh_.cp().rank(), tokens + mb * N_,
                                  targets + mb * N_, positions ? positions + mb * N_ : nullptr));
  }
  double loss_sum = 0;

  Tensor forward_input(int mb, int c) override { return m_.chunk_input(c, mb); }
  void forward(int mb, int c) override {
    if (mb == 0) wait_params(c);
    if (!train_ && mb > 0) m_.release(c, mb - 1);  // its output went out right after its forward
    MicroBatchInput in{tokens_ + mb * N_, targets_ + mb * N_};
    if (!split_.empty()) {
      const CpMicroBatch& s = split_[mb];
      in = {s.tokens.data(), s.targets.data(), s.pos.data(), s.seg.data(), s.index.data()};
    }
    loss_sum += m_.forward_chunk(c, mb, in, train_ ? dloss_ : 0.0f);
  }
  Tensor forward_output(int mb, int c) override { return m_.chunk_output(c, mb); }
  Tensor backward_input(int, int c) override { return m_.chunk_grad(c); }
  void backward(int mb, int c) override {
    if (mb + 1 < num_micro_) return m_.backward_chunk(c, mb);
    m_.backward_chunk(c, mb, [this](int first, int end) {
      for (int i = first; i < end; ++i)
        if (!r_.delayed(i)) r_.grads_ready(i);
    });
  }
  Tensor backward_output(int, int c) override { return m_.chunk_grad(c); }

 private:
  void wait_params(int c) {
    auto [first, end] = m_.chunk_params(c);
    r_.wait_params(first, end);
    if (m_.has_head(c) && r_.tied_param_ >= 0) r_.wait_params(r_.tied_param_, r_.tied_param_ + 1);  // the head reads the tied replica
  }
  ModelRunner& r_;
  GPT& m_;
  const int32_t *tokens_, *targets_;
  float dloss_;
  bool train_;
  int num_micro_;
  int64_t N_;                         // tokens of a whole micro-batch (B*T)
  std::vector<CpMicroBatch> split_;   // per micro-batch, when the sequence is split or packed
};

ModelRunner::ModelRunner(const Config& cfg, const GptDims& d, const Mesh& mesh, Ops& ops)
    : cfg_(cfg), mesh_(mesh), ops_(ops), tp_(&mesh.tp(), cfg.parallel.sequence_parallel),
      seq_{&mesh.cp(), parse_cp_comm_type(cfg.parallel.cp_comm_type), cfg.engine.sequence_packing} {
  const ParallelConfig& pc = cfg.parallel;
  const TrainingConfig& tc = cfg.training;
  pp_rank_ = mesh.coords().pp;
  placement_.tp = pc.tp;
  placement_.tp_rank = mesh.coords().tp;
  placement_.chunks = layers_of_stage(pipeline_layers(pc, d.L), pc.pp, pp_rank_);
  placement_.first_stage = pp_rank_ == 0;
  placement_.last_stage = pp_rank_ == pc.pp - 1;

  placement_.ep = pc.ep;
  placement_.ep_rank = mesh.coords().ep;
  placement_.etp = pc.expert_tp;
  placement_.etp_rank = mesh.coords().etp;

  std::vector<ParamInfo> table = build_param_table(d, placement_);
  BufferLayout layouts[2];
  const int64_t total = place_params(table, layouts);
  MoeLayout moe{&mesh.tp_cp(), pc.moe_dispatcher == "allgather", &mesh.ep(), &mesh.expert_tp(), &mesh.expert_tp_ep(),
                mesh.ep_of_member()};
  model_ = std::make_unique<GPT>(d, ops, tc.micro_batch, placement_, tp_, table, total, seq_, moe);
  // Each micro-batch's MoE aux loss counts with weight 1 / (micro-batches of the global batch).
  model_->set_moe_aux_scale(float(tc.micro_batch) / float(tc.global_batch));
  model_->set_recompute(parse_recompute(cfg.engine.recompute));
  model_->init_weights(tc.seed);

  // Tied embeddings over a pipeline: the last stage's replica starts as stage 0's copy.
  if (d.tied && pc.pp > 1 && (placement_.first_stage || placement_.last_stage)) {
    tied_param_ = 0;  // the word embedding, or the replica, leads the table
    MPIGPT_CHECK(model_->params()[tied_param_].name == "embedding.word.weight", "tied parameter not first");
    mesh.embedding().broadcast(model_->param(tied_param_), 0);
  }
  find_partial_grads(table);
  make_optimizer(d, layouts);

  // The gradient norm counts each element once over the world, on the rank that writes its
  // optimizer state to a checkpoint: of owned elements those of parameters it writes.
  std::vector<Range> counted;
  for (const ParamInfo& p : table)
    if (!p.frozen && writes_state(p)) counted.push_back({p.offset, p.offset + p.numel()});
  norm_ranges_ = intersect_ranges(counted, owned_);

  num_micro_ = tc.global_batch / (mesh.dp().size() * tc.micro_batch);  // cp ranks share their rows
  schedule_ = make_schedule(pc.pp, pc.vpp, num_micro_);
}

// The flat buffers follow the data-parallel bucket plans: dense parameters first, planned over
// dp x cp, then the routed experts, planned over the expert-data-parallel group, then the frozen
// parameters (LoRA's base: no gradient, no bucket), region -1. Sets each entry's offset and
// returns the buffers' length.
int64_t ModelRunner::place_params(std::vector<ParamInfo>& table, BufferLayout layouts[2]) {
  std::vector<int64_t> numels[2];
  for (const auto& p : table) {
    const int k = p.frozen ? -1 : p.expert ? 1 : 0;
    region_.push_back({k, k < 0 ? -1 : int(numels[k].size())});
    if (k >= 0) numels[k].push_back(p.numel());
  }
  layouts[0] = plan_buffer(numels[0], cfg_.engine.bucket_size, mesh_.dp_cp().size());
  layouts[1] = plan_buffer(numels[1], cfg_.engine.bucket_size, mesh_.expert_dp().size());
  expert_base_ = layouts[0].total;
  int64_t total = layouts[0].total + (numels[1].empty() ? 0 : layouts[1].total);
  for (size_t i = 0; i < table.size(); ++i) {
    const auto [k, j] = region_[i];
    if (k < 0) {  // aligned as the plans align theirs
      table[i].offset = total = (total + 15) / 16 * 16;
      total += table[i].numel();
      frozen_numel_ += table[i].numel();
    } else {
      table[i].offset = k == 0 ? layouts[0].offsets[j] : expert_base_ + layouts[1].offsets[j];
    }
  }
  return total;
}

// The replicated parameters whose gradient each tp (or expert_tp) rank holds only its part of.
void ModelRunner::find_partial_grads(const std::vector<ParamInfo>& table) {
  // Under sequence parallelism norms and the MoE router and shared expert (replicated over tp)
  // see only this rank's tokens. (Routed experts sum over the expert-data-parallel group.)
  auto token_local = [](const std::string& n) {
    for (const char* k : {"norm.", ".mlp.router.", ".mlp.shared."})
      if (n.find(k) != std::string::npos) return true;
    return false;
  };
  if (tp_.sequence_parallel())
    for (size_t i = 0; i < table.size(); ++i)
      if (!table[i].frozen && !table[i].expert && table[i].split == TpSplit::None && token_local(table[i].name))
        sp_params_.push_back(int(i));
  // LoRA's replicated factor of a tp-split layer (column-parallel: A, row-parallel: B): each rank's
  // gradient is its partial sum (lib/model/lora.h), with or without sequence parallelism. The
  // routed experts' adapters (fc A, proj B) likewise over expert_tp (lib/model/moe.h).
  for (size_t i = 0; i < table.size(); ++i) {
    const ParamInfo& p = table[i];
    if (!is_lora_param(p.name) || p.split != TpSplit::None) continue;
    if (p.expert ? cfg_.parallel.expert_tp > 1 : tp_.size() > 1)
      (p.expert ? lora_etp_partial_ : lora_partial_).push_back(int(i));
  }
}

// The gradient reductions of both regions (sync_, esync_), the elements this rank owns, and AdamW.
void ModelRunner::make_optimizer(const GptDims& d, const BufferLayout layouts[2]) {
  GradSyncOptions so;
  so.distributed_optimizer = cfg_.engine.distributed_optimizer;
  so.overlap_grad_reduce = cfg_.engine.overlap_grad_reduce;
  so.overlap_param_gather = cfg_.engine.overlap_param_gather;
  const Tensor params = model_->params_flat(), grads = model_->grads_flat();
  const Tensor trained = params.flat_slice(0, grads.numel());  // the parameters the optimizer updates
  // In bf16 the distributed optimizer gathers the bf16 compute weights, not the f32 masters.
  bf16_gather_ = so.distributed_optimizer && d.act != DType::F32;
  const Tensor gather = bf16_gather_ ? model_->compute_params_flat() : Tensor{};
  auto region = [&](const Tensor& t, int64_t begin, int64_t n) { return t.ptr ? t.flat_slice(begin, n) : Tensor{}; };
  const BufferLayout &layout = layouts[0], &elayout = layouts[1];
  sync_ = std::make_unique<GradSync>(mesh_.dp_cp(), layout, params.flat_slice(0, layout.total),
                                     grads.flat_slice(0, layout.total), so, region(gather, 0, layout.total));
  owned_ = sync_->owned_ranges();
  if (!elayout.numels.empty()) {  // a model with routed experts
    esync_ = std::make_unique<GradSync>(mesh_.expert_dp(), elayout, params.flat_slice(expert_base_, elayout.total),
                                        grads.flat_slice(expert_base_, elayout.total), so,
                                        region(gather, expert_base_, elayout.total));
    for (const Range& r : esync_->owned_ranges()) owned_.push_back({expert_base_ + r.begin, expert_base_ + r.end});
  }
  owned_ = normalize_ranges(std::move(owned_));

  const TrainingConfig& tc = cfg_.training;
  AdamWConfig ac;
  ac.beta1 = float(tc.beta1);
  ac.beta2 = float(tc.beta2);
  ac.eps = float(tc.eps);
  ac.weight_decay = float(tc.weight_decay);
  opt_ = std::make_unique<AdamW>(ops_, optim_params(model_->params(), parse_no_decay(tc.no_decay)), trained, grads, ac,
                                 owned_);
}

ModelRunner::~ModelRunner() = default;

// One copy over the tensor-parallel group (tp, or expert_tp for experts): this rank's shard, or
// rank 0's copy of a replicated parameter; never the tied replica.
bool ModelRunner::holds_tp_copy(const ParamInfo& p) const {
  return !p.replica && (p.split != TpSplit::None || (p.expert ? mesh_.coords().etp : tp_.rank()) == 0);
}

bool ModelRunner::writes_param(const ParamInfo& p) const {
  return holds_tp_copy(p) && (p.expert ? mesh_.expert_dp() : mesh_.dp_cp()).rank() == 0;
}

bool ModelRunner::writes_state(const ParamInfo& p) const {
  return distributed_optimizer() ? holds_tp_copy(p) : writes_param(p);
}

DpMemory ModelRunner::memory() const {
  DpMemory m = sync_->memory();
  if (esync_) {
    const DpMemory e = esync_->memory();
    m.params += e.params, m.grads += e.grads, m.optimizer += e.optimizer;
  }
  m.params += frozen_numel_ * 4;
  return m;
}

void ModelRunner::grads_ready(int i) {
  const auto [k, j] = region_[i];
  if (k < 0) return;  // frozen
  GradSync& s = k == 0 ? *sync_ : *esync_;
  const Range g = s.layout().param_range(j);
  s.grads_ready(g.begin, g.end);
}

void ModelRunner::wait_params(int first, int end) {
  int64_t lo[2] = {INT64_MAX, INT64_MAX}, hi[2] = {0, 0};
  for (int i = first; i < end; ++i) {
    const auto [k, j] = region_[i];
    if (k < 0) continue;  // frozen: never updated, never gathered
    const Range g = (k == 0 ? *sync_ : *esync_).layout().param_range(j);
    lo[k] = std::min(lo[k], g.begin), hi[k] = std::max(hi[k], g.end);
  }
  if (lo[0] < hi[0]) sync_->wait_params(lo[0], hi[0]);
  if (lo[1] < hi[1]) esync_->wait_params(lo[1], hi[1]);
}

bool ModelRunner::delayed(int param) const { return param == tied_param_; }

double ModelRunner::run(const std::vector<Action>& actions, const int32_t* tokens, const int32_t* targets,
                        const int32_t* positions, float dloss, bool train, int num_micro) {
  Stage stage(*this, tokens, targets, positions, dloss, train, num_micro);
  model_->reset_moe_loss();
  run_schedule(actions, stage, mesh_.pp(), &ops_);
  // The MoE losses of this pipeline's layers: every stage holds some of them.
  double moe[3] = {model_->moe_loss_sum(), model_->moe_imbalance_sum(), double(model_->moe_forwards())};
  mesh_.pp().allreduce_sum(moe, 3);
  moe_loss_ = moe[0];
  moe_imbalance_ = moe[2] > 0 ? moe[1] / moe[2] : 1.0;
  if (!train)
    for (int c = 0; c < model_->num_chunks(); ++c) model_->release(c, num_micro - 1);
  // Only the last stage has losses; every rank of the pipeline gets their sum.
  double loss = stage.loss_sum;
  mesh_.pp().allreduce_sum(&loss, 1);
  return loss;
}

double ModelRunner::forward_backward(const int32_t* tokens, const int32_t* targets, const int32_t* positions,
                                     int num_micro, float dloss) {
  MPIGPT_CHECK(num_micro == num_micro_, "the schedule is made for {} micro-batches, not {}", num_micro_, num_micro);
  model_->zero_grads();
  const double loss = run(schedule_[pp_rank_], tokens, targets, positions, dloss, true, num_micro);
  finish_grads();
  return loss;
}

// Forward only: micro-batch after micro-batch, each through the chunks in virtual-stage order.
double ModelRunner::forward_only(const int32_t* tokens, const int32_t* targets, const int32_t* positions,
                                 int num_micro) {
  const int pp = cfg_.parallel.pp, vpp = cfg_.parallel.vpp;
  const int prev = (pp_rank_ + pp - 1) % pp, next = (pp_rank_ + 1) % pp;
  std::vector<Action> actions;
  for (int mb = 0; mb < num_micro; ++mb)
    for (int c = 0; c < vpp; ++c) {
      const int s = virtual_stage(pp, pp_rank_, c);
      if (s > 0) actions.push_back({ActionType::RecvForward, mb, c, prev});
      actions.push_back({ActionType::Forward, mb, c, -1});
      if (s + 1 < pp * vpp) actions.push_back({ActionType::SendForward, mb, c, next});
    }
  return run(actions, tokens, targets, positions, 0.0f, false, num_micro);
}

void ModelRunner::finish_grads() {
  // Tied embeddings: stage 0's word embedding and the last stage's replica get the sum of both
  // gradients (before the data-parallel reduction, which is linear, so the order is free).
  if (tied_param_ >= 0 && !model_->params()[tied_param_].frozen)
    mesh_.embedding().allreduce_sum(model_->grad(tied_param_));
  sync_->finish_grad_sync();
  if (esync_) esync_->finish_grad_sync();
  // Sequence parallelism: norm weights saw only this rank's tokens.
  for (int i : sp_params_) tp_.sum_replicated_grad(model_->grad(i));
  for (int i : lora_partial_) tp_.allreduce_sum(model_->grad(i));
  for (int i : lora_etp_partial_) mesh_.expert_tp().allreduce_sum(model_->grad(i));
}

double ModelRunner::grad_norm() {
  double sq = sum_squares_of(ops_, model_->grads_flat(), norm_ranges_);
  mesh_.world().allreduce_sum(&sq, 1);  // every element is counted on exactly one rank
  return std::sqrt(sq);
}

void ModelRunner::optimizer_step(float lr, float grad_scale) {
  opt_->step(lr, grad_scale);
  if (bf16_gather_) {  // this rank's updated slices into the bf16 copy, which the gathers then move
    std::vector<std::pair<int64_t, int64_t>> mine;
    for (const Range& r : owned_) mine.push_back({r.begin, r.end});
    model_->convert_params(mine);
  }
  sync_->gather_params();
  if (esync_) esync_->gather_params();
  if (!bf16_gather_) return model_->params_changed();
  model_->compute_params_gathered();
  gather_master_reads();
}

// The MoE routers' f32 masters: each element has one owner in the dense group, so with every
// other rank's copy zeroed the group's sum is exactly the owner's value.
void ModelRunner::gather_master_reads() {
  if (!sync_->masters_stale()) return;
  const Tensor params = model_->params_flat();
  for (const auto& [lo, hi] : model_->master_reads()) {
    MPIGPT_CHECK(hi <= expert_base_, "f32-read parameter [{}, {}) outside the dense region", lo, hi);
    int64_t at = lo;
    for (const Range& r : intersect_ranges(sync_->owned_ranges(), {{lo, hi}})) {
      if (at < r.begin) ops_.fill(params.flat_slice(at, r.begin - at), 0.0f);
      at = r.end;
    }
    if (at < hi) ops_.fill(params.flat_slice(at, hi - at), 0.0f);
    sync_->group().allreduce_sum(params.flat_slice(lo, hi - lo));
  }
}

void ModelRunner::gather_masters() {
  sync_->gather_masters();
  if (esync_) esync_->gather_masters();
}

}  // namespace mpigpt
