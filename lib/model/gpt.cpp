// The GPT's set-up: its chunks and the views into the parameter buffers, the compute copy of the
// weights, and the activations each micro-batch in flight keeps (forward and backward:
// gpt_compute.cpp).
#include "lib/model/gpt.h"

#include <algorithm>

namespace mpigpt {

namespace {
// The MoE router's weight (a layer's name suffix): forward reads it as the f32 master whatever the
// compute dtype (MoeLayer::router_input).
constexpr const char* kRouter = "mlp.router.weight";
}  // namespace

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::None;
  if (s == "selective") return Recompute::Selective;
  MPIGPT_CHECK(s == "full", "engine.recompute = '{}' is not one of none | selective | full", s);
  return Recompute::Full;
}

GPT::GPT(const GptDims& d, Ops& ops, int B)
    : GPT(d, ops, B, ModelPlacement{}, TensorParallel(nullptr, false), build_param_table(d), -1) {}

GPT::GPT(const GptDims& d, Ops& ops, int B, const ModelPlacement& pl, const TensorParallel& tp,
         std::vector<ParamInfo> table, int64_t buffer_numel, const SequenceLayout& seq, const MoeLayout& moe)
    : d_(d), ops_(ops), B_(B), tp_(tp), cp_(seq.cp, seq.cp_comm, ops), table_(std::move(table)), arena_(ops) {
  MPIGPT_CHECK(d.C % d.NH == 0 && d.NH % d.NKV == 0, "C={} NH={} NKV={}", d.C, d.NH, d.NKV);
  MPIGPT_CHECK(d.Vp >= d.V && d.T <= d.maxT, "V={} Vp={} T={} maxT={}", d.V, d.Vp, d.T, d.maxT);
  MPIGPT_CHECK(pl.tp == tp_.size() && d.NH % pl.tp == 0 && d.NKV % pl.tp == 0 && d.Vp % pl.tp == 0,
               "placement tp {} vs group {}, NH {} NKV {} Vp {}", pl.tp, tp_.size(), d.NH, d.NKV, d.Vp);
  MPIGPT_CHECK(cp_.size() == 1 || d.T % (2 * cp_.size()) == 0, "T = {} does not split into 2*cp = {} chunks", d.T,
               2 * cp_.size());
  masked_ = cp_.size() > 1 || seq.packed;
  Tl_ = d.T / cp_.size();
  N_ = int64_t(B) * Tl_;
  MPIGPT_CHECK(N_ % tp_.size() == 0, "B*T = {} rows do not split over tp {}", N_, tp_.size());
  Nl_ = tp_.local_rows(N_);
  nh_ = d.NH / pl.tp;
  nkv_ = d.NKV / pl.tp;
  for (const auto& p : table_) {
    num_params_ += p.numel();
    buffer_numel_ = std::max(buffer_numel_, p.offset + p.numel());
  }
  MPIGPT_CHECK(buffer_numel < 0 || buffer_numel >= buffer_numel_, "buffer of {} < {}", buffer_numel, buffer_numel_);
  if (buffer_numel > 0) buffer_numel_ = buffer_numel;
  grad_numel_ = buffer_numel_;
  for (const auto& p : table_)
    if (p.frozen && p.numel() > 0) grad_numel_ = std::min(grad_numel_, p.offset);
  for (const auto& p : table_)
    MPIGPT_CHECK(p.frozen || p.offset + p.numel() <= grad_numel_, "{} is trained but lies after a frozen parameter",
                 p.name);
  if (d.moe.E > 0) {
    MoeConfig mc;
    mc.num_experts = d.moe.E;
    mc.top_k = d.moe.K;
    mc.router = d.moe.sigmoid ? MoeConfig::Router::Sigmoid : MoeConfig::Router::Softmax;
    mc.norm_topk_prob = d.moe.norm_topk;
    mc.aux_loss_coeff = d.moe.aux_coeff;
    mc.z_loss_coeff = d.moe.z_coeff;
    mc.capacity_factor = d.moe.capacity_factor;
    mc.drop_policy = d.moe.drop_position ? MoeConfig::DropPolicy::Position : MoeConfig::DropPolicy::Probs;
    mc.activation = d.gpt2() ? MoeConfig::Activation::Gelu : MoeConfig::Activation::Swiglu;
    mc.bias = d.gpt2();
    mc.hidden = d.moe.F;
    mc.shared_hidden = d.moe.shared_F;
    if (d.lora.on()) mc.lora_scale = d.lora.scale();
    const int ep = moe.ep ? moe.ep->size() : 1, etp = moe.expert_tp ? moe.expert_tp->size() : 1;
    MPIGPT_CHECK(ep == pl.ep && etp == pl.etp, "MoE groups ep {} expert_tp {} vs placement ep {} expert_tp {}", ep, etp,
                 pl.ep, pl.etp);
    if (moe.allgather && ep * etp > 1) {
      MPIGPT_CHECK(moe.expert_tp_ep && moe.expert_tp_ep->size() == ep * etp, "MoE allgather needs the expert_tp x ep group");
      dispatcher_ = std::make_unique<AllGatherDispatcher>(ops, moe.expert_tp_ep, mc.num_experts, moe.ep_of_member);
    } else if (moe.allgather) {
      dispatcher_ = std::make_unique<AllGatherDispatcher>(ops, nullptr, mc.num_experts);
    } else {
      dispatcher_ = std::make_unique<AllToAllDispatcher>(ops, moe.ep, mc.num_experts);
    }
    MPIGPT_CHECK(dispatcher_->first_expert() == pl.ep_rank * dispatcher_->num_local_experts(),
                 "MoE: the dispatcher's experts start at {}, the placement's ep rank {} holds {} from {}",
                 dispatcher_->first_expert(), pl.ep_rank, dispatcher_->num_local_experts(),
                 pl.ep_rank * dispatcher_->num_local_experts());
    // The ranks holding other tokens of the micro-batch: the tp shards of the sequence (SP) and
    // the cp shards. Without SP every tp rank holds the same tokens and must not be counted twice.
    const bool sp = tp_.sequence_parallel() && tp_.size() > 1, cp = cp_.size() > 1;
    MPIGPT_CHECK(!(sp && cp) || (moe.tp_cp && moe.tp_cp->size() == tp_.size() * cp_.size()),
                 "MoE under tp {} with sequence parallelism and cp {} needs the tp x cp group", tp_.size(), cp_.size());
    const Comm* group = sp && cp ? moe.tp_cp : sp ? tp_.group() : cp ? seq.cp : nullptr;
    moe_ = std::make_unique<MoeLayer>(mc, ops, d.C, dispatcher_.get(), group, etp > 1 ? moe.expert_tp : nullptr);
  }
  params_ = Buffer(ops, size_t(buffer_numel_) * 4);
  grads_ = Buffer(ops, size_t(grad_numel_) * 4);
  if (d.act != DType::F32) {
    MPIGPT_CHECK(d.act == DType::BF16, "GPT: activation dtype {} is not f32 or bf16", dtype_name(d.act));
    cparams_ = Buffer(ops, size_t(buffer_numel_) * dtype_size(d.act));
  }
  setup(pl);
}

