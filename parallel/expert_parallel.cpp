// Expert-parallel token dispatchers: all-to-all and all-gather, forward/backward pairs.
#include "parallel/expert_parallel.h"

namespace mpigpt {

namespace {

// A host i32 array uploaded into a grow-only device buffer (through ops.copy: the model side
// never assumes device memory is host memory).
Tensor upload(Ops& ops, GrowBuffer& b, std::vector<int32_t>& v) {
  Tensor t = b.get(ops, {int64_t(v.size())}, DType::I32);
  if (!v.empty()) ops.copy(t, Tensor(v.data(), {int64_t(v.size())}, DType::I32, Device::CPU));
  return t;
}

std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t C) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * C;
  return out;
}

}  // namespace

TokenDispatcher::TokenDispatcher(Ops& ops, const Comm* ep, int num_experts, std::vector<int> member_ep)
    : ops_(ops), ep_(ep), E_(num_experts) {
  if (ep_ && ep_->size() > 1) {
    P_ = ep_->size();
    rank_ = ep_->rank();
  }
  int owner = rank_;
  owners_ = P_;
  if (!member_ep.empty()) {
    MPIGPT_CHECK(int(member_ep.size()) == P_, "expert parallelism: member_ep names {} ranks, the group has {}",
                 member_ep.size(), P_);
    owners_ = *std::max_element(member_ep.begin(), member_ep.end()) + 1;
    MPIGPT_CHECK(P_ % owners_ == 0, "expert parallelism: {} ep ranks over a group of {}", owners_, P_);
    owner = member_ep[rank_];
  }
  MPIGPT_CHECK(E_ >= 1 && E_ % owners_ == 0, "expert parallelism: {} experts cannot be split evenly over {} ranks", E_,
               owners_);
  El_ = E_ / owners_;
  first_ = owner * El_;
}

// ---- all-to-all -----------------------------------------------------------------------------

void AllToAllDispatcher::plan(DispatchState& s, const std::vector<int32_t>& expert, int64_t N, int K,
                              Tensor gates) const {
  MPIGPT_CHECK(int64_t(expert.size()) == N * K, "dispatch plan: {} assignments for N={} K={}", expert.size(), N, K);
  MPIGPT_CHECK(owners_ == P_, "the alltoall dispatcher's group must be the ep group (one expert set per rank)");
  s.N = N, s.K = K, s.gates = gates;
  // Send order: by expert (= by destination rank, then its local expert), tokens in order.
  std::vector<int32_t> count(static_cast<size_t>(E_), 0);
  for (int32_t e : expert) {
    MPIGPT_CHECK(e < E_, "dispatch plan: expert {} of {}", e, E_);
    if (e >= 0) ++count[e];
  }
  std::vector<int64_t> start(static_cast<size_t>(E_) + 1, 0);
  for (int e = 0; e < E_; ++e) start[e + 1] = start[e] + count[e];
  s.token_rows = start[E_];
  std::vector<int32_t> tok(static_cast<size_t>(s.token_rows)), slot(static_cast<size_t>(s.token_rows));
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t a = 0; a < N * K; ++a)
    if (expert[a] >= 0) {
      const int64_t i = fill[expert[a]]++;
      tok[i] = int32_t(a / K), slot[i] = int32_t(a);
    }
  s.tok_t = upload(ops_, s.tok, tok);
  s.slot_t = upload(ops_, s.slot, slot);
  s.send_rows.assign(static_cast<size_t>(P_), 0);
  for (int e = 0; e < E_; ++e) s.send_rows[e / El_] += count[e];
  // Every rank learns how many rows it receives from each rank for each of its local experts.
  std::vector<int32_t> recv(static_cast<size_t>(E_), 0);  // (P, El): rows from rank p for local expert l
  if (P_ > 1) {
    std::vector<int64_t> n(static_cast<size_t>(P_), El_);
    ep_->all_to_all_v(Tensor(recv.data(), {E_}, DType::I32), n, Tensor(count.data(), {E_}, DType::I32), n);
  } else {
    recv = count;
  }
  s.recv_rows.assign(static_cast<size_t>(P_), 0);
  s.rows_per_expert.assign(static_cast<size_t>(El_), 0);
  for (int p = 0; p < P_; ++p)
    for (int l = 0; l < El_; ++l) s.recv_rows[p] += recv[p * El_ + l], s.rows_per_expert[l] += recv[p * El_ + l];
  s.expert_rows = 0;
  for (int64_t r : s.rows_per_expert) s.expert_rows += r;
  if (P_ == 1) return;  // the send order is already grouped by expert
  // Received rows arrive (source rank, local expert, token order); the experts want (local
  // expert, source rank, token order). perm: expert row -> received row; inv_perm its inverse.
  std::vector<int64_t> recv_start(static_cast<size_t>(E_) + 1, 0);  // of block (p, l) in the received buffer
  for (int b = 0; b < E_; ++b) recv_start[b + 1] = recv_start[b] + recv[b];
  std::vector<int32_t> perm(static_cast<size_t>(s.expert_rows)), inv(static_cast<size_t>(s.expert_rows));
  int64_t j = 0;
  for (int l = 0; l < El_; ++l)
    for (int p = 0; p < P_; ++p)
      for (int64_t r = recv_start[p * El_ + l]; r < recv_start[p * El_ + l + 1]; ++r, ++j)
        perm[j] = int32_t(r), inv[r] = int32_t(j);
  s.perm_t = upload(ops_, s.perm, perm);
  s.inv_perm_t = upload(ops_, s.inv_perm, inv);
}

