// The compute of a step per rank, op by op in the profile's units, following lib/model's forward
// and backward (gpt_compute.cpp): which GEMMs run at which shape under tp, cp, sp and MoE.
#include "lib/plan/step_work.h"

#include "parallel/schedule.h"

namespace mpigpt {

void Work::gemm(int64_t m, int64_t n, int64_t k, double count) {
  if (m <= 0 || n <= 0 || k <= 0 || count <= 0) return;
  for (GemmCall& g : gemms)
    if (g.m == m && g.n == n && g.k == k) {
      g.count += count;
      return;
    }
  gemms.push_back({m, n, k, count});
}

void Work::gemm_backward(int64_t m, int64_t n, int64_t k, double count) {
  gemm(m, k, n, count);  // dX (m,k) = dY (m,n) @ W (n,k)
  gemm(n, k, m, count);  // dW (n,k) = dY^T (n,m) @ X (m,k)
}

void Work::add(const Work& w, double times) {
  for (const GemmCall& g : w.gemms) gemm(g.m, g.n, g.k, g.count * times);
  elementwise += w.elementwise * times;
  attention_fwd += w.attention_fwd * times;
  attention_bwd += w.attention_bwd * times;
  scores_fwd += w.scores_fwd * times;
  scores_bwd += w.scores_bwd * times;
  masked = masked || w.masked;
  crossentropy += w.crossentropy * times;
  optimizer += w.optimizer * times;
  grad_zero += w.grad_zero * times;
}

double Work::gemm_flops() const {
  double f = 0;
  for (const GemmCall& g : gemms) f += 2.0 * double(g.m) * double(g.n) * double(g.k) * g.count;
  return f;
}

double Work::gemm_seconds(const DeviceProfile& p) const {
  double s = 0;
  for (const GemmCall& g : gemms) s += p.gemm_seconds(g.m, g.n, g.k) * g.count;
  return s;
}

double Work::attention_seconds(const DeviceProfile& p) const {
  const OpRates& r = p.ops;
  const bool blockwise = masked && r.masked_attention_fwd > 0;  // else the profile did not time it apart
  return attention_fwd * (blockwise ? r.masked_attention_fwd : r.attention_fwd) +
         attention_bwd * (blockwise ? r.masked_attention_bwd : r.attention_bwd) + scores_fwd * r.attention_scores_fwd +
         scores_bwd * r.attention_scores_bwd;
}

double Work::other_seconds(const DeviceProfile& p) const {
  const OpRates& r = p.ops;
  return elementwise * r.elementwise + attention_seconds(p) + crossentropy * r.crossentropy +
         optimizer * r.optimizer + grad_zero * r.grad_zero;
}

namespace {

// One rank's sizes (as lib/model/gpt.cpp derives them).
struct LocalShape {
  int64_t B, T, Tl, N, Nl, C, HD, nh, nkv, Fl, Vl, tp;
  bool gpt2, masked, full, selective;
};

LocalShape shape_of(const Config& cfg, const GptDims& d) {
  const ParallelConfig& p = cfg.parallel;
  LocalShape s{};
  s.B = cfg.training.micro_batch, s.T = d.T, s.Tl = d.T / p.cp, s.N = s.B * s.Tl, s.tp = p.tp;
  s.Nl = p.sequence_parallel && p.tp > 1 ? s.N / p.tp : s.N;
  s.C = d.C, s.HD = d.HD(), s.nh = d.NH / p.tp, s.nkv = d.NKV / p.tp, s.Fl = d.F / p.tp, s.Vl = d.Vp / p.tp;
  s.gpt2 = d.gpt2();
  s.masked = p.cp > 1 || cfg.engine.sequence_packing;
  s.full = cfg.engine.recompute == "full";
  s.selective = cfg.engine.recompute == "selective";
  return s;
}

// Causal attention forward FLOPs: QK^T and PV over the key positions each query sees (half of all
// T keys on average, also for a context-parallel rank's T/cp queries with load balancing).
double attention_flops(const LocalShape& s) { return 4.0 * double(s.B * s.nh * s.HD) * double(s.Tl) * double(s.T) / 2; }

// The MoE MLP of one layer under balanced routing: each ep rank's experts get N*K rows in all.
void moe_forward(Work& w, const LocalShape& s, const GptDims& d, const ParallelConfig& p) {
  const MoeDims& m = d.moe;
  const int64_t experts = m.E / p.ep, rows = s.N * m.K * p.ep * p.expert_tp / m.E, Fe = m.F / p.expert_tp;
  w.gemm(s.N, m.E, s.C);  // router
  w.gemm(rows, s.gpt2 ? Fe : 2 * Fe, s.C, double(experts));
  w.gemm(rows, s.C, Fe, double(experts));
  w.elementwise += double(rows * experts * Fe) + double(s.N * m.K * s.C);  // activation, combine
  if (m.shared_F > 0) {
    const int64_t sF = m.shared_F / p.tp;
    w.gemm(s.N, s.gpt2 ? sF : 2 * sF, s.C);
    w.gemm(s.N, s.C, sF);
  }
}

// LoRA's GEMMs in one layer (lib/model/lora.h): per adapted layer u = x A^T and out += u B^T, the
// fused layers' A as wide as their adapters (LoraDims::width); a MoE layer's per routed expert.
Work lora_forward(const LocalShape& s, const GptDims& d, const ParallelConfig& p, int l) {
  Work w;
  const LoraDims& lo = d.lora;
  auto adapter = [&](int64_t rows, int64_t in, int64_t out, int64_t width, double count) {
    w.gemm(rows, width, in, count);
    w.gemm(rows, out, width, count);
  };
  if (lo.adapts(kLoraQkv)) adapter(s.N, s.C, (s.nh + 2 * s.nkv) * s.HD, d.lora_width(kLoraQkv), 1);
  if (lo.adapts(kLoraProj)) adapter(s.N, s.nh * s.HD, s.C, lo.rank, 1);
  const int64_t fc_width = d.lora_width(kLoraFc1);
  if (d.is_moe(l)) {
    const MoeDims& m = d.moe;
    const int64_t experts = m.E / p.ep, rows = s.N * m.K * p.ep * p.expert_tp / m.E, Fe = m.F / p.expert_tp;
    if (lo.adapts(kLoraFc1)) adapter(rows, s.C, s.gpt2 ? Fe : 2 * Fe, fc_width, double(experts));
    if (lo.adapts(kLoraFc2)) adapter(rows, Fe, s.C, lo.rank, double(experts));
  } else {
    if (lo.adapts(kLoraFc1)) adapter(s.N, s.C, s.gpt2 ? s.Fl : 2 * s.Fl, fc_width, 1);
    if (lo.adapts(kLoraFc2)) adapter(s.N, s.Fl, s.C, lo.rank, 1);
  }
  return w;
}

// The layer's own GEMMs and ops (LoRA's apart).
Work base_forward(const LocalShape& s, const GptDims& d, const ParallelConfig& p, int l) {
  Work w;
  w.gemm(s.N, (s.nh + 2 * s.nkv) * s.HD, s.C);  // QKV (the input gathered over tp with sp)
  w.attention_fwd += attention_flops(s);
  w.masked = s.masked;
  w.scores_fwd += double(s.B * s.nh) * double(s.Tl) * double(s.T);
  w.gemm(s.N, s.C, s.nh * s.HD);  // attention projection
  w.elementwise += double(2 * s.Nl * s.C);  // two norms and residuals
  if (d.is_moe(l)) {
    moe_forward(w, s, d, p);
  } else {
    w.gemm(s.N, s.gpt2 ? s.Fl : 2 * s.Fl, s.C);
    w.gemm(s.N, s.C, s.Fl);
    w.elementwise += double(s.N * s.Fl);  // GELU / SwiGLU
  }
  return w;
}

Work layer_forward(const LocalShape& s, const GptDims& d, const ParallelConfig& p, int l) {
  Work w = base_forward(s, d, p, l);
  w.add(lora_forward(s, d, p, l));
  return w;
}

// Under LoRA the layer's weights are frozen: their GEMMs' backward computes the input gradient
// only; the adapters' both.
Work layer_backward(const LocalShape& s, const GptDims& d, const ParallelConfig& p, int l) {
  const Work f = layer_forward(s, d, p, l);
  Work w;
  for (const GemmCall& g : base_forward(s, d, p, l).gemms)
    if (d.lora.on()) w.gemm(g.m, g.k, g.n, g.count);  // dX (m,k) = dY (m,n) @ W (n,k)
    else w.gemm_backward(g.m, g.n, g.k, g.count);
  for (const GemmCall& g : lora_forward(s, d, p, l).gemms) w.gemm_backward(g.m, g.n, g.k, g.count);
  w.attention_bwd = 2 * f.attention_fwd;
  w.masked = f.masked;
  w.scores_bwd = f.scores_fwd;
  w.elementwise = 2 * f.elementwise;
  if (s.full) w.add(f);  // the layer's forward again
  else if (s.selective && !s.masked) w.attention_fwd += f.attention_fwd, w.scores_fwd += f.scores_fwd;  // the core again
  return w;
}

}  // namespace

Work forward_work(const Config& cfg, const GptDims& d, int first, int end, bool embedding, bool head) {
  const LocalShape s = shape_of(cfg, d);
  Work w;
  if (embedding) w.elementwise += double(s.N * s.C);
  for (int l = first; l < end; ++l) w.add(layer_forward(s, d, cfg.parallel, l));
  if (head) {
    w.elementwise += double(s.Nl * s.C);  // final norm
    w.gemm(s.N, s.Vl, s.C);               // logits
    w.crossentropy += double(s.N * s.Vl);  // loss and its gradient, in the forward
  }
  return w;
}

Work backward_work(const Config& cfg, const GptDims& d, int first, int end, bool embedding, bool head) {
  const LocalShape s = shape_of(cfg, d);
  Work w;
  if (head) {  // the logits' input gradient, and their weight's gradient unless it is frozen (LoRA)
    if (d.lora.on()) w.gemm(s.N, s.C, s.Vl);
    else w.gemm_backward(s.N, s.Vl, s.C);
    w.elementwise += double(2 * s.Nl * s.C);
  }
  for (int l = first; l < end; ++l) w.add(layer_backward(s, d, cfg.parallel, l));
  if (embedding) w.elementwise += double(2 * s.N * s.C);
  return w;
}

Work step_work(const Config& cfg, const GptDims& d, int pp_rank, int micro_batches, double held, double owned) {
  const ParallelConfig& p = cfg.parallel;
  const auto chunks = layers_of_stage(pipeline_layers(p, d.L), p.pp, pp_rank);
  Work w;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const bool embed = pp_rank == 0 && c == 0, head = pp_rank == p.pp - 1 && c + 1 == chunks.size();
    w.add(forward_work(cfg, d, chunks[c].first, chunks[c].second, embed, head), micro_batches);
    w.add(backward_work(cfg, d, chunks[c].first, chunks[c].second, embed, head), micro_batches);
  }
  w.optimizer += owned;
  w.grad_zero += held;
  return w;
}

}  // namespace mpigpt
