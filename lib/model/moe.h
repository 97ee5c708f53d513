// The mixture-of-experts (MoE) layer that replaces a transformer block's dense MLP: a router picks
// the top-k of E experts per token, the token dispatcher (parallel/expert_parallel.h) moves rows to
// the ranks holding the experts, and the gate-weighted expert outputs come back.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lib/kernels/ops.h"
#include "parallel/comm.h"
#include "parallel/expert_parallel.h"

namespace mpigpt {

struct MoeConfig {
  enum class Router { Softmax, Sigmoid };
  enum class DropPolicy { Probs, Position };
  enum class Activation { Gelu, Swiglu };
  int num_experts = 8;                         // E
  int top_k = 2;                               // K experts per token
  Router router = Router::Softmax;             // softmax over E then top-k, or sigmoid scores then top-k
  bool norm_topk_prob = false;                 // softmax: renormalise the K gates to sum 1 (sigmoid always does)
  float aux_loss_coeff = 0.0f;                 // load-balancing loss coefficient (0: off)
  float z_loss_coeff = 0.0f;                   // router z-loss coefficient (0: off)
  float capacity_factor = 0.0f;                // <= 0: dropless; else capacity = ceil(cf * T * K / E) per expert
  DropPolicy drop_policy = DropPolicy::Probs;  // keep the highest gates, or the earliest tokens
  Activation activation = Activation::Gelu;    // GELU (fc (F,C)) or SwiGLU (fc (2F,C) = [gate | up])
  bool bias = true;                            // fc and proj biases (experts and shared expert)
  int64_t hidden = 0;                          // F: hidden units per expert (before expert_tp splits it)
  int64_t shared_hidden = 0;                   // hidden units of the shared expert; 0: no shared expert
  float lora_scale = 1.0f;                     // LoRA's alpha / r for the routed experts' adapters (MoeWeights)
  void validate() const;                       // throws naming the field
  bool normalize_gates() const { return router == Router::Sigmoid || norm_topk_prob; }
};

// Views of the layer's weights (or, with the same shapes, their gradients). El = E / ep local
// experts, Fl = F / expert_tp, H = Fl (GELU) or 2*Fl (SwiGLU, per expert [gate_l | up_l] rows),
// Hs = shared_hidden or 2*shared_hidden. Biases are undefined when cfg.bias is false; in a
// gradient set any view may be undefined ("not wanted").
struct MoeWeights {
  Tensor router;                         // (E, C), no bias
  Tensor fc, fc_bias;                    // (El, H, C), (El, H)
  Tensor proj, proj_bias;                // (El, C, Fl), (El, C)
  Tensor shared_fc, shared_fc_bias;      // (Hs, C), (Hs)
  Tensor shared_proj, shared_proj_bias;  // (C, shared_hidden), (C)
  // LoRA adapters of the routed experts (lib/model/lora.h, one per expert; undefined: not
  // adapted): fc A (El, r, C) whole, B (El, H, r) split as fc's rows; proj A (El, r, Fl) split as
  // proj's columns, B (El, C, r) whole. The whole factors' gradients are partial over expert_tp.
  Tensor fc_lora_A, fc_lora_B, proj_lora_A, proj_lora_B;
};

// The router's losses, both already multiplied by their coefficients (T = tokens of the micro-batch
// over token_group, p (T,E) the router probs: softmax, or the raw sigmoid scores):
//   aux = aux_loss_coeff * E * sum_e f_e * P_e   (Switch / Megatron "aux_loss")
//         f_e = (top-k assignments to e, counted BEFORE capacity dropping) / (T * K),
//         P_e = (1/T) sum_t p_te; f_e is a constant (no gradient), the gradient flows through P_e.
//   z   = z_loss_coeff * (1/T) sum_t logsumexp(logits_t)^2   (ST-MoE router z-loss)
struct MoeLosses {
  double aux = 0.0, z = 0.0;  // coefficient * loss, identical on every rank of token_group
  // Expert load of this micro-batch: the most top-k assignments any expert got (before capacity
  // dropping) over the mean T*K/E; 1 = perfectly balanced, E/K = every token on the same K.
  double load_imbalance = 1.0;
};

// The saved state of one forward (one per micro-batch in flight), sized on each call and reused:
// keep one per pipeline slot and pass it to the matching backward. The input x is held by view:
// it must stay unchanged until the backward.
struct MoeActs {
  Tensor x;
  int64_t N = 0;
  std::vector<float> aux_row;  // d aux / d p_te per expert (the same for every token), unscaled
  double z_grad = 0.0;         // d z / d lse_t = z_grad * lse_t
  GrowBuffer logits, probs, topk, gates, lse, xe, h, a, ye, sh, sa, ufc, ufp;
  Tensor logits_t, probs_t, topk_t, gates_t, lse_t, xe_t, h_t, a_t, ye_t, sh_t, sa_t;
  Tensor ufc_t, ufp_t;  // LoRA: s x A_e^T of the expert rows into fc and proj (rows, r)
  DispatchState dispatch;
  // expert_tp gather (alltoall dispatcher): expert rows of every expert_tp rank, padded to
  // etp_pad rows each; etp_index (etp_rows) maps the gathered rows, grouped by local expert, to
  // their place in the padded rank-major buffer; etp_groups their rows per local expert.
  int64_t etp_pad = 0, etp_rows = 0;
  std::vector<int64_t> etp_groups;
  GrowBuffer etp_index;
  Tensor etp_index_t;
  size_t bytes() const;  // device memory held by this micro-batch's saved state
};

// Capacity per expert for T tokens (0 = dropless).
int64_t moe_capacity(const MoeConfig& cfg, int64_t T);
// Which of the T*K assignments to keep (1) when each expert takes at most `capacity`:
// expert (T*K) its expert, gate (T*K) its gate weight, token_index (T) the token's position in the
// micro-batch (ties and the `position` policy use it; it must be distinct). Probs: per expert the
// highest gates, ties to the lower token index; Position: the lowest token indices.
std::vector<uint8_t> moe_capacity_keep(const int32_t* expert, const float* gate, const int32_t* token_index, int64_t T,
                                       int K, int E, int64_t capacity, MoeConfig::DropPolicy policy);

// One MoE layer:
//   y (N,C) = sum over the token's kept top-k experts e of gate_e * expert_e(x) (+ shared(x)),
// where capacity, if set, drops assignments, and the local experts run as one grouped GEMM per
// projection.
//
// Layout invariance: the load-balancing statistics and the capacity decisions are taken over ALL
// tokens of the micro-batch. `token_group` is the set of ranks holding the other tokens of the
// same micro-batch (nullptr: this rank holds them all); every rank of it must hold the same
// number of tokens, and the group must move host memory (an MPI Comm: routing metadata is small
// and lives on the host). Ranks that hold the SAME tokens (tensor parallelism without sequence
// parallelism) must not be in it: they would be counted twice.
//
// Precision: x, y and every row the experts see are in the activations' dtype (f32, or bf16 with
// bf16 compute weights); the router runs in its weight's dtype, and with bf16 activations the
// caller passes the f32 master router (x is converted for it), so routing decisions, the gates,
// the aux and z losses and their gradients stay in f32, as Megatron-Core's fp32 router does.
// Weight gradients are f32 in either case.
//
// Expert tensor parallelism (expert_tp, size T > 1): the F hidden units of every routed expert are
// split over the group (fc rows, proj columns), as Megatron-Core does. The ranks of expert_tp may
// hold different tokens. With a dispatcher that spans expert_tp (allgather over expert_tp x ep)
// every rank already sees the whole group's rows and its reduce-scatter sums the partial
// outputs. Otherwise (alltoall over ep) the layer all-gathers the dispatched expert rows over
// expert_tp, runs its hidden units on all of them and reduce-scatters the partial outputs back
// (backward: all-gather of d(expert outputs), reduce-scatter of d(expert inputs)). Either way
// every expert_tp rank computes the same proj-bias gradient (its rows are the whole group's),
// each its own fc/proj slices' gradients; the shared expert is not split. Proj biases are added
// by expert_tp rank 0.
class MoeLayer {
 public:
  // C channels. dispatcher: nullptr = a local one (all E experts on this rank); otherwise its
  // num_experts must be cfg.num_experts and the weights hold its num_local_experts().
  // The dispatcher and the comms are held by pointer and must outlive the layer.
  MoeLayer(const MoeConfig& cfg, Ops& ops, int64_t C, const TokenDispatcher* dispatcher = nullptr,
           const Comm* token_group = nullptr, const Comm* expert_tp = nullptr);
  const MoeConfig& config() const { return cfg_; }
  int num_local_experts() const { return disp_->num_local_experts(); }
  int64_t local_hidden() const { return Fl_; }  // Fl
  // Shapes of every weight of MoeWeights for this rank (name -> shape), for the parameter table.
  std::vector<std::pair<std::string, Shape>> weight_shapes() const;
  size_t scratch_bytes() const;  // device memory of the scratch shared by all calls