GPT::~GPT() = default;

void GPT::setup(const ModelPlacement& pl) {
  setup_chunks(pl);
  setup_views(pl);
  setup_convert_ranges();
  setup_arena();
}

// The first parameter whose name starts with prefix (-1: none).
int GPT::index_of_prefix(const std::string& prefix) const {
  for (size_t i = 0; i < table_.size(); ++i)
    if (table_[i].name.rfind(prefix, 0) == 0) return int(i);
  return -1;
}

// Parameter index ranges: the table is embedding, layers in chunk order, head.
void GPT::setup_chunks(const ModelPlacement& pl) {
  std::vector<std::pair<int, int>> ranges = pl.chunks;
  if (ranges.empty()) ranges.push_back({0, d_.L});
  local_of_layer_.assign(d_.L, -1);
  const bool replica = !table_.empty() && table_[0].replica;
  const int n_embed = pl.first_stage ? (d_.gpt2() ? 2 : 1) : 0;
  embed_params_ = {0, n_embed};
  int next = n_embed + (replica ? 1 : 0);
  std::vector<std::vector<int>> kinds;
  for (size_t c = 0; c < ranges.size(); ++c) {
    Chunk ch;
    ch.first_layer = ranges[c].first;
    ch.end_layer = ranges[c].second;
    ch.embed = pl.first_stage && c == 0;
    ch.head = pl.last_stage && c + 1 == ranges.size();
    ch.first_param = ch.embed ? 0 : next;
    for (int l = ch.first_layer; l < ch.end_layer; ++l) {
      MPIGPT_CHECK(index_of_prefix("layers." + std::to_string(l) + ".") == next, "layer {} out of table order", l);
      local_of_layer_[l] = int(w_.size());
      w_.push_back(weights(compute_params(), l, d_.act));
      g_.push_back(weights(grads_, l, DType::F32));
      const std::string prefix = "layers." + std::to_string(l) + ".";
      int n = 0;
      while (next + n < int(table_.size()) && table_[next + n].name.rfind(prefix, 0) == 0) ++n;
      layer_params_.push_back({next, next + n});
      next += n;
    }
    ch.end_param = ch.head ? int(table_.size()) : next;
    const std::vector<int> kind = slot_kind(d_, ch.first_layer, ch.end_layer, ch.embed, ch.head);
    ch.pool = int(std::find(kinds.begin(), kinds.end(), kind) - kinds.begin());
    if (ch.pool == int(kinds.size())) kinds.push_back(kind);
    chunks_.push_back(std::move(ch));
  }
  pools_.resize(kinds.size());
  head_params_ = {next, pl.last_stage ? int(table_.size()) : next};
  MPIGPT_CHECK(pl.last_stage || next == int(table_.size()), "parameter table has {} entries, expected {}",
               table_.size(), next);
}

