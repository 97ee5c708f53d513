// Expert parallelism: the token dispatchers that move each kept (token, k) routing assignment of a
// mixture-of-experts layer to the rank holding its expert and bring the expert outputs back,
// weighted by the gate.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "lib/kernels/buffer.h"
#include "lib/kernels/ops.h"
#include "parallel/comm.h"

namespace mpigpt {

// A grow-only device allocation reused across calls while large enough (never freed between
// micro-batches, so a steady state allocates nothing). Contents are NOT cleared by get().
struct GrowBuffer {
  Buffer buf;
  Tensor get(Ops& ops, Shape s, DType t = DType::F32) {
    const size_t need = std::max<size_t>(64, size_t(s.numel()) * dtype_size(t));
    if (buf.bytes() < need) buf = Buffer(ops, need + need / 4);
    return buf.tensor(s, t);
  }
};

// The per-micro-batch state of one dispatch: what plan() decided and the buffers the four
// passes use. One per micro-batch in flight (it lives in the layer's saved activations).
struct DispatchState {
  // ---- set by plan(), read by the layer ----
  int64_t N = 0;                         // this rank's tokens
  int K = 0;                             // assignments per token
  std::vector<int64_t> rows_per_expert;  // expert rows per local expert (host), for the grouped GEMM
  int64_t expert_rows = 0;               // M = their sum
  // ---- the dispatcher's own ----
  int64_t token_rows = 0;                                // kept assignments of this rank's tokens (alltoall)
  std::vector<int64_t> send_rows, recv_rows;             // per ep rank (alltoall)
  Tensor gates;                                          // (N,K) this rank's gates (the layer's, must outlive)
  GrowBuffer tok, slot, perm, inv_perm;                  // device i32 index maps
  GrowBuffer gates_full, staging, staging2, token_side;  // gathered gates; row buffers; saved combine rows
  Tensor tok_t, slot_t, perm_t, inv_perm_t, gates_full_t, token_side_t;
  size_t bytes() const {  // device memory held
    size_t n = 0;
    for (const GrowBuffer* b : {&tok, &slot, &perm, &inv_perm, &gates_full, &staging, &staging2, &token_side})
      n += b->buf.bytes();
    return n;
  }
};

// The experts are split over the ep group: ep rank j holds experts [j*E/ep, (j+1)*E/ep). Two
// strategies fill this one interface, written as forward/backward pairs:
//
//   dispatch_forward:  token rows x (N,C) -> expert rows xe (M,C), grouped by local expert
//   dispatch_backward: dxe (M,C) -> dx (N,C) ACCUMULATES (the transpose of dispatch_forward)
//   combine_forward:   expert rows ye (M,C) -> y (N,C) ACCUMULATES sum_k gate * ye[row of (t,k)]
//   combine_backward:  dy (N,C) -> dye (M,C) = gate * dy[t], dgates (N,K) = dy[t] . ye[row]
//
// Either with a null comm, or one rank, is a local permutation. Index maps and counts live on the
// host; rows move only through ops (gather_rows, scatter_add_rows, moe_combine) and Comm.
class TokenDispatcher {
 public:
  // ep: the expert-parallel group (nullptr = one rank); E experts in total, divisible by ep.
  // member_ep (allgather only): the group is expert_tp x ep, member i holds the experts of ep
  // rank member_ep[i]; the members sharing an ep rank hold different hidden units of the same
  // experts (expert_tp), so their partial outputs add up in the combine's reduce-scatter.
  // Empty: member i is ep rank i.
  TokenDispatcher(Ops& ops, const Comm* ep, int num_experts, std::vector<int> member_ep = {});
  virtual ~TokenDispatcher() = default;
  int num_experts() const { return E_; }
  int num_local_experts() const { return El_; }
  int first_expert() const { return first_; }
  int ep_size() const { return P_; }
  // The group also spans expert_tp (member_ep repeats ep ranks): the layer must not gather its
  // expert rows over expert_tp itself.
  bool spans_expert_tp() const { return owners_ < P_; }