  // y (N,C) OVERWRITTEN from x (N,C). token_index (N, host): each token's index in the
  // micro-batch (nullptr: token_group.rank() * N + t). Collective over token_group, the
  // dispatcher's group and expert_tp.
  MoeLosses forward(MoeActs& acts, Tensor y, Tensor x, const int32_t* token_index, const MoeWeights& w);
  // dx (N,C) OVERWRITTEN; the weight gradients g ACCUMULATE. dy (N,C) the gradient of y;
  // backward adds aux_scale * (the gradients of the aux and z losses, MoeLosses) to what comes
  // from dy. The trainer passes aux_scale = 1 / (micro-batches in the global batch) when its main
  // loss is a mean over them.
  // Each rank's router gradient covers only its own tokens, and each expert's gradient only the
  // tokens that reached it through this rank's dispatcher: the trainer sums the router gradient
  // over every rank holding other tokens (data + token_group ranks, like a sequence-parallel norm)
  // and expert gradients over the ranks holding the same experts with other tokens (the
  // expert-data-parallel group).
  void backward(Tensor dx, MoeActs& acts, Tensor dy, const MoeWeights& w, const MoeWeights& g, float aux_scale);

 private:
  // forward's first steps: the routing (each assignment's expert, -1 when dropped; stat: the
  // assignments per expert, then the tokens) and its losses.
  std::vector<int32_t> route(MoeActs& A, std::vector<int64_t>& stat, Tensor x, const int32_t* token_index,
                             const MoeWeights& w);
  MoeLosses router_losses(MoeActs& A, const std::vector<int64_t>& stat);
  // The routing statistics and losses are over a micro-batch split over several ranks.
  bool spans_token_group() const { return token_group_ && token_group_->size() > 1; }
  void mlp_forward(Tensor out, Tensor h, Tensor a, Tensor x, Tensor fc, Tensor fcb, Tensor proj, Tensor projb,
                   const int64_t* groups);
  void experts_forward(MoeActs& A, Tensor out, const MoeWeights& w, const int64_t* groups);
  void experts_backward(MoeActs& A, Tensor dx, Tensor dout, const MoeWeights& w, const MoeWeights& g,
                        const int64_t* groups);
  // out (M,OUT) += s (x A_e^T) B_e^T per expert group; u (M,r) receives s x A_e^T.
  void lora_forward(Tensor out, Tensor u, Tensor x, Tensor A, Tensor B, const int64_t* groups);
  // Its backward: dA, dB accumulate, dx (M,IN) accumulates (optional).
  void lora_backward(Tensor dx, Tensor dA, Tensor dB, Tensor dout, Tensor x, Tensor u, Tensor A, Tensor B,
                     const int64_t* groups);
  Tensor router_input(Tensor x, const MoeWeights& w);
  bool gathers_etp() const { return etp_size_ > 1 && !disp_->spans_expert_tp(); }
  void plan_etp_gather(MoeActs& A);
  // rows (M, C) of every expert_tp rank (padded) -> all (etp_rows, C) grouped by local expert.
  void etp_gather(Tensor all, Tensor rows, MoeActs& A);
  // Partial sums all (etp_rows, C) -> this rank's rows (M, C) summed over expert_tp.
  void etp_reduce_scatter(Tensor rows, Tensor all, MoeActs& A);
  MoeConfig cfg_;
  Ops& ops_;
  int64_t C_, Fl_;
  std::unique_ptr<TokenDispatcher> own_disp_;
  const TokenDispatcher* disp_;
  const Comm* token_group_;
  const Comm* etp_;
  int etp_size_ = 1, etp_rank_ = 0;
  // Scratch shared by all calls (one forward or backward of this layer runs at a time).
  GrowBuffer ones_, psum_, dgates_, dye_, da_, dh_, drow_, dprobs_, dlse_, dlogits_, dxr_, xr_, etp_full_, etp_pad_,
      dye_all_, lora_du_, lora_out_;
};

}  // namespace mpigpt