// The embedding's and the head's weights and gradients, on the stages that hold them.
void GPT::setup_views(const ModelPlacement& pl) {
  const bool g = d_.gpt2();
  if (pl.first_stage) {
    wte_ = view_of(compute_params(), table_[0].name, d_.act);
    dwte_ = grad(0);
    if (g) {
      wpe_ = view_of(compute_params(), "embedding.position.weight", d_.act);
      dwpe_ = view_of(grads_, "embedding.position.weight");
    }
  }
  if (pl.last_stage) {
    nfw_ = view_of(compute_params(), "final_norm.weight", d_.act);
    dnfw_ = view_of(grads_, "final_norm.weight");
    if (g) {
      nfb_ = view_of(compute_params(), "final_norm.bias", d_.act);
      dnfb_ = view_of(grads_, "final_norm.bias");
    }
    // Tied: the word embedding, or on a later stage its replica, is the head.
    const std::string head = d_.tied ? "embedding.word.weight" : "lm_head.weight";
    const int h = index_of_prefix(head);
    MPIGPT_CHECK(h >= 0 && table_[h].name == head, "no {} in the parameter table", head);
    head_ = view_of(compute_params(), head, d_.act);
    head_param_ = h;
    dhead_ = grad(h);
  }
}

// Each chunk's conversion ranges: its parameters (and the head) in buffer order, those that follow
// one another in the buffer (nothing but bucket padding between them) merged into one range.
void GPT::setup_convert_ranges() {
  std::vector<int> by_offset;  // non-empty entries in buffer order
  for (int i = 0; i < int(table_.size()); ++i)
    if (table_[i].numel() > 0) by_offset.push_back(i);
  std::sort(by_offset.begin(), by_offset.end(), [&](int a, int b) { return table_[a].offset < table_[b].offset; });
  std::vector<int> place(table_.size(), -1);
  for (int k = 0; k < int(by_offset.size()); ++k) place[by_offset[k]] = k;
  for (auto& ch : chunks_) {
    std::vector<int> mine;
    for (int i = ch.first_param; i < ch.end_param; ++i)
      if (place[i] >= 0) mine.push_back(place[i]);
    if (ch.head && (head_param_ < ch.first_param || head_param_ >= ch.end_param)) mine.push_back(place[head_param_]);
    std::sort(mine.begin(), mine.end());
    for (size_t k = 0; k < mine.size(); ++k) {
      const ParamInfo& p = table_[by_offset[mine[k]]];
      if (k > 0 && mine[k] == mine[k - 1] + 1)
        ch.convert.back().second = p.offset + p.numel();
      else
        ch.convert.push_back({p.offset, p.offset + p.numel()});
    }
  }
}