  // Plan one micro-batch from this rank's routing: expert (N*K, host) is the expert of each
  // assignment t*K + k, -1 where it was dropped; gates (N,K) the layer's gate tensor (kept by
  // reference until the backward). Collective over the group.
  virtual void plan(DispatchState& s, const std::vector<int32_t>& expert, int64_t N, int K, Tensor gates) const = 0;
  // xe (M,C) from x (N,C). Collective.
  virtual void dispatch_forward(Tensor xe, Tensor x, DispatchState& s) const = 0;
  // y (N,C) ACCUMULATES the gate-weighted expert outputs ye (M,C). Collective.
  virtual void combine_forward(Tensor y, Tensor ye, DispatchState& s) const = 0;
  // dye (M,C) and dgates (N,K) (both OVERWRITTEN; dropped assignments get 0) from dy (N,C);
  // ye (M,C) is combine_forward's input. Collective.
  virtual void combine_backward(Tensor dye, Tensor dgates, Tensor dy, Tensor ye, DispatchState& s) const = 0;
  // dx (N,C) ACCUMULATES the gradient of dispatch_forward's x from dxe (M,C). Collective.
  virtual void dispatch_backward(Tensor dx, Tensor dxe, DispatchState& s) const = 0;

 protected:
  Ops& ops_;
  const Comm* ep_;
  int P_ = 1, rank_ = 0, E_ = 0, El_ = 0, first_ = 0;
  int owners_ = 1;  // distinct expert sets over the group (ep)
};

// Megatron's "alltoall": counts are exchanged over ep, rows are permuted by (destination rank,
// local expert), all_to_all_v'd and regrouped by local expert; combine is the exact reverse. Each
// rank's tokens stay its own: ep ranks may hold different micro-batches.
class AllToAllDispatcher final : public TokenDispatcher {
 public:
  AllToAllDispatcher(Ops& ops, const Comm* ep, int num_experts) : TokenDispatcher(ops, ep, num_experts) {}
  void plan(DispatchState& s, const std::vector<int32_t>& expert, int64_t N, int K, Tensor gates) const override;
  void dispatch_forward(Tensor xe, Tensor x, DispatchState& s) const override;
  void combine_forward(Tensor y, Tensor ye, DispatchState& s) const override;
  void combine_backward(Tensor dye, Tensor dgates, Tensor dy, Tensor ye, DispatchState& s) const override;
  void dispatch_backward(Tensor dx, Tensor dxe, DispatchState& s) const override;
};

// Megatron's "allgather": every rank of the group all-gathers the tokens and routing of the whole
// group, runs its local experts on the assignments that hit them, and a reduce-scatter returns
// each rank's share of the weighted sum (backward: all-gather of dy, reduce-scatter of dx and of
// dgates). Its group is the ep group (experts split over all of it), or expert_tp x ep, where each
// expert's hidden units are split over expert_tp: every member computes its partial outputs for
// all the group's tokens and the reduce-scatter sums them. Every rank of the group must hold the
// same number of tokens N.
class AllGatherDispatcher final : public TokenDispatcher {
 public:
  AllGatherDispatcher(Ops& ops, const Comm* group, int num_experts, std::vector<int> member_ep = {})
      : TokenDispatcher(ops, group, num_experts, std::move(member_ep)) {}
  void plan(DispatchState& s, const std::vector<int32_t>& expert, int64_t N, int K, Tensor gates) const override;
  void dispatch_forward(Tensor xe, Tensor x, DispatchState& s) const override;
  void combine_forward(Tensor y, Tensor ye, DispatchState& s) const override;
  void combine_backward(Tensor dye, Tensor dgates, Tensor dy, Tensor ye, DispatchState& s) const override;
  void dispatch_backward(Tensor dx, Tensor dxe, DispatchState& s) const override;
};

}  // namespace mpigpt
