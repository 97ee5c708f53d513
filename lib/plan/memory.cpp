// The memory model: GPT's activation plan, the data-parallel bucket plans and the pipeline
// schedule's micro-batches in flight, priced in bytes per pipeline rank without allocating.
#include "lib/plan/memory.h"

#include <fmt/format.h>

#include <algorithm>

#include "lib/core/error.h"
#include "lib/kernels/caching_allocator.h"
#include "lib/model/params.h"
#include "parallel/data_parallel.h"
#include "parallel/rank_grid.h"
#include "parallel/schedule.h"

namespace mpigpt {

namespace {

// The sizes GPT derives from its config and groups (lib/model/gpt.cpp), for one rank.
struct Dims {
  int64_t B = 0, Tl = 0, N = 0, Nl = 0, C = 0, HD = 0, nh = 0, nkv = 0, Fl = 0, Vl = 0, tp = 1, cp = 1;
  int64_t act = 4;          // bytes per activation element (fp32 or bf16)
  bool gpt2 = true, sp = false, masked = false, cuda = false;
  bool selective = false, full = false;
  int64_t lqkv = 0, lproj = 0, lfc = 0, lfp = 0;  // LoRA: each adapted layer's A rows (0: not adapted)
  bool drops_attention() const { return selective && !masked; }  // GPT::recomputes_attention
};

Dims dims_of(const GptDims& d, const Config& cfg) {
  const ParallelConfig& p = cfg.parallel;
  Dims s;
  s.tp = p.tp, s.cp = p.cp;
  s.B = cfg.training.micro_batch;
  s.Tl = d.T / p.cp;
  s.N = s.B * s.Tl;
  s.sp = p.sequence_parallel && p.tp > 1;  // TensorParallel: sequence parallelism on one rank is plain
  s.Nl = s.sp ? s.N / p.tp : s.N;
  s.C = d.C, s.HD = d.HD(), s.nh = d.NH / p.tp, s.nkv = d.NKV / p.tp, s.Fl = d.F / p.tp, s.Vl = d.Vp / p.tp;
  s.act = d.act == DType::F32 ? 4 : 2;
  s.gpt2 = d.gpt2();
  s.masked = p.cp > 1 || cfg.engine.sequence_packing;
  s.cuda = cfg.engine.backend == "cuda";
  s.selective = cfg.engine.recompute == "selective";
  s.full = cfg.engine.recompute == "full";
  s.lqkv = d.lora_width(kLoraQkv), s.lproj = d.lora_width(kLoraProj);
  s.lfc = d.lora_width(kLoraFc1), s.lfp = d.lora_width(kLoraFc2);
  return s;
}

// An Arena's share of one tensor: its bytes rounded to 64.
int64_t tensor(int64_t numel, int64_t elem) { return (numel * elem + 63) / 64 * 64; }

// What one allocation of `bytes` holds on the backend: the CUDA caching allocator's block size.
int64_t block(int64_t bytes, bool cuda) {
  if (!cuda || bytes == 0) return bytes;
  return int64_t(CachingAllocator::round_size(size_t(bytes)));
}

// Elements of the attention state GPT saves per layer (GPT::att_saved_numel): the log-sum-exp with
// blockwise (masked) attention and on CUDA, the softmax probabilities on the CPU backend.
int64_t attention_state_numel(const Dims& s) {
  if (s.masked || s.cuda) return s.B * s.nh * s.Tl;
  return s.B * s.nh * s.Tl * s.Tl;
}

LayerActivations layer_of(const Dims& s, bool dense, bool attention_state) {
  LayerActivations a;
  const int64_t f4 = 4;  // the norms' statistics are fp32
  const int64_t stats = (s.gpt2 ? tensor(s.Nl, f4) : 0) + tensor(s.Nl, f4);
  a.norm1 = tensor(s.Nl * s.C, s.act) + stats;
  a.qkv = tensor(s.N * (s.nh + 2 * s.nkv) * s.HD, s.act);
  a.attention_state = attention_state ? tensor(attention_state_numel(s), f4) : 0;
  a.attention_out = tensor(s.N * s.nh * s.HD, s.act);
  a.residual = tensor(s.Nl * s.C, s.act);
  a.norm2 = tensor(s.Nl * s.C, s.act) + stats;
  if (dense) {
    a.mlp = tensor(s.N * (s.gpt2 ? s.Fl : 2 * s.Fl), s.act) + tensor(s.N * s.Fl, s.act);
  }
  for (int64_t w : {s.lqkv, s.lproj, dense ? s.lfc : 0, dense ? s.lfp : 0})
    if (w > 0) a.lora += tensor(s.N * w, s.act);
  return a;
}

// A MoE layer's saved state for one micro-batch (MoeActs) with balanced routing: the router's
// scores over E experts for this rank's Nl tokens, and Nl*K expert rows through the expert MLP.
int64_t moe_layer_bytes(const GptDims& d, const Dims& s, const Config& cfg) {
  const int64_t E = d.moe.E, K = d.moe.K, R = s.Nl * K, Fe = d.moe.F / cfg.parallel.expert_tp;
  const int64_t router = 2 * s.Nl * E * 4 + 2 * s.Nl * K * 4 + s.Nl * 4;  // logits, probs, top-k, gates, lse
  const int64_t experts = R * s.C * s.act * 2 + R * (s.gpt2 ? Fe : 2 * Fe) * s.act + R * Fe * s.act;
  const int64_t Fs = d.moe.shared_F / std::max(1, cfg.parallel.tp);
  const int64_t shared = Fs > 0 ? s.Nl * (s.gpt2 ? Fs : 2 * Fs) * s.act + s.Nl * Fs * s.act : 0;
  return router + experts + shared;
}

// The backward's shared scratch (GPT::setup's arena_): one layer's activation gradients.
int64_t backward_scratch(const Dims& s) {
  int64_t n = tensor(s.N, 4);  // positions
  n += 2 * tensor(s.Nl * s.C, s.act) + tensor(s.N * s.C, s.act);  // dres, dn, full
  if (s.sp) n += tensor(s.N * s.C, s.act);                          // gathered (a norm output over tp)
  n += tensor(s.N * (s.nh + 2 * s.nkv) * s.HD, s.act) + tensor(s.N * s.nh * s.HD, s.act);  // dqkv, datt
  n += tensor(s.N * (s.gpt2 ? s.Fl : 2 * s.Fl), s.act);  // dfc
  if (!s.gpt2 || s.lfp > 0) n += tensor(s.N * s.Fl, s.act);  // dact (SwiGLU, or a LoRA update on fc2)
  const int64_t lora = std::max({s.lqkv, s.lproj, s.lfc, s.lfp});
  if (lora > 0) n += tensor(s.N * lora, s.act);  // dlora
  return n + 3 * tensor(s.N, 4);                  // the vocabulary-parallel cross-entropy's rows
}

// Context parallelism's buffers (ContextParallel::scratch_bytes): K/V blocks of this rank's
// tokens, the ring's next block and three dK/dV blocks, or the gathered K/V and their gradient,
// plus one block's output and log-sum-exp.
int64_t cp_bytes(const Dims& s, const Config& cfg) {
  if (s.cp <= 1) return 0;
  const int64_t kv = s.N * 2 * s.nkv * s.HD * s.act, out = s.N * s.nh * s.HD * s.act + s.B * s.nh * s.Tl * 4;
  const int64_t blocks = cfg.parallel.cp_comm_type == "all_gather" ? 2 + 2 * s.cp : 5;
  return blocks * block(kv, s.cuda) + block(out, s.cuda);
}

// The largest temporary one op takes on CUDA (CudaOps::scratch): cuDNN attention's backward
// workspace (fp32 dQ and the row dot products, CudnnSdpa's backward_workspace; cuDNN's own extra,
// known only at run time, is left out; the builtin kernels' row dot products alone), or with GEMM autotuning the scratch output of the largest
// accumulating GEMM (a weight gradient in fp32: the head's, or an MLP weight's).
int64_t cuda_workspace(const Dims& s, const Config& cfg, bool head) {
  if (!s.cuda) return 0;
  const int64_t rows = s.B * s.nh * s.Tl;
  const int64_t rowdot = (rows * 4 + 255) / 256 * 256;  // the builtin backward's D alone
  const bool cudnn = cfg.engine.attention_backend != "builtin";
  const int64_t attention = s.masked ? 0 : rowdot + (cudnn ? (rows * s.HD * 4 + 255) / 256 * 256 : 0);
  int64_t gemm = 0;
  if (cfg.engine.gemm_autotune) {
    gemm = int64_t(s.gpt2 ? s.Fl : 2 * s.Fl) * s.C * 4;
    if (head) gemm = std::max(gemm, s.Vl * s.C * 4);
  }
  return block(std::max(attention, gemm), true);
}

// One micro-batch's slot of model chunk `c` (GPT::acquire): the layer inputs, each layer's saved
// activations unless full recompute, and the embedding's / head's tensors.
struct SlotBytes {
  int64_t layers = 0, inputs = 0, head = 0, embedding = 0, moe = 0;
  int64_t total() const { return layers + inputs + head + embedding; }  // one arena (MoE state apart)
};

SlotBytes slot_of(const GptDims& d, const Dims& s, const Config& cfg, std::pair<int, int> range, bool embed,
                  bool head) {
  SlotBytes b;
  if (embed) b.embedding += tensor(s.N, 4);
  if (s.masked) b.embedding += tensor(s.N, 4) + 2 * tensor(s.cp * s.N, 4);
  const int n = range.second - range.first;
  b.inputs = (n + 1) * tensor(s.Nl * s.C, s.act);
  for (int l = range.first; l < range.second && !s.full; ++l) {
    b.layers += layer_of(s, !d.is_moe(l), !s.drops_attention()).total();
    if (d.is_moe(l)) b.moe += moe_layer_bytes(d, s, cfg);
  }
  if (head) {
    b.head = 2 * tensor(s.N, 4) + tensor(s.Nl * s.C, s.act) + (s.gpt2 ? tensor(s.Nl, 4) : 0) + tensor(s.Nl, 4);
    if (s.sp) b.head += tensor(s.N * s.C, s.act);
    b.head += tensor(s.N * s.Vl, s.act);  // the logits, overwritten by their gradient
  }
  return b;
}

// Recomputation's shared scratch (GPT::set_recompute): full keeps one dense layer and its output,
// selective one attention state.
int64_t recompute_scratch(const GptDims& d, const Dims& s, const std::vector<std::pair<int, int>>& chunks) {
  if (s.full) {
    bool dense = false;
    for (const auto& [first, end] : chunks)
      for (int l = first; l < end; ++l) dense = dense || !d.is_moe(l);
    return layer_of(s, dense, true).total() + tensor(s.Nl * s.C, s.act);
  }
  return s.drops_attention() ? tensor(attention_state_numel(s), 4) : 0;
}

// Parameters, gradients and optimizer state of one pipeline rank: its parameter table split into
// the dense and the expert bucket plans (ModelRunner's), the most any of its data-parallel ranks
// holds; a frozen parameter (LoRA's base) is held, fp32 and in the compute copy, but has no
// gradient, no optimizer state and no bucket.
void add_state(StageMemory& m, const GptDims& d, const Config& cfg, const ModelPlacement& pl, int dp_cp,
               int expert_dp) {
  std::vector<int64_t> numels[2];
  int64_t frozen = 0;  // as ModelRunner::place_params lays them out: after the plans, each 16-aligned
  for (const ParamInfo& p : build_param_table(d, pl)) {
    if (p.frozen) frozen = (frozen + 15) / 16 * 16 + p.numel(), m.params += p.numel() * 4;
    else numels[p.expert ? 1 : 0].push_back(p.numel());
  }
  const bool dist = cfg.engine.distributed_optimizer;
  const int groups[2] = {dp_cp, expert_dp};
  int64_t total = 0;
  for (int k = 0; k < 2; ++k) {
    if (numels[k].empty()) continue;
    const BufferLayout layout = plan_buffer(numels[k], cfg.engine.bucket_size, groups[k]);
    DpMemory most = dp_memory(layout, dist, 0);  // parameters and gradients: the whole buffer on every rank
    for (int r = 1; dist && r < groups[k]; ++r) most.optimizer = std::max(most.optimizer, dp_memory(layout, true, r).optimizer);
    m.params += most.params, m.grads += most.grads, m.optimizer += most.optimizer;
    total += layout.total;
  }
  if (frozen > 0) total = (total + 15) / 16 * 16 + frozen;
  m.compute_params = d.act == DType::F32 ? 0 : total * int64_t(dtype_size(d.act));
}

}  // namespace

LayerActivations layer_activations(const GptDims& d, const Config& cfg, bool dense, bool attention_state) {
  return layer_of(dims_of(d, cfg), dense, attention_state);
}

namespace {

std::vector<int> in_flight_of(const Schedule& sched, int pp_rank, const std::vector<int>& pools) {
  MPIGPT_CHECK(pp_rank >= 0 && pp_rank < int(sched.size()), "pipeline rank {} of {}", pp_rank, sched.size());
  const int n = pools.empty() ? 0 : *std::max_element(pools.begin(), pools.end()) + 1;
  std::vector<int> live(size_t(n), 0), most(size_t(n), 0);
  for (const Action& a : sched[size_t(pp_rank)]) {
    const int pool = pools.at(size_t(a.chunk));
    if (a.type == ActionType::Forward) most[size_t(pool)] = std::max(most[size_t(pool)], ++live[size_t(pool)]);
    if (a.type == ActionType::Backward) --live[size_t(pool)];
  }
  return most;
}

}  // namespace

std::vector<int> in_flight_per_pool(int pp, int vpp, int micro_batches, int pp_rank,
                                    const std::vector<int>& pool_of_chunk) {
  MPIGPT_CHECK(int(pool_of_chunk.size()) == vpp, "{} chunk pools for vpp {}", pool_of_chunk.size(), vpp);
  return in_flight_of(make_schedule(pp, vpp, micro_batches), pp_rank, pool_of_chunk);
}

const Schedule& ScheduleCache::schedule(int pp, int vpp, int micro_batches) {
  const auto key = std::make_tuple(pp, vpp, micro_batches);
  auto it = schedules_.find(key);
  if (it == schedules_.end()) it = schedules_.emplace(key, make_schedule(pp, vpp, micro_batches)).first;
  return it->second;
}

const std::vector<int>& ScheduleCache::in_flight(int pp, int vpp, int micro_batches, int pp_rank,
                                                 const std::vector<int>& pools) {
  auto key = std::make_tuple(pp, vpp, micro_batches, pp_rank, pools);
  auto it = in_flight_.find(key);
  if (it == in_flight_.end())
    it = in_flight_.emplace(std::move(key), in_flight_of(schedule(pp, vpp, micro_batches), pp_rank, pools)).first;
  return it->second;
}

const SimResult& ScheduleCache::simulated(int pp, int vpp, int micro_batches, const SimCosts& costs) {
  auto key = std::make_tuple(pp, vpp, micro_batches, costs.forward, costs.backward, costs.p2p_latency);
  auto it = simulated_.find(key);
  if (it == simulated_.end())
    it = simulated_.emplace(std::move(key), simulate(schedule(pp, vpp, micro_batches), pp, vpp, costs)).first;
  return it->second;
}

MemoryEstimate estimate_memory(const Config& cfg, const GptDims& d, int world_size, ScheduleCache* cache) {
  const ParallelConfig& p = cfg.parallel;
  const MeshSizes sizes = mesh_sizes(p);
  const int dp = dense_grid(sizes, world_size).size("dp");
  const int expert_dp = expert_grid(sizes, world_size).size("dp");
  MemoryEstimate e;
  e.cuda = cfg.engine.backend == "cuda";
  e.micro_batches = cfg.training.global_batch / (dp * cfg.training.micro_batch);
  const Dims s = dims_of(d, cfg);
  const std::vector<int> stage_layers = pipeline_layers(p, d.L);
  for (int r = 0; r < p.pp; ++r) {
    StageMemory m;
    m.pp_rank = r;
    ModelPlacement pl;
    pl.tp = p.tp, pl.ep = p.ep, pl.etp = p.expert_tp;
    pl.chunks = layers_of_stage(stage_layers, p.pp, r);
    pl.first_stage = r == 0, pl.last_stage = r == p.pp - 1;
    add_state(m, d, cfg, pl, dp * p.cp, expert_dp);
    m.params = block(m.params, e.cuda), m.grads = block(m.grads, e.cuda), m.compute_params = block(m.compute_params, e.cuda);
    m.optimizer = 2 * block(m.optimizer / 2, e.cuda);
    const int C = int(pl.chunks.size());
    std::vector<std::vector<int>> kinds;  // the chunks' slot pools, as GPT shares them
    for (int c = 0; c < C; ++c) {
      const auto [first, end] = pl.chunks[size_t(c)];
      const auto kind = slot_kind(d, first, end, pl.first_stage && c == 0, pl.last_stage && c + 1 == C);
      m.pool_of_chunk.push_back(int(std::find(kinds.begin(), kinds.end(), kind) - kinds.begin()));
      if (m.pool_of_chunk.back() == int(kinds.size())) kinds.push_back(kind);
    }
    m.in_flight = cache ? cache->in_flight(p.pp, p.vpp, e.micro_batches, r, m.pool_of_chunk)
                        : in_flight_per_pool(p.pp, p.vpp, e.micro_batches, r, m.pool_of_chunk);
    for (int c = 0; c < C; ++c) {
      const bool embed = pl.first_stage && c == 0, head = pl.last_stage && c + 1 == C;
      m.layers += pl.chunks[size_t(c)].second - pl.chunks[size_t(c)].first;
      // Sent gradients stay on the device until their send completes: the previous stage takes each
      // at its next backward, so a chunk holds about two at once (assumed, not simulated).
      if (e.cuda && !embed) m.p2p_buffers += std::min(e.micro_batches, 2) * block(tensor(s.Nl * s.C, s.act), true);
      const int pool = m.pool_of_chunk[size_t(c)];
      if (std::find(m.pool_of_chunk.begin(), m.pool_of_chunk.end(), pool) - m.pool_of_chunk.begin() != c) continue;
      // Each pool's slots, once (at its first chunk).
      const SlotBytes b = slot_of(d, s, cfg, pl.chunks[size_t(c)], embed, head);
      const int64_t k = m.in_flight[size_t(pool)];
      // One arena per slot: on CUDA the allocator rounds it as one block (charged to the layers).
      m.layer_activations += k * (b.layers + block(b.total(), e.cuda) - b.total());
      m.layer_inputs += k * b.inputs, m.logits += k * b.head, m.embedding_inputs += k * b.embedding;
      m.moe_activations += k * b.moe;
      // Sent activations stay copied on the device until their gradient returns.
      if (e.cuda && !head) m.p2p_buffers += k * block(tensor(s.Nl * s.C, s.act), true);
    }
    if (p.pp == 1) m.p2p_buffers = 0;
    if (d.moe.E > 0) m.moe_activations += moe_layer_bytes(d, s, cfg);  // the MoE layer's backward scratch
    m.backward_scratch = block(backward_scratch(s), e.cuda);
    m.recompute_scratch = block(recompute_scratch(d, s, pl.chunks), e.cuda);
    m.cp_buffers = cp_bytes(s, cfg);
    m.workspace = cuda_workspace(s, cfg, pl.last_stage);
    // The caching allocator keeps freed blocks cached and cannot always reuse a split one: on
    // CUDA leave 5% of the peak free (PyTorch's experience), plus the context's fixed ~0.5 GiB.
    m.headroom = e.cuda ? m.peak() / 20 + (int64_t(1) << 29) : 0;
    e.stages.push_back(std::move(m));
  }
  return e;
}

const StageMemory& MemoryEstimate::largest() const {
  MPIGPT_CHECK(!stages.empty(), "memory estimate without stages");
  return *std::max_element(stages.begin(), stages.end(),
                           [](const StageMemory& a, const StageMemory& b) { return a.peak() < b.peak(); });
}

std::string MemoryEstimate::report() const {
  const double MiB = 1048576.0;
  std::string out;
  for (const StageMemory& m : stages) {
    std::string flight;
    for (int k : m.in_flight) flight += fmt::format("{}{}", flight.empty() ? "" : ",", k);
    out += fmt::format(
        "stage {} ({} layers, micro-batches in flight per slot pool {}): parameters {:.1f} MiB, gradients {:.1f}, "
        "optimizer {:.1f}, compute copy {:.1f}; activations {:.1f} MiB = layers {:.1f} + layer inputs {:.1f} + "
        "logits {:.1f} + embedding {:.1f} + MoE {:.1f} + backward scratch {:.1f} + recompute {:.1f}; cp {:.1f}, "
        "p2p {:.1f}, workspace {:.1f}; peak {:.1f} MiB, with headroom {:.1f} MiB\n",
        m.pp_rank, m.layers, flight, m.params / MiB, m.grads / MiB, m.optimizer / MiB, m.compute_params / MiB,
        m.activations() / MiB, m.layer_activations / MiB, m.layer_inputs / MiB, m.logits / MiB,
        m.embedding_inputs / MiB, m.moe_activations / MiB, m.backward_scratch / MiB, m.recompute_scratch / MiB,
        m.cp_buffers / MiB, m.p2p_buffers / MiB, m.workspace / MiB, m.peak() / MiB, m.required() / MiB);
  }
  return out;
}

}  // namespace mpigpt
