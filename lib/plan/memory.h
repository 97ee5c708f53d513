// The planner's memory model: the bytes one rank holds for a configuration, term by term, computed
// from the same parameter tables, bucket plans, activation plans and pipeline schedules mpigpt
// allocates by (docs/planner.md, "Memory model").
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "io/config/config.h"
#include "lib/model/gpt_dims.h"
#include "parallel/schedule.h"

namespace mpigpt {

// One transformer layer's saved activations for one micro-batch on one rank (GPT::BlockActs),
// bytes, each tensor rounded to the activation arena's 64 bytes.
struct LayerActivations {
  int64_t norm1 = 0;            // n1 and its mean/rstd (sequence parallelism: the shard; gathered again in the backward)
  int64_t qkv = 0;              // the QKV projection's output (local heads, all tokens of the tp group)
  int64_t attention_state = 0;  // att_saved: softmax probabilities (CPU), log-sum-exp (CUDA, blockwise)
  int64_t attention_out = 0;    // att: the attention core's output
  int64_t residual = 0;         // mid: the residual after attention
  int64_t norm2 = 0;            // n2 and its mean/rstd
  int64_t mlp = 0;              // fc and the activation's output (dense layers)
  int64_t lora = 0;             // the LoRA adapters' x A^T (tokens x rank, or the fused layer's width)
  int64_t total() const { return norm1 + qkv + attention_state + attention_out + residual + norm2 + mlp + lora; }
};

// A layer's saved activations under `cfg` (micro-batch, tp, sequence parallelism, cp, recompute,
// precision and backend from it): dense or MoE (whose MLP state is MoeActivations'), with or
// without the attention state (selective recompute drops it where attention is not blockwise).
LayerActivations layer_activations(const GptDims& d, const Config& cfg, bool dense, bool attention_state);

// The bytes of one pipeline rank (the largest of the ranks of its stage), by what holds them.
struct StageMemory {
  int pp_rank = 0;
  int layers = 0;                    // transformer layers this rank holds (all its chunks)
  std::vector<int> pool_of_chunk;    // per model chunk: its slot pool (chunks of one slot_kind share one)
  std::vector<int> in_flight;        // per slot pool: micro-batches whose activations it holds at once
  // Model state (DpMemory: the flat buffers of the data-parallel bucket plans, padding included).
  int64_t params = 0;                // fp32 parameters (the master weights)
  int64_t grads = 0;                 // fp32 gradients
  int64_t optimizer = 0;             // AdamW's two fp32 moments for the elements this rank owns
  int64_t compute_params = 0;        // bf16 copy of the parameters the layers compute with (0 in fp32)
  // Activations (what GPT::activation_bytes counts), summed over the chunks' micro-batches in flight.
  int64_t layer_activations = 0;     // LayerActivations of every layer held, times its micro-batches in flight
  int64_t layer_inputs = 0;          // the residual stream at each layer boundary (all full recompute keeps)
  int64_t logits = 0;                // the head: logits (their gradient in place), final norm, targets, losses
  int64_t embedding_inputs = 0;      // token ids (and positions / document ids when attention is masked)
  int64_t moe_activations = 0;       // MoE layers' router and expert rows (balanced routing assumed) and scratch
  int64_t backward_scratch = 0;      // one backward's gradients of the activations, shared by all layers
  int64_t recompute_scratch = 0;     // recomputation's one layer (full) or attention state (selective)
  // Outside GPT::activation_bytes.
  int64_t cp_buffers = 0;            // context parallelism's K/V blocks (ring or gathered) and partial outputs
  int64_t p2p_buffers = 0;           // device copies of sent pipeline activations (in flight) and gradients
  int64_t workspace = 0;             // the largest temporary of one op (cuDNN attention, GEMM autotuning)
  int64_t headroom = 0;              // allocator headroom: cached blocks and fragmentation kept free (CUDA)

  int64_t state() const { return params + grads + optimizer; }
  int64_t activations() const {
    return layer_activations + layer_inputs + logits + embedding_inputs + moe_activations + backward_scratch +
           recompute_scratch;
  }
  // The high-water mark of allocated bytes (the CUDA caching allocator's peak_in_use).
  int64_t peak() const { return state() + compute_params + activations() + cp_buffers + p2p_buffers + workspace; }
  // What the device must have free: the peak plus the allocator's headroom.
  int64_t required() const { return peak() + headroom; }
};

struct MemoryEstimate {
  int micro_batches = 0;            // per step and data-parallel rank
  bool cuda = false;                // the backend: allocator rounding, attention state and workspaces follow it
  std::vector<StageMemory> stages;  // one per pipeline rank
  const StageMemory& largest() const;  // the stage with the largest peak()
  // Multi-line breakdown (MiB) of every stage, for reports.
  std::string report() const;
};

// Pipeline schedules and their micro-batches in flight by (pp, vpp, micro-batches), kept by a caller
// that prices many layouts (`mpigpt plan`): generating them dominates an estimate at large pp.
class ScheduleCache {
 public:
  const Schedule& schedule(int pp, int vpp, int micro_batches);
  // in_flight_per_pool of pipeline rank pp_rank.
  const std::vector<int>& in_flight(int pp, int vpp, int micro_batches, int pp_rank, const std::vector<int>& pools);
  // simulate() of that schedule on these costs (layouts that differ only off the pipeline repeat them).
  const SimResult& simulated(int pp, int vpp, int micro_batches, const SimCosts& costs);

 private:
  std::map<std::tuple<int, int, int, std::vector<double>, std::vector<double>, double>, SimResult> simulated_;
  std::map<std::tuple<int, int, int>, Schedule> schedules_;
  std::map<std::tuple<int, int, int, int, std::vector<int>>, std::vector<int>> in_flight_;
};

// The memory of every pipeline rank for `cfg` on `world_size` ranks. `d` is the model's resolved
// shape (make_dims in lib/train, which already padded the vocabulary for cfg.parallel.tp); cfg is
// validated for world_size. The micro-batches in flight come from replaying make_schedule's lists.
// `cache` (optional) supplies the schedules.
MemoryEstimate estimate_memory(const Config& cfg, const GptDims& d, int world_size, ScheduleCache* cache = nullptr);

// Per slot pool of pipeline rank `pp_rank` (pool_of_chunk[c]: chunk c's pool, 0 ..): the most
// micro-batches whose forward ran and whose backward has not in all the pool's chunks at once,
// replaying make_schedule(pp, vpp, micro_batches). A pool's slots serve any of its chunks.
std::vector<int> in_flight_per_pool(int pp, int vpp, int micro_batches, int pp_rank,
                                    const std::vector<int>& pool_of_chunk);

}  // namespace mpigpt