// Shared buffers: positions and the backward scratch (one backward runs at a time).
void GPT::setup_arena() {
  const bool g = d_.gpt2();
  const int64_t C = d_.C, HD = d_.HD(), Fl = d_.F / tp_.size();
  arena_.plan(&positions_, {N_}, DType::I32);
  arena_.plan(&dres_, {Nl_, C}, d_.act);
  arena_.plan(&dn_, {Nl_, C}, d_.act);
  arena_.plan(&full_, {N_, C}, d_.act);
  if (tp_.sequence_parallel()) arena_.plan(&gathered_, {N_, C}, d_.act);
  arena_.plan(&dqkv_, {N_, (nh_ + 2 * nkv_) * HD}, d_.act);
  arena_.plan(&datt_, {N_, nh_ * HD}, d_.act);
  arena_.plan(&dfc_, {N_, g ? Fl : 2 * Fl}, d_.act);
  // GELU's backward is fused into the projection's, unless a LoRA update joins the projection's input gradient.
  if (!g || d_.lora.adapts(kLoraFc2)) arena_.plan(&dact_, {N_, Fl}, d_.act);
  const LoraDims& lo = d_.lora;
  if (lo.on()) {
    const int64_t widest = std::max({d_.lora_width(kLoraQkv), d_.lora_width(kLoraProj), d_.lora_width(kLoraFc1),
                                     d_.lora_width(kLoraFc2)});
    arena_.plan(&dlora_, {N_, widest}, d_.act);
    lqkv_parts_ = {{nh_ * HD, nkv_ * HD, nkv_ * HD}, lo.part_blocks(kLoraQkv, 3)};
    lfc_parts_ = g ? LoraParts{{Fl}, {0}} : LoraParts{{Fl, Fl}, lo.part_blocks(kLoraFc1, 2)};
    if (lqkv_parts_.structured() || lfc_parts_.structured())  // never written: stays as allocated, zero
      arena_.plan(&lora_zeros_, {std::max({nh_ * HD, Fl, int64_t(d_.moe.F)}), lo.rank});
  }
  arena_.plan(&ce_max_, {N_});
  arena_.plan(&ce_sum_, {N_});
  arena_.plan(&ce_target_, {N_});
  arena_.commit();
  // Unless the micro-batch brings its own (masked_), positions restart at 0 in every row.
  std::vector<int32_t> pos(N_);
  for (int64_t i = 0; i < N_; ++i) pos[i] = int32_t(i % Tl_);
  ops_.copy(positions_, Tensor(pos.data(), {N_}, DType::I32));
  params_changed();
}

GPT::Slot* GPT::find(int c, int mb) const {
  for (const auto& s : pools_[size_t(chunks_[c].pool)])
    if (s->busy && s->chunk == c && s->mb == mb) return s.get();
  return nullptr;
}

