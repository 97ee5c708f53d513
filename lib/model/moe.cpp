// The mixture-of-experts layer: router, capacity, losses, grouped experts, dispatch (see moe.h).
#include "lib/model/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace mpigpt {

namespace {
// The first m rows of a (rows, C) tensor.
Tensor rows_of(Tensor t, int64_t m) { return Tensor(t.ptr, {m, t.size(-1)}, t.dtype, t.device); }
template <class T>
Tensor host(std::vector<T>& v, DType dt) {
  return Tensor(v.data(), {int64_t(v.size())}, dt, Device::CPU);
}
}  // namespace

void MoeConfig::validate() const {
  MPIGPT_CHECK(num_experts >= 1, "moe: num_experts = {} must be >= 1", num_experts);
  MPIGPT_CHECK(top_k >= 1 && top_k <= num_experts, "moe: top_k = {} must lie in [1, num_experts = {}]", top_k,
               num_experts);
  MPIGPT_CHECK(hidden >= 1, "moe: hidden (expert F) = {} must be >= 1", hidden);
  MPIGPT_CHECK(shared_hidden >= 0, "moe: shared_hidden = {} must be >= 0 (0: no shared expert)", shared_hidden);
  MPIGPT_CHECK(aux_loss_coeff >= 0.0f && z_loss_coeff >= 0.0f,
               "moe: aux_loss_coeff = {} and z_loss_coeff = {} must be >= 0", aux_loss_coeff, z_loss_coeff);
  MPIGPT_CHECK(std::isfinite(capacity_factor), "moe: capacity_factor = {} must be finite (<= 0: dropless)",
               capacity_factor);
}

int64_t moe_capacity(const MoeConfig& cfg, int64_t T) {
  if (cfg.capacity_factor <= 0.0f) return 0;
  // In double from the float factor, less a relative 1e-6 (the float rounding of the factor is
  // ~6e-8) so that e.g. 1.1f * 10 gives 11, not 12.
  const double c = double(cfg.capacity_factor) * double(T) * cfg.top_k / cfg.num_experts;
  return std::max<int64_t>(1, int64_t(std::ceil(c * (1.0 - 1e-6))));
}

std::vector<uint8_t> moe_capacity_keep(const int32_t* expert, const float* gate, const int32_t* token_index, int64_t T,
                                       int K, int E, int64_t capacity, MoeConfig::DropPolicy policy) {
  std::vector<std::vector<int64_t>> by_expert(static_cast<size_t>(E));
  for (int64_t a = 0; a < T * K; ++a)
    if (expert[a] >= 0) by_expert[expert[a]].push_back(a);
  std::vector<uint8_t> keep(static_cast<size_t>(T * K), 0);
  for (auto& list : by_expert) {
    auto earlier = [&](int64_t a, int64_t b) { return token_index[a / K] < token_index[b / K]; };
    if (policy == MoeConfig::DropPolicy::Probs)
      std::sort(list.begin(), list.end(),
                [&](int64_t a, int64_t b) { return gate[a] != gate[b] ? gate[a] > gate[b] : earlier(a, b); });
    else
      std::sort(list.begin(), list.end(), earlier);
    for (size_t i = 0; i < list.size() && int64_t(i) < capacity; ++i) keep[list[i]] = 1;
  }
  return keep;
}

MoeLayer::MoeLayer(const MoeConfig& cfg, Ops& ops, int64_t C, const TokenDispatcher* dispatcher,
                   const Comm* token_group, const Comm* expert_tp)
    : cfg_(cfg), ops_(ops), C_(C), disp_(dispatcher), token_group_(token_group), etp_(expert_tp) {
  cfg_.validate();
  if (!disp_) {
    own_disp_ = std::make_unique<AllToAllDispatcher>(ops, nullptr, cfg_.num_experts);
    disp_ = own_disp_.get();
  }
  MPIGPT_CHECK(disp_->num_experts() == cfg_.num_experts, "moe: the dispatcher routes {} experts, the config has {}",
               disp_->num_experts(), cfg_.num_experts);
  if (etp_ && etp_->size() > 1) etp_size_ = etp_->size(), etp_rank_ = etp_->rank();
  MPIGPT_CHECK(cfg_.hidden % etp_size_ == 0, "moe: expert hidden size {} cannot be split over expert_tp = {}",
               cfg_.hidden, etp_size_);
  Fl_ = cfg_.hidden / etp_size_;
}

