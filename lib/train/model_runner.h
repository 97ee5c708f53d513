// One rank's share of the model and everything that crosses ranks around it. The trainer hands
// it the tokens of this data-parallel rank and gets the loss back; nothing here reads files.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "io/config/config.h"
#include "lib/kernels/ops.h"
#include "lib/model/gpt.h"
#include "lib/optim/adamw.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"
#include "parallel/schedule.h"
#include "parallel/tensor_parallel.h"

namespace mpigpt {

// It holds the GPT shard of this rank's tensor-parallel rank and pipeline chunks, runs the
// pipeline schedule through the executor, and does the data-parallel gradient reduction
// (optionally the distributed optimizer), the tied-embedding and sequence-parallel gradient sums,
// the global gradient norm and AdamW.
class ModelRunner {
 public:
  // cfg validated for the mesh's world size; d resolved (make_dims).
  ModelRunner(const Config& cfg, const GptDims& d, const Mesh& mesh, Ops& ops);
  ~ModelRunner();

  // Forward and backward of one optimizer step over `num_micro` micro-batches whose tokens,
  // targets and positions lie back to back (micro_batch * T each, whole sequences: with context
  // parallelism each cp rank takes its share), every token's loss weighted by dloss (1 / tokens
  // of the global batch). positions: within each document when sequences are packed (a
  // document starts where it is 0), nullptr otherwise. Afterwards the gradients are reduced over
  // every group. Returns the loss sum of this rank's tokens: its cp share of its data-parallel
  // rank's batch (the same on every rank of its pipeline and tensor group).
  double forward_backward(const int32_t* tokens, const int32_t* targets, const int32_t* positions, int num_micro,
                          float dloss);
  // The loss sum without gradients (validation), as above.
  double forward_only(const int32_t* tokens, const int32_t* targets, const int32_t* positions, int num_micro);
  // The MoE aux + z losses of the last forward_backward / forward_only: summed over the MoE layers
  // and this data-parallel rank's micro-batches (the same on every rank of its tp, cp and pp groups).
  double moe_loss_sum() const { return moe_loss_; }
  // The expert load imbalance (max over mean top-k assignments per expert, before capacity) of
  // the last forward_backward / forward_only, averaged over its MoE layers and micro-batches.
  double moe_load_imbalance() const { return moe_imbalance_; }
  // The global gradient norm: every parameter counted once over all ranks.
  double grad_norm();
  // AdamW on this rank's share, then the parameters go back to every rank that holds them. In bf16
  // with the distributed optimizer the gathers move the bf16 compute weights, and of the f32
  // masters only this rank's owned slices (and the MoE routers, which forward reads in f32) are
  // current afterwards.
  void optimizer_step(float lr, float grad_scale);
  // Makes every f32 master current on every rank that holds it (blocking; nothing to do unless a
  // bf16 gather left them stale): before the masters are read whole, as a checkpoint save does.
  void gather_masters();

  const GPT& model() const { return *model_; }
  GPT& model() { return *model_; }
  AdamW& optimizer() { return *opt_; }
  const Mesh& mesh() const { return mesh_; }
  Ops& ops() const { return ops_; }
  // Whether this rank writes parameter p's data (of replicated data one replica writes: dense
  // parameters tp rank 0 of data-parallel rank 0, experts expert_tp rank 0 of expert-dp rank 0)
  // and its optimizer state (the same, or with the distributed optimizer every owner its part).
  bool writes_param(const ParamInfo& p) const;
  bool writes_state(const ParamInfo& p) const;
  bool distributed_optimizer() const { return cfg_.engine.distributed_optimizer; }
  const Schedule& schedule() const { return schedule_; }
  DpMemory memory() const;
  size_t activation_bytes() const { return model_->activation_bytes(); }

 private:
  class Stage;
  // Construction steps: the parameters' places in the flat buffers (returns their length); the
  // parameters whose gradients are partial over tp or expert_tp; the reductions and AdamW.
  int64_t place_params(std::vector<ParamInfo>& table, BufferLayout layouts[2]);
  void find_partial_grads(const std::vector<ParamInfo>& table);
  void make_optimizer(const GptDims& d, const BufferLayout layouts[2]);
  double run(const std::vector<Action>& actions, const int32_t* tokens, const int32_t* targets,
             const int32_t* positions, float dloss, bool train, int num_micro);
  void finish_grads();
  bool delayed(int param) const;  // gradient completed only after the tied-embedding sum
  bool holds_tp_copy(const ParamInfo& p) const;
  // Parameter i's gradient is final (last micro-batch): its data-parallel bucket may start.
  void grads_ready(int i);
  // Before parameters [first, end) are read: their gathers (distributed optimizer) are done.
  void wait_params(int first, int end);
  // After a bf16 gather: the f32 masters forward reads (GPT::master_reads) made current.
  void gather_master_reads();

  const Config& cfg_;
  const Mesh& mesh_;
  Ops& ops_;
  ModelPlacement placement_;
  TensorParallel tp_;
  SequenceLayout seq_;
  std::unique_ptr<GPT> model_;
  // Dense parameters live in the first region of the flat buffers, reduced over dp x cp (sync_);
  // routed experts in the second, reduced over the expert-data-parallel group (esync_, absent
  // without experts); frozen parameters last, in no region. region_[i]: parameter i's region
  // (0/1, -1 frozen) and index in that region's layout.
  std::unique_ptr<GradSync> sync_, esync_;
  std::vector<std::pair<int, int>> region_;
  int64_t expert_base_ = 0;  // first element of the expert region
  std::vector<Range> owned_;  // elements this rank updates (both regions)
  bool bf16_gather_ = false;  // the distributed optimizer gathers the bf16 compute weights
  std::unique_ptr<AdamW> opt_;
  Schedule schedule_;  // for the configured number of micro-batches
  int pp_rank_ = 0, num_micro_ = 1;
  double moe_loss_ = 0.0, moe_imbalance_ = 1.0;
  int tied_param_ = -1;          // this rank's word embedding (or replica) when pp > 1 ties it
  std::vector<int> sp_params_;   // replicated parameters whose gradients are partial over tp (SP)
  std::vector<int> lora_partial_;  // LoRA factors replicated over tp whose gradients are partial over it
  std::vector<int> lora_etp_partial_;  // the routed experts' ones, replicated and partial over expert_tp
  int64_t frozen_numel_ = 0;     // elements of the frozen parameters (LoRA's base), after the trained ones
  std::vector<Range> norm_ranges_;  // owned elements that count in the gradient norm
};

}  // namespace mpigpt