GPT::Slot& GPT::acquire(int c, int mb) {
  if (Slot* s = find(c, mb)) return *s;
  Chunk& ch = chunks_[c];
  auto& pool = pools_[size_t(ch.pool)];
  for (auto& s : pool)
    if (!s->busy) {
      s->busy = true;
      s->chunk = c, s->mb = mb;
      return *s;
    }
  // A new set of activations: the schedule has one more micro-batch in flight here.
  auto s = std::make_unique<Slot>(ops_);
  const bool g = d_.gpt2(), sp = tp_.sequence_parallel();
  const int64_t C = d_.C;
  Arena& A = s->arena;
  if (ch.embed) A.plan(&s->tokens, {N_}, DType::I32);
  if (masked_) {
    A.plan(&s->positions, {N_}, DType::I32);
    A.plan(&s->pos_all, {cp_.size() * N_}, DType::I32);
    A.plan(&s->seg_all, {cp_.size() * N_}, DType::I32);
  }
  const int n = ch.end_layer - ch.first_layer;
  s->resid.resize(n + 1);
  for (auto& r : s->resid) A.plan(&r, {Nl_, C}, d_.act);
  const bool full = recompute_ == Recompute::Full;  // then the layers' inputs (resid) are all it keeps
  s->a.resize(full ? 0 : n);
  s->moe.resize(n);
  for (int i = 0; i < n && !full; ++i) {
    const bool moe = d_.is_moe(ch.first_layer + i);
    if (moe) s->moe[i] = std::make_unique<MoeActs>();
    plan_block(A, s->a[i], !moe, !recomputes_attention());
  }
  if (ch.head) {
    A.plan(&s->targets, {N_}, DType::I32);
    A.plan(&s->losses, {N_});
    A.plan(&s->xf, {Nl_, C}, d_.act);
    if (g) A.plan(&s->xf_mean, {Nl_});
    A.plan(&s->xf_rstd, {Nl_});
    if (sp) A.plan(&s->xf_full, {N_, C}, d_.act);
    A.plan(&s->logits, {N_, d_.Vp / tp_.size()}, d_.act);
  }
  A.commit();
  if (recomputes_attention())
    for (auto& a : s->a) a.att_saved = rc_acts_.att_saved;
  if (!sp) s->xf_full = s->xf;
  s->busy = true;
  s->chunk = c, s->mb = mb;
  pool.push_back(std::move(s));
  return *pool.back();
}

void GPT::release(int c, int mb) {
  if (Slot* s = find(c, mb)) {
    s->busy = false;
    s->have_grad_logits = false;
  }
}

// Which of a layer's saved activations A holds: the MLP's only for a dense layer (a MoE layer
// keeps its own in MoeActs), the attention state unless it is recomputed.
void GPT::plan_block(Arena& A, BlockActs& a, bool dense, bool att_saved) const {
  const bool g = d_.gpt2();
  const int64_t C = d_.C, HD = d_.HD(), Fl = d_.F / tp_.size();
  A.plan(&a.n1, {Nl_, C}, d_.act);
  if (g) A.plan(&a.n1_mean, {Nl_});
  A.plan(&a.n1_rstd, {Nl_});
  A.plan(&a.qkv, {N_, (nh_ + 2 * nkv_) * HD}, d_.act);
  if (att_saved) A.plan(&a.att_saved, {att_saved_numel()});
  A.plan(&a.att, {N_, nh_ * HD}, d_.act);
  A.plan(&a.mid, {Nl_, C}, d_.act);
  A.plan(&a.n2, {Nl_, C}, d_.act);
  if (g) A.plan(&a.n2_mean, {Nl_});
  A.plan(&a.n2_rstd, {Nl_});
  const LoraDims& lo = d_.lora;
  if (lo.adapts(kLoraQkv)) A.plan(&a.uqkv, {N_, d_.lora_width(kLoraQkv)}, d_.act);
  if (lo.adapts(kLoraProj)) A.plan(&a.uproj, {N_, lo.rank}, d_.act);
  if (!dense) return;
  A.plan(&a.fc, {N_, g ? Fl : 2 * Fl}, d_.act);
  A.plan(&a.act, {N_, Fl}, d_.act);
  if (lo.adapts(kLoraFc1)) A.plan(&a.ufc, {N_, d_.lora_width(kLoraFc1)}, d_.act);
  if (lo.adapts(kLoraFc2)) A.plan(&a.ufp, {N_, lo.rank}, d_.act);
}