std::vector<std::pair<std::string, Shape>> MoeLayer::weight_shapes() const {
  const int64_t E = cfg_.num_experts, El = num_local_experts();
  const bool glu = cfg_.activation == MoeConfig::Activation::Swiglu;
  const int64_t H = glu ? 2 * Fl_ : Fl_, Fs = cfg_.shared_hidden, Hs = glu ? 2 * Fs : Fs;
  std::vector<std::pair<std::string, Shape>> s = {
      {"router.weight", {E, C_}}, {"experts.fc.weight", {El, H, C_}}, {"experts.proj.weight", {El, C_, Fl_}}};
  if (cfg_.bias) s.push_back({"experts.fc.bias", {El, H}}), s.push_back({"experts.proj.bias", {El, C_}});
  if (Fs > 0) {
    s.push_back({"shared.fc.weight", {Hs, C_}});
    s.push_back({"shared.proj.weight", {C_, Fs}});
    if (cfg_.bias) s.push_back({"shared.fc.bias", {Hs}}), s.push_back({"shared.proj.bias", {C_}});
  }
  return s;
}

// out = proj(act(fc(x))): dense when groups is null, else grouped over the local experts.
void MoeLayer::mlp_forward(Tensor out, Tensor h, Tensor a, Tensor x, Tensor fc, Tensor fcb, Tensor proj, Tensor projb,
                           const int64_t* groups) {
  if (groups)
    ops_.grouped_linear_forward(h, x, fc, fcb, groups);
  else
    ops_.linear_forward(h, x, fc, fcb);
  if (cfg_.activation == MoeConfig::Activation::Gelu)
    ops_.gelu_forward(a, h);
  else
    ops_.swiglu_forward(a, h);
  if (groups)
    ops_.grouped_linear_forward(out, a, proj, projb, groups);
  else
    ops_.linear_forward(out, a, proj, projb);
}

// The routed experts on the rows A.xe_t: out = proj(act(fc(x))), each projection with its LoRA
// update when adapted (on the product before the activation, and on the partial output).
void MoeLayer::experts_forward(MoeActs& A, Tensor out, const MoeWeights& w, const int64_t* groups) {
  const int64_t Mt = A.xe_t.size(0);
  const DType dt = A.xe_t.dtype;
  ops_.grouped_linear_forward(A.h_t, A.xe_t, w.fc, w.fc_bias, groups);
  if (w.fc_lora_A.defined()) {
    A.ufc_t = A.ufc.get(ops_, {Mt, w.fc_lora_A.size(1)}, dt);
    lora_forward(A.h_t, A.ufc_t, A.xe_t, w.fc_lora_A, w.fc_lora_B, groups);
  }
  if (cfg_.activation == MoeConfig::Activation::Gelu)
    ops_.gelu_forward(A.a_t, A.h_t);
  else
    ops_.swiglu_forward(A.a_t, A.h_t);
  ops_.grouped_linear_forward(out, A.a_t, w.proj, etp_rank_ == 0 ? w.proj_bias : Tensor(), groups);
  if (w.proj_lora_A.defined()) {  // under expert_tp each rank's partial update, summed with the base's
    A.ufp_t = A.ufp.get(ops_, {Mt, w.proj_lora_A.size(1)}, dt);
    lora_forward(out, A.ufp_t, A.a_t, w.proj_lora_A, w.proj_lora_B, groups);
  }
}