void AllToAllDispatcher::dispatch_forward(Tensor xe, Tensor x, DispatchState& s) const {
  const int64_t C = x.size(-1);
  if (P_ == 1) return ops_.gather_rows(xe, x, s.tok_t);
  Tensor send = s.staging.get(ops_, {s.token_rows, C}, x.dtype),
         recv = s.staging2.get(ops_, {s.expert_rows, C}, x.dtype);
  ops_.gather_rows(send, x, s.tok_t);
  ep_->all_to_all_v(recv, times(s.recv_rows, C), send, times(s.send_rows, C));
  ops_.gather_rows(xe, recv, s.perm_t);
}

void AllToAllDispatcher::combine_forward(Tensor y, Tensor ye, DispatchState& s) const {
  const int64_t C = y.size(-1);
  if (P_ == 1) return ops_.moe_combine(y, ye, s.slot_t, s.gates);
  Tensor back = s.staging2.get(ops_, {s.expert_rows, C}, ye.dtype);
  s.token_side_t = s.token_side.get(ops_, {s.token_rows, C}, ye.dtype);  // saved for combine_backward's dgates
  ops_.gather_rows(back, ye, s.inv_perm_t);
  ep_->all_to_all_v(s.token_side_t, times(s.send_rows, C), back, times(s.recv_rows, C));
  ops_.moe_combine(y, s.token_side_t, s.slot_t, s.gates);
}

void AllToAllDispatcher::combine_backward(Tensor dye, Tensor dgates, Tensor dy, Tensor ye, DispatchState& s) const {
  const int64_t C = dy.size(-1);
  ops_.fill(dgates, 0.0f);
  if (P_ == 1) return ops_.moe_combine_backward(dye, dgates, dy, ye, s.slot_t, s.gates);
  Tensor dsend = s.staging.get(ops_, {s.token_rows, C}, dy.dtype),
         drecv = s.staging2.get(ops_, {s.expert_rows, C}, dy.dtype);
  ops_.moe_combine_backward(dsend, dgates, dy, s.token_side_t, s.slot_t, s.gates);
  ep_->all_to_all_v(drecv, times(s.recv_rows, C), dsend, times(s.send_rows, C));
  ops_.gather_rows(dye, drecv, s.perm_t);
}

void AllToAllDispatcher::dispatch_backward(Tensor dx, Tensor dxe, DispatchState& s) const {
  const int64_t C = dx.size(-1);
  if (P_ == 1) return ops_.scatter_add_rows(dx, dxe, s.tok_t);
  Tensor back = s.staging2.get(ops_, {s.expert_rows, C}, dxe.dtype),
         dsend = s.staging.get(ops_, {s.token_rows, C}, dxe.dtype);
  ops_.gather_rows(back, dxe, s.inv_perm_t);
  ep_->all_to_all_v(dsend, times(s.send_rows, C), back, times(s.recv_rows, C));
  ops_.scatter_add_rows(dx, dsend, s.tok_t);
}

// ---- all-gather -----------------------------------------------------------------------------