// Masked attention keeps the log-sum-exp per query and head; the plain op what its backend needs.
int64_t GPT::att_saved_numel() const {
  return masked_ ? int64_t(B_) * nh_ * Tl_ : ops_.attention_saved_numel(B_, Tl_, nh_);
}

void GPT::set_recompute(Recompute r) {
  for (const auto& pool : pools_)
    MPIGPT_CHECK(pool.empty(), "set_recompute: activations are already allocated (call it before the first forward)");
  recompute_ = r;
  rc_arena_ = std::make_unique<Arena>(ops_);
  rc_acts_ = BlockActs{};
  if (r == Recompute::Full) {
    // One layer's worth, dense (a superset of a MoE layer's) unless every local layer is MoE.
    bool dense = false;
    for (const auto& ch : chunks_)
      for (int l = ch.first_layer; l < ch.end_layer; ++l) dense = dense || !d_.is_moe(l);
    plan_block(*rc_arena_, rc_acts_, dense, true);
    rc_arena_->plan(&rc_out_, {Nl_, d_.C}, d_.act);
  } else if (recomputes_attention()) {
    rc_arena_->plan(&rc_acts_.att_saved, {att_saved_numel()});
  }
  rc_arena_->commit();
}

GPT::BlockActs& GPT::acts(Slot& s, int i) { return recompute_ == Recompute::Full ? rc_acts_ : s.a[i]; }

MoeActs* GPT::moe_acts(Slot& s, int l, int i) {
  if (!d_.is_moe(l)) return nullptr;
  return recompute_ == Recompute::Full ? &rc_moe_ : s.moe[i].get();
}

size_t GPT::activation_bytes() const {
  size_t n = arena_.bytes() + (moe_ ? moe_->scratch_bytes() : 0);
  if (rc_arena_) n += rc_arena_->bytes() + rc_moe_.bytes();
  for (const auto& pool : pools_)
    for (const auto& s : pool) {
      n += s->arena.bytes();
      for (const auto& m : s->moe)
        if (m) n += m->bytes();  // the MoE layers' saved state (router, expert rows), sized per micro-batch
    }
  return n;
}

Tensor GPT::at(const Buffer& buf, int64_t offset, Shape shape, DType dt) const {
  return Tensor(static_cast<char*>(buf.data()) + offset * int64_t(dtype_size(dt)), shape, dt, ops_.device());
}

Tensor GPT::at(const Buffer& buf, const ParamInfo& p, DType dt) const { return at(buf, p.offset, p.shape, dt); }

Tensor GPT::view_of(const Buffer& buf, const std::string& name, DType dt) const {
  for (const auto& p : table_)
    if (p.name == name) return p.frozen && &buf == &grads_ ? Tensor() : at(buf, p, dt);  // frozen: no gradient
  return Tensor();  // not a parameter of this family (e.g. biases in Llama)
}