// Its backward from dout (rows, C): the weight gradients accumulate; dx (rows, C) is overwritten.
void MoeLayer::experts_backward(MoeActs& A, Tensor dx, Tensor dout, const MoeWeights& w, const MoeWeights& g,
                                const int64_t* groups) {
  const int64_t Mt = A.xe_t.size(0), H = A.h_t.size(1);
  const DType dt = dout.dtype;
  Tensor da = da_.get(ops_, {Mt, Fl_}, dt), dh = dh_.get(ops_, {Mt, H}, dt);
  ops_.grouped_linear_backward(da, g.proj, g.proj_bias, dout, A.a_t, w.proj, groups);
  if (w.proj_lora_A.defined())
    lora_backward(da, g.proj_lora_A, g.proj_lora_B, dout, A.a_t, A.ufp_t, w.proj_lora_A, w.proj_lora_B, groups);
  if (cfg_.activation == MoeConfig::Activation::Swiglu)
    ops_.swiglu_backward(dh, da, A.h_t);
  else
    ops_.gelu_backward(dh, da, A.h_t);
  ops_.grouped_linear_backward(dx, g.fc, g.fc_bias, dh, A.xe_t, w.fc, groups);
  if (w.fc_lora_A.defined())
    lora_backward(dx, g.fc_lora_A, g.fc_lora_B, dh, A.xe_t, A.ufc_t, w.fc_lora_A, w.fc_lora_B, groups);
}

// LoRA per expert from ops: u = s x A_e^T, then B_e's product into scratch added to out.
void MoeLayer::lora_forward(Tensor out, Tensor u, Tensor x, Tensor A, Tensor B, const int64_t* groups) {
  const int64_t M = x.size(0);
  ops_.grouped_linear_forward(u, x, A, Tensor(), groups);
  ops_.scale(u, cfg_.lora_scale);
  Tensor t = lora_out_.get(ops_, {M, out.size(1)}, out.dtype);
  ops_.grouped_linear_forward(t, u, B, Tensor(), groups);
  ops_.add(out, out, t);
}

void MoeLayer::lora_backward(Tensor dx, Tensor dA, Tensor dB, Tensor dout, Tensor x, Tensor u, Tensor A, Tensor B,
                             const int64_t* groups) {
  const int64_t M = x.size(0);
  // du = dout B_e, dB_e += dout^T u; then du *= s is d(loss)/d(x A_e^T).
  Tensor du = lora_du_.get(ops_, {M, u.size(1)}, dout.dtype);
  ops_.grouped_linear_backward(du, dB, Tensor(), dout, u, B, groups);
  ops_.scale(du, cfg_.lora_scale);
  Tensor t = dx.defined() ? lora_out_.get(ops_, {M, x.size(1)}, dx.dtype) : Tensor();
  ops_.grouped_linear_backward(t, dA, Tensor(), du, x, A, groups);  // dA_e += du^T x, t = du A_e
  if (dx.defined()) ops_.add(dx, dx, t);
}

// The router's input: x itself, or x converted to the router weight's dtype (f32) when the
// activations are bf16, so that routing, its losses and gradients stay in f32.
Tensor MoeLayer::router_input(Tensor x, const MoeWeights& w) {
  if (x.dtype == w.router.dtype) return x;
  Tensor xr = xr_.get(ops_, {x.size(0), C_}, w.router.dtype);
  ops_.copy(xr, x);
  return xr;
}

size_t MoeActs::bytes() const {
  size_t n = dispatch.bytes() + etp_index.buf.bytes();
  for (const GrowBuffer* b : {&logits, &probs, &topk, &gates, &lse, &xe, &h, &a, &ye, &sh, &sa, &ufc, &ufp})
    n += b->buf.bytes();
  return n;
}