void AllGatherDispatcher::plan(DispatchState& s, const std::vector<int32_t>& expert, int64_t N, int K,
                               Tensor gates) const {
  MPIGPT_CHECK(int64_t(expert.size()) == N * K, "dispatch plan: {} assignments for N={} K={}", expert.size(), N, K);
  s.N = N, s.K = K, s.gates = gates;
  std::vector<int32_t> all(static_cast<size_t>(P_ * N * K));
  if (P_ > 1) {
    int32_t n = int32_t(N);
    std::vector<int32_t> ns(static_cast<size_t>(P_));
    ep_->all_gather(Tensor(ns.data(), {P_}, DType::I32), Tensor(&n, {1}, DType::I32));
    for (int p = 0; p < P_; ++p)
      MPIGPT_CHECK(ns[p] == N, "allgather dispatcher: rank {} holds {} tokens, rank {} holds {}; all must be equal",
                   rank_, N, p, ns[p]);
    std::vector<int32_t> mine(expert);
    ep_->all_gather(Tensor(all.data(), {P_ * N * K}, DType::I32), Tensor(mine.data(), {N * K}, DType::I32));
    s.gates_full_t = s.gates_full.get(ops_, {P_ * N, K});
    ep_->all_gather(s.gates_full_t, gates);
  } else {
    all = expert;
    s.gates_full_t = gates;
  }
  // This rank's local experts' assignments of the whole group, by local expert then token.
  s.rows_per_expert.assign(static_cast<size_t>(El_), 0);
  for (int32_t e : all)
    if (e >= first_ && e < first_ + El_) ++s.rows_per_expert[e - first_];
  std::vector<int64_t> fill(static_cast<size_t>(El_), 0);
  for (int l = 1; l < El_; ++l) fill[l] = fill[l - 1] + s.rows_per_expert[l - 1];
  s.expert_rows = El_ ? fill[El_ - 1] + s.rows_per_expert[El_ - 1] : 0;
  std::vector<int32_t> tok(static_cast<size_t>(s.expert_rows)), slot(static_cast<size_t>(s.expert_rows));
  for (int64_t a = 0; a < int64_t(all.size()); ++a) {
    const int32_t e = all[a];
    if (e >= first_ && e < first_ + El_) {
      const int64_t i = fill[e - first_]++;
      tok[i] = int32_t(a / K), slot[i] = int32_t(a);
    }
  }
  s.tok_t = upload(ops_, s.tok, tok);
  s.slot_t = upload(ops_, s.slot, slot);
}

void AllGatherDispatcher::dispatch_forward(Tensor xe, Tensor x, DispatchState& s) const {
  if (P_ == 1) return ops_.gather_rows(xe, x, s.tok_t);
  Tensor full = s.staging.get(ops_, {P_ * s.N, x.size(-1)}, x.dtype);
  ep_->all_gather(full, x);
  ops_.gather_rows(xe, full, s.tok_t);
}

void AllGatherDispatcher::combine_forward(Tensor y, Tensor ye, DispatchState& s) const {
  if (P_ == 1) return ops_.moe_combine(y, ye, s.slot_t, s.gates);
  const int64_t C = y.size(-1);
  Tensor full = s.staging.get(ops_, {P_ * s.N, C}, y.dtype), part = s.staging2.get(ops_, {s.N, C}, y.dtype);
  ops_.fill(full, 0.0f);
  ops_.moe_combine(full, ye, s.slot_t, s.gates_full_t);
  ep_->reduce_scatter_sum(part, full);
  ops_.add(y, y, part);
}

void AllGatherDispatcher::combine_backward(Tensor dye, Tensor dgates, Tensor dy, Tensor ye, DispatchState& s) const {
  if (P_ == 1) {
    ops_.fill(dgates, 0.0f);
    return ops_.moe_combine_backward(dye, dgates, dy, ye, s.slot_t, s.gates);
  }
  const int64_t C = dy.size(-1);
  Tensor full = s.staging.get(ops_, {P_ * s.N, C}, dy.dtype);
  Tensor dg_full = s.staging2.get(ops_, {P_ * s.N, int64_t(s.K)});
  ep_->all_gather(full, dy);
  ops_.fill(dg_full, 0.0f);
  // Each assignment's dgate is computed on the one rank holding its expert; the others add 0.
  ops_.moe_combine_backward(dye, dg_full, full, ye, s.slot_t, s.gates_full_t);
  ep_->reduce_scatter_sum(dgates, dg_full);
}

void AllGatherDispatcher::dispatch_backward(Tensor dx, Tensor dxe, DispatchState& s) const {
  if (P_ == 1) return ops_.scatter_add_rows(dx, dxe, s.tok_t);
  const int64_t C = dx.size(-1);
  Tensor full = s.staging.get(ops_, {P_ * s.N, C}, dx.dtype), part = s.staging2.get(ops_, {s.N, C}, dx.dtype);
  ops_.fill(full, 0.0f);
  ops_.scatter_add_rows(full, dxe, s.tok_t);
  ep_->reduce_scatter_sum(part, full);
  ops_.add(dx, dx, part);
}

}  // namespace mpigpt