GPT::Block GPT::weights(const Buffer& buf, int l, DType dt) const {
  const std::string p = "layers." + std::to_string(l) + ".";
  auto v = [&](const std::string& n) { return view_of(buf, p + n, dt); };
  auto lora = [&](const std::string& layer) { return Lora{v(layer + ".lora_A.weight"), v(layer + ".lora_B.weight")}; };
  Block b{v("attn_norm.weight"), v("attn_norm.bias"), v("attn.qkv.weight"), v("attn.qkv.bias"),
          v("attn.proj.weight"), v("attn.proj.bias"), v("mlp_norm.weight"), v("mlp_norm.bias"),
          v("mlp.fc.weight"),    v("mlp.fc.bias"),    v("mlp.proj.weight"), v("mlp.proj.bias"),
          false,                 MoeWeights{},          lora("attn.qkv"),      lora("attn.proj"),
          lora("mlp.fc"),        lora("mlp.proj")};
  if (d_.is_moe(l)) {
    b.is_moe = true;
    MoeWeights& m = b.moe;
    // The router computes in f32 whatever the activations' dtype (MoeLayer::router_input): its
    // compute weight is the f32 master.
    m.router = dt == DType::F32 ? v(kRouter) : view_of(params_, p + kRouter);
    m.fc = v("mlp.experts.fc.weight");
    m.fc_bias = v("mlp.experts.fc.bias");
    m.proj = v("mlp.experts.proj.weight");
    m.proj_bias = v("mlp.experts.proj.bias");
    m.shared_fc = v("mlp.shared.fc.weight");
    m.shared_fc_bias = v("mlp.shared.fc.bias");
    m.shared_proj = v("mlp.shared.proj.weight");
    m.shared_proj_bias = v("mlp.shared.proj.bias");
    m.fc_lora_A = v("mlp.experts.fc.lora_A.weight");
    m.fc_lora_B = v("mlp.experts.fc.lora_B.weight");
    m.proj_lora_A = v("mlp.experts.proj.lora_A.weight");
    m.proj_lora_B = v("mlp.experts.proj.lora_B.weight");
    MPIGPT_CHECK(&buf == &grads_ || (m.router.ptr && m.fc.ptr && m.proj.ptr),  // frozen: no gradient views
                 "layer {} is a MoE layer but its parameters are missing", l);
  }
  return b;
}

Tensor GPT::param(int i) const { return at(params_, table_.at(i), DType::F32); }

Tensor GPT::grad(int i) const { return table_.at(i).frozen ? Tensor() : at(grads_, table_.at(i), DType::F32); }

Tensor GPT::logits() const {
  const Slot* s = find(num_chunks() - 1, 0);
  MPIGPT_CHECK(s && chunks_.back().head, "logits(): no forward of micro-batch 0 through the head");
  return s->logits;
}

void GPT::init_weights(uint64_t seed) {
  std::vector<float> host;
  for (size_t i = 0; i < table_.size(); ++i) {
    host.resize(table_[i].numel());
    init_param(table_[i], seed, host.data());
    ops_.copy(param(int(i)), Tensor(host.data(), table_[i].shape));
  }
  params_changed();
}

void GPT::params_changed() { stale_.assign(chunks_.size(), 1); }

Tensor GPT::compute_params_flat() const {
  MPIGPT_CHECK(d_.act != DType::F32, "compute_params_flat: computing in f32, the masters are the compute weights");
  return cparams_.tensor({buffer_numel_}, d_.act);
}

void GPT::convert_params(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  const Tensor to = compute_params_flat(), from = params_flat();
  for (const auto& [lo, hi] : ranges)
    if (lo < hi) ops_.copy(to.flat_slice(lo, hi - lo), from.flat_slice(lo, hi - lo));
}

void GPT::compute_params_gathered() { stale_.assign(chunks_.size(), 0); }

std::vector<std::pair<int64_t, int64_t>> GPT::master_reads() const {
  std::vector<std::pair<int64_t, int64_t>> r;
  if (d_.act == DType::F32) return r;
  for (const ParamInfo& p : table_)
    if (p.name.ends_with(std::string(".") + kRouter) && p.numel() > 0) r.push_back({p.offset, p.offset + p.numel()});
  return r;
}

// The chunk's parameters, and on the head's chunk the head (a tied replica sits outside the
// chunk's range), converted into the compute dtype: one conversion per range of the buffer
// (Chunk::convert), not one launch per parameter.
void GPT::refresh_compute_params(int c) {
  if (d_.act == DType::F32 || !stale_[c]) return;
  for (const auto& [lo, hi] : chunks_[c].convert)
    ops_.copy(at(cparams_, lo, {hi - lo}, d_.act), at(params_, lo, {hi - lo}, DType::F32));
  stale_[c] = 0;
}

void GPT::zero_grads() { ops_.fill(grads_flat(), 0.0f); }

}  // namespace mpigpt