size_t MoeLayer::scratch_bytes() const {
  size_t n = 0;
  for (const GrowBuffer* b : {&ones_, &psum_, &dgates_, &dye_, &da_, &dh_, &drow_, &dprobs_, &dlse_, &dlogits_, &dxr_,
                              &xr_, &etp_full_, &etp_pad_, &dye_all_, &lora_du_, &lora_out_})
    n += b->buf.bytes();
  return n;
}

void MoeLayer::plan_etp_gather(MoeActs& A) {
  const DispatchState& D = A.dispatch;
  const int El = num_local_experts(), P = etp_size_;
  std::vector<int32_t> mine(static_cast<size_t>(El)), all(static_cast<size_t>(P * El));
  for (int l = 0; l < El; ++l) mine[l] = int32_t(D.rows_per_expert[l]);
  etp_->all_gather(host(all, DType::I32), host(mine, DType::I32));
  std::vector<int64_t> rows(static_cast<size_t>(P), 0);
  A.etp_groups.assign(static_cast<size_t>(El), 0);
  for (int p = 0; p < P; ++p)
    for (int l = 0; l < El; ++l) rows[p] += all[p * El + l], A.etp_groups[l] += all[p * El + l];
  A.etp_pad = *std::max_element(rows.begin(), rows.end());
  A.etp_rows = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  // Rank p's rows start at p * etp_pad, its local experts' blocks one after the other.
  std::vector<int32_t> index;
  index.reserve(static_cast<size_t>(A.etp_rows));
  std::vector<int64_t> next(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) next[p] = p * A.etp_pad;
  for (int l = 0; l < El; ++l)
    for (int p = 0; p < P; ++p)
      for (int64_t r = 0; r < all[p * El + l]; ++r) index.push_back(int32_t(next[p]++));
  A.etp_index_t = A.etp_index.get(ops_, {A.etp_rows}, DType::I32);
  if (A.etp_rows) ops_.copy(A.etp_index_t, host(index, DType::I32));
}

void MoeLayer::etp_gather(Tensor all, Tensor rows, MoeActs& A) {
  if (A.etp_pad == 0) return;
  const int64_t C = C_;
  Tensor full = etp_full_.get(ops_, {etp_size_ * A.etp_pad, C}, rows.dtype);
  etp_->all_gather(full, rows);
  ops_.gather_rows(all, full, A.etp_index_t);
}

void MoeLayer::etp_reduce_scatter(Tensor rows, Tensor all, MoeActs& A) {
  if (A.etp_pad == 0) return;
  const int64_t C = C_, M = rows.size(0);
  Tensor full = etp_full_.get(ops_, {etp_size_ * A.etp_pad, C}, all.dtype);
  Tensor part = etp_pad_.get(ops_, {A.etp_pad, C}, all.dtype);
  ops_.fill(full, 0.0f);
  ops_.scatter_add_rows(full, all, A.etp_index_t);
  etp_->reduce_scatter_sum(part, full);
  if (M) ops_.copy(rows, rows_of(part, M));
}

// The router and the top-k choice: each assignment's expert (-1: dropped over capacity), and in
// stat the per-expert assignments before dropping, then the tokens, over the token group.
std::vector<int32_t> MoeLayer::route(MoeActs& A, std::vector<int64_t>& stat, Tensor x, const int32_t* token_index,
                                     const MoeWeights& w) {
  const int64_t N = x.size(0), E = cfg_.num_experts;
  const int K = cfg_.top_k;
  A.x = x, A.N = N;
  A.logits_t = A.logits.get(ops_, {N, E});
  A.probs_t = A.probs.get(ops_, {N, E});
  A.topk_t = A.topk.get(ops_, {N, K}, DType::I32);
  A.gates_t = A.gates.get(ops_, {N, K});
  A.lse_t = A.lse.get(ops_, {N});
  ops_.linear_forward(A.logits_t, router_input(x, w), w.router, Tensor());
  ops_.moe_router_forward(A.probs_t, A.topk_t, A.gates_t, A.lse_t, A.logits_t,
                          cfg_.router == MoeConfig::Router::Sigmoid, cfg_.normalize_gates());

  // Routing metadata to the host; statistics over the whole micro-batch.
  std::vector<int32_t> expert(static_cast<size_t>(N * K));
  std::vector<float> gate(static_cast<size_t>(N * K));
  ops_.copy(host(expert, DType::I32), A.topk_t.view({N * K}));
  ops_.copy(host(gate, DType::F32), A.gates_t.view({N * K}));
  stat.assign(static_cast<size_t>(E) + 1, 0);  // per-expert assignments before dropping, then N
  for (int32_t e : expert) ++stat[e];
  stat[E] = N;
  const bool grouped = spans_token_group();
  if (grouped) token_group_->allreduce_sum(stat.data(), int(E + 1));
  const int64_t T = stat[E];
  const int P = grouped ? token_group_->size() : 1, r = grouped ? token_group_->rank() : 0;

  if (const int64_t cap = moe_capacity(cfg_, T); cap > 0) {
    MPIGPT_CHECK(T == N * P, "moe capacity: the ranks of token_group must hold equal token counts ({} here, {} in all)",
                 N, T);
    std::vector<int32_t> idx(static_cast<size_t>(N));
    for (int64_t t = 0; t < N; ++t) idx[t] = token_index ? token_index[t] : int32_t(r * N + t);
    std::vector<int32_t> all_idx(static_cast<size_t>(T)), all_expert(static_cast<size_t>(T * K));
    std::vector<float> all_gate(static_cast<size_t>(T * K));
    if (grouped) {  // every rank decides for every assignment of the micro-batch, identically
      token_group_->all_gather(host(all_idx, DType::I32), host(idx, DType::I32));
      token_group_->all_gather(host(all_expert, DType::I32), host(expert, DType::I32));
      token_group_->all_gather(host(all_gate, DType::F32), host(gate, DType::F32));
    } else {
      all_idx = idx, all_expert = expert, all_gate = gate;
    }
    const auto keep =
        moe_capacity_keep(all_expert.data(), all_gate.data(), all_idx.data(), T, K, int(E), cap, cfg_.drop_policy);
    for (int64_t a = 0; a < N * K; ++a)
      if (!keep[r * N * K + a]) expert[a] = -1;
  }
  return expert;
}

// The load imbalance and the aux and z losses of the routing (A.aux_row, A.z_grad: their gradients).
MoeLosses MoeLayer::router_losses(MoeActs& A, const std::vector<int64_t>& stat) {
  const int64_t N = A.N, E = cfg_.num_experts, T = stat[E];
  const int K = cfg_.top_k;
  const bool grouped = spans_token_group();
  MoeLosses L;
  L.load_imbalance = T > 0 ? double(*std::max_element(stat.begin(), stat.end() - 1)) * double(E) / double(T * K) : 1.0;
  A.aux_row.assign(static_cast<size_t>(E), 0.0f);
  if (cfg_.aux_loss_coeff > 0.0f) {
    // P_e sums: ones (1,N) @ probs (N,E), reduced on the host in double.
    Tensor ones = ones_.get(ops_, {1, N}), psum = psum_.get(ops_, {1, E});
    ops_.fill(ones, 1.0f);
    ops_.gemm(psum, ones, A.probs_t, false, false, 1.0f, 0.0f);
    std::vector<float> pf(static_cast<size_t>(E));
    ops_.copy(host(pf, DType::F32), psum.view({E}));
    std::vector<double> P_e(pf.begin(), pf.end());
    if (grouped) token_group_->allreduce_sum(P_e.data(), int(E));
    double s = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      const double f = double(stat[e]) / double(T * K);
      s += f * P_e[e] / double(T);
      A.aux_row[e] = float(double(cfg_.aux_loss_coeff) * double(E) * f / double(T));
    }
    L.aux = double(cfg_.aux_loss_coeff) * double(E) * s;
  }
  A.z_grad = 0.0;
  if (cfg_.z_loss_coeff > 0.0f) {
    double ss = ops_.sum_squares(A.lse_t);
    if (grouped) token_group_->allreduce_sum(&ss, 1);
    L.z = double(cfg_.z_loss_coeff) * ss / double(T);
    A.z_grad = 2.0 * double(cfg_.z_loss_coeff) / double(T);
  }
  return L;
}

MoeLosses MoeLayer::forward(MoeActs& A, Tensor y, Tensor x, const int32_t* token_index, const MoeWeights& w) {
  const int64_t N = x.size(0), C = C_;
  const int K = cfg_.top_k;
  const bool glu = cfg_.activation == MoeConfig::Activation::Swiglu;
  MPIGPT_CHECK(x.numel() == N * C && y.numel() == N * C, "moe forward: x {} and y {} must be (N, C = {})",
               x.shape.str(), y.shape.str(), C);
  std::vector<int64_t> stat;
  const std::vector<int32_t> expert = route(A, stat, x, token_index, w);
  const MoeLosses L = router_losses(A, stat);

  // Experts: dispatch, one grouped GEMM per projection (over expert_tp's rows too when it gathers).
  DispatchState& D = A.dispatch;
  disp_->plan(D, expert, N, K, A.gates_t);
  const int64_t M = D.expert_rows, H = glu ? 2 * Fl_ : Fl_;
  const bool gather = gathers_etp();
  if (gather) plan_etp_gather(A);
  const int64_t Mt = gather ? A.etp_rows : M;  // rows the local experts run on
  const DType dt = x.dtype;  // of the rows: the activations' dtype
  A.xe_t = A.xe.get(ops_, {Mt, C}, dt);
  A.h_t = A.h.get(ops_, {Mt, H}, dt);
  A.a_t = A.a.get(ops_, {Mt, Fl_}, dt);
  A.ye_t = A.ye.get(ops_, {M, C}, dt);
  Tensor ye_all = gather ? dye_all_.get(ops_, {Mt, C}, dt) : A.ye_t;
  if (gather) {
    Tensor xe_mine = rows_of(etp_pad_.get(ops_, {std::max<int64_t>(A.etp_pad, 1), C}, dt), A.etp_pad);
    disp_->dispatch_forward(rows_of(xe_mine, M), x, D);
    etp_gather(A.xe_t, xe_mine, A);
  } else {
    disp_->dispatch_forward(A.xe_t, x, D);
  }
  const int64_t* groups = gather ? A.etp_groups.data() : D.rows_per_expert.data();
  experts_forward(A, ye_all, w, groups);
  if (gather) etp_reduce_scatter(A.ye_t, ye_all, A);

  if (cfg_.shared_hidden > 0) {
    const int64_t Fs = cfg_.shared_hidden;
    A.sh_t = A.sh.get(ops_, {N, glu ? 2 * Fs : Fs}, dt);
    A.sa_t = A.sa.get(ops_, {N, Fs}, dt);
    mlp_forward(y, A.sh_t, A.sa_t, x, w.shared_fc, w.shared_fc_bias, w.shared_proj, w.shared_proj_bias, nullptr);
  } else {
    ops_.fill(y, 0.0f);
  }
  disp_->combine_forward(y, A.ye_t, D);
  return L;
}

void MoeLayer::backward(Tensor dx, MoeActs& A, Tensor dy, const MoeWeights& w, const MoeWeights& g, float aux_scale) {
  const int64_t N = A.N, E = cfg_.num_experts, C = C_;
  const int K = cfg_.top_k;
  const bool glu = cfg_.activation == MoeConfig::Activation::Swiglu;
  MPIGPT_CHECK(dx.numel() == N * C && dy.numel() == N * C, "moe backward: dx {} and dy {} must be (N = {}, C = {})",
               dx.shape.str(), dy.shape.str(), N, C);
  DispatchState& D = A.dispatch;
  const bool gather = gathers_etp();
  const int64_t M = D.expert_rows, Mt = gather ? A.etp_rows : M;
  const int64_t* groups = gather ? A.etp_groups.data() : D.rows_per_expert.data();

  // Combine: d(gates) and d(expert outputs); then the experts, back to front.
  const DType dt = dy.dtype;
  Tensor dgates = dgates_.get(ops_, {N, K});
  Tensor dye = gather ? rows_of(etp_pad_.get(ops_, {std::max<int64_t>(A.etp_pad, 1), C}, dt), M)
                      : dye_.get(ops_, {M, C}, dt);
  disp_->combine_backward(dye, dgates, dy, A.ye_t, D);
  if (gather) {
    Tensor all = dye_.get(ops_, {Mt, C}, dt);
    etp_gather(all, rows_of(dye, A.etp_pad), A);
    dye = all;
  }
  Tensor dxe = dye;  // dye is spent once da is: its buffer takes d(expert inputs)
  experts_backward(A, dxe, dye, w, g, groups);
  if (gather) {
    Tensor mine = rows_of(dye_all_.get(ops_, {std::max<int64_t>(M, 1), C}, dt), M);
    etp_reduce_scatter(mine, dxe, A);
    dxe = mine;
  }

  // dx = shared expert's + dispatched experts' + router's.
  if (cfg_.shared_hidden > 0) {
    const int64_t Fs = cfg_.shared_hidden;
    Tensor dsa = da_.get(ops_, {N, Fs}, dt), dsh = dh_.get(ops_, {N, glu ? 2 * Fs : Fs}, dt);
    ops_.linear_backward(dsa, g.shared_proj, g.shared_proj_bias, dy, A.sa_t, w.shared_proj);
    if (glu)
      ops_.swiglu_backward(dsh, dsa, A.sh_t);
    else
      ops_.gelu_backward(dsh, dsa, A.sh_t);
    ops_.linear_backward(dx, g.shared_fc, g.shared_fc_bias, dsh, A.x, w.shared_fc);
  } else {
    ops_.fill(dx, 0.0f);
  }
  disp_->dispatch_backward(dx, dxe, D);

  Tensor dprobs, dlse;
  if (cfg_.aux_loss_coeff > 0.0f) {  // d aux / d p_te = aux_row[e] for every token: ones (N,1) @ row (1,E)
    std::vector<float> row(A.aux_row);
    for (float& v : row) v *= aux_scale;
    Tensor drow = drow_.get(ops_, {1, E}), ones = ones_.get(ops_, {N, 1});
    ops_.copy(drow.view({E}), host(row, DType::F32));
    ops_.fill(ones, 1.0f);
    dprobs = dprobs_.get(ops_, {N, E});
    ops_.gemm(dprobs, ones, drow, false, false, 1.0f, 0.0f);
  }
  if (A.z_grad != 0.0) {
    dlse = dlse_.get(ops_, {N});
    ops_.copy(dlse, A.lse_t);
    ops_.scale(dlse, float(A.z_grad * double(aux_scale)));
  }
  Tensor dlogits = dlogits_.get(ops_, {N, E}), dxr = dxr_.get(ops_, {N, C});
  ops_.moe_router_backward(dlogits, dgates, dprobs, dlse, A.logits_t, A.probs_t, A.topk_t,
                           cfg_.router == MoeConfig::Router::Sigmoid, cfg_.normalize_gates());
  ops_.linear_backward(dxr, g.router, Tensor(), dlogits, router_input(A.x, w), w.router);
  if (dx.dtype != dxr.dtype) {  // the router's f32 dx into the activations' dtype (router_input is spent)
    Tensor c = xr_.get(ops_, {N, C}, dx.dtype);
    ops_.copy(c, dxr);
    dxr = c;
  }
  ops_.add(dx, dx, dxr);
}

}  // namespace mpigpt
