// The ops' fronts (ops.h) of the layers: embedding, norms, activations, the loss, the optimizer and
// the mixture of experts' router and combine.
#include <algorithm>
#include <initializer_list>

#include "lib/kernels/op_checks.h"

namespace mpigpt {

// ---- embedding -----------------------------------------------------------------------------------

void Ops::embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                            int64_t vocab_start) {
  // out (N,C), tokens (N), positions (N, with wpe), wte (rows,C), wpe (maxT,C) optional
  OpArgs a(*this, "embedding_forward");
  a.data("out", out).i32("tokens", tokens).data("wte", wte).data_opt("wpe", wpe);
  const Mat mo = mat_of(out);
  a.require(tokens.numel() == mo.rows && mat_of(wte).cols == mo.cols, "out {}, tokens {}, wte {} disagree on N or C",
            out.shape.str(), tokens.shape.str(), wte.shape.str());
  if (wpe.defined())
    a.i32("positions (required with wpe)", positions)
        .require(positions.numel() == mo.rows && mat_of(wpe).cols == mo.cols, "out {}, positions {}, wpe {} disagree",
                 out.shape.str(), positions.shape.str(), wpe.shape.str());
  run("embedding_forward", [&] { embedding_forward_impl(out, tokens, positions, wte, wpe, vocab_start); });
}

void Ops::embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                             int64_t vocab_start) {
  OpArgs a(*this, "embedding_backward");
  a.data("dout", dout).f32_opt("dwte", dwte).f32_opt("dwpe", dwpe);
  const Mat mo = mat_of(dout);
  if (dwte.defined())
    a.i32("tokens", tokens)
        .require(tokens.numel() == mo.rows && mat_of(dwte).cols == mo.cols, "dout {}, tokens {}, dwte {} disagree",
                 dout.shape.str(), tokens.shape.str(), dwte.shape.str());
  if (dwpe.defined())
    a.i32("positions", positions)
        .require(positions.numel() == mo.rows && mat_of(dwpe).cols == mo.cols,
                 "dout {}, positions {}, dwpe {} disagree", dout.shape.str(), positions.shape.str(), dwpe.shape.str());
  run("embedding_backward", [&] { embedding_backward_impl(dwte, dwpe, dout, tokens, positions, vocab_start); });
}

// ---- normalisation -------------------------------------------------------------------------------

namespace {
// A norm over the C channels of inp (N,C): `like` tensors have its shape, `rows` its N rows (saved
// statistics, f32), `channels` its C (weights in the data dtype, or f32 gradients).
struct Named {
  const char* name;
  const Tensor& t;
};
void check_norm(OpArgs& a, const Tensor& inp, std::initializer_list<Named> like, std::initializer_list<Named> rows,
                std::initializer_list<Named> channels) {
  const Mat m = mat_of(inp);
  for (const Named& n : like) a.like(n.name, n.t, "inp", inp);
  for (const Named& n : rows) a.f32_opt(n.name, n.t).len(n.name, n.t, m.rows, "N");
  for (const Named& n : channels) a.len(n.name, n.t, m.cols, "C");
}
}  // namespace

void Ops::layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight, Tensor bias, float eps) {
  OpArgs a(*this, "layernorm_forward");
  a.data("out", out).data("inp", inp).data("weight", weight).data_opt("bias", bias);
  check_norm(a, inp, {{"out", out}}, {{"mean", mean}, {"rstd", rstd}}, {{"weight", weight}, {"bias", bias}});
  run("layernorm_forward", [&] { layernorm_forward_impl(out, mean, rstd, inp, weight, bias, eps); });
}

void Ops::layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                             Tensor rstd, Tensor weight) {
  OpArgs a(*this, "layernorm_backward");
  a.data("dout", dout).data("inp", inp).data("weight", weight).data_opt("dinp", dinp);
  a.f32("mean", mean).f32("rstd", rstd).f32_opt("dweight", dweight).f32_opt("dbias", dbias);
  check_norm(a, inp, {{"dout", dout}, {"dinp", dinp}}, {{"mean", mean}, {"rstd", rstd}},
             {{"weight", weight}, {"dweight", dweight}, {"dbias", dbias}});
  run("layernorm_backward", [&] { layernorm_backward_impl(dinp, dweight, dbias, dout, inp, mean, rstd, weight); });
}

void Ops::rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) {
  OpArgs a(*this, "rmsnorm_forward");
  a.data("out", out).data("inp", inp).data("weight", weight);
  check_norm(a, inp, {{"out", out}}, {{"rstd", rstd}}, {{"weight", weight}});
  run("rmsnorm_forward", [&] { rmsnorm_forward_impl(out, rstd, inp, weight, eps); });
}

void Ops::rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor rstd, Tensor weight) {
  OpArgs a(*this, "rmsnorm_backward");
  a.data("dout", dout).data("inp", inp).data("weight", weight).data_opt("dinp", dinp).f32("rstd", rstd);
  a.f32_opt("dweight", dweight);
  check_norm(a, inp, {{"dout", dout}, {"dinp", dinp}}, {{"rstd", rstd}}, {{"weight", weight}, {"dweight", dweight}});
  run("rmsnorm_backward", [&] { rmsnorm_backward_impl(dinp, dweight, dout, inp, rstd, weight); });
}

void Ops::residual_layernorm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                     Tensor weight, Tensor bias, float eps) {
  OpArgs c(*this, "residual_layernorm_forward");
  c.data("sum", sum).data("out", out).data("a", a).data("b", b).data("weight", weight).data_opt("bias", bias);
  check_norm(c, a, {{"sum", sum}, {"out", out}, {"b", b}}, {{"mean", mean}, {"rstd", rstd}},
             {{"weight", weight}, {"bias", bias}});
  run("residual_layernorm_forward",
      [&] { residual_layernorm_forward_impl(sum, out, mean, rstd, a, b, weight, bias, eps); });
}

void Ops::residual_rmsnorm_forward(Tensor sum, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                   float eps) {
  OpArgs c(*this, "residual_rmsnorm_forward");
  c.data("sum", sum).data("out", out).data("a", a).data("b", b).data("weight", weight);
  check_norm(c, a, {{"sum", sum}, {"out", out}, {"b", b}}, {{"rstd", rstd}}, {{"weight", weight}});
  run("residual_rmsnorm_forward", [&] { residual_rmsnorm_forward_impl(sum, out, rstd, a, b, weight, eps); });
}

// ---- activations ---------------------------------------------------------------------------------

void Ops::gelu_forward(Tensor out, Tensor inp) {
  OpArgs(*this, "gelu_forward")
      .data("out", out)
      .data("inp", inp)
      .require(out.numel() == inp.numel(), "out {} and inp {} differ", out.shape.str(), inp.shape.str());
  run("gelu_forward", [&] { gelu_forward_impl(out, inp); });
}

void Ops::gelu_backward(Tensor dinp, Tensor dout, Tensor inp) {
  OpArgs(*this, "gelu_backward")
      .data("dinp", dinp)
      .data("dout", dout)
      .data("inp", inp)
      .require(dinp.numel() == inp.numel() && dout.numel() == inp.numel(), "dinp {}, dout {}, inp {} differ",
               dinp.shape.str(), dout.shape.str(), inp.shape.str());
  run("gelu_backward", [&] { gelu_backward_impl(dinp, dout, inp); });
}

namespace {
// Rows of full (N, 2F) are [gate (F) | up (F)] for half (N, F).
void check_swiglu(OpArgs& a, const char* half_name, const Tensor& half, const Tensor& full) {
  const Mat mh = mat_of(half), mf = mat_of(full);
  a.require(mf.rows == mh.rows && mf.cols == 2 * mh.cols, "inp {} must be (N, 2F) for {} {} (N, F)",
            full.shape.str(), half_name, half.shape.str());
}
}  // namespace

void Ops::swiglu_forward(Tensor out, Tensor inp) {
  OpArgs a(*this, "swiglu_forward");
  a.data("out", out).data("inp", inp);
  check_swiglu(a, "out", out, inp);
  run("swiglu_forward", [&] { swiglu_forward_impl(out, inp); });
}

void Ops::swiglu_backward(Tensor dinp, Tensor dout, Tensor inp) {
  OpArgs a(*this, "swiglu_backward");
  a.data("dinp", dinp).data("dout", dout).data("inp", inp);
  check_swiglu(a, "dout", dout, inp);
  a.require(dinp.numel() == inp.numel(), "dinp {} must have the shape of inp {}", dinp.shape.str(), inp.shape.str());
  run("swiglu_backward", [&] { swiglu_backward_impl(dinp, dout, inp); });
}

// ---- loss ----------------------------------------------------------------------------------------

void Ops::crossentropy_forward_backward(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets, int64_t V,
                                        float dloss) {
  // losses (N), dlogits (N,Vp) (may alias logits), logits (N,Vp), targets (N); softmax over [0, V)
  OpArgs a(*this, "crossentropy_forward_backward");
  a.data("logits", logits).data_opt("dlogits", dlogits).i32("targets", targets).f32_opt("losses", losses);
  const Mat mx = mat_of(logits);
  a.require(V > 0 && V <= mx.cols, "V = {} must be in [1, Vp = {}] (logits {})", V, mx.cols, logits.shape.str())
      .len("targets", targets, mx.rows, "N")
      .len("losses", losses, mx.rows, "N")
      .like("dlogits", dlogits, "logits", logits);
  run("crossentropy_forward_backward",
      [&] { crossentropy_forward_backward_impl(losses, dlogits, logits, targets, V, dloss); });
}

namespace {
// One rank's slice of the vocabulary, logits (N,Vl) from global column vocab_start on, and its
// per-row (N) f32 tensors.
void check_shard(OpArgs& a, const Tensor& logits, int64_t vocab_start, int64_t V, std::initializer_list<Named> rows) {
  a.data("logits", logits)
      .require(V > 0, "V = {} must be positive", V)
      .require(vocab_start >= 0, "vocab_start = {} must not be negative", vocab_start);
  for (const Named& n : rows) a.f32(n.name, n.t).len(n.name, n.t, mat_of(logits).rows, "N");
}
}  // namespace

void Ops::softmax_shard_max(Tensor maxes, Tensor logits, int64_t vocab_start, int64_t V) {
  OpArgs a(*this, "softmax_shard_max");
  check_shard(a, logits, vocab_start, V, {{"maxes", maxes}});
  run("softmax_shard_max", [&] { softmax_shard_max_impl(maxes, logits, vocab_start, V); });
}

void Ops::softmax_shard_sums(Tensor sumexp, Tensor target_logit, Tensor logits, Tensor maxes, Tensor targets,
                             int64_t vocab_start, int64_t V) {
  OpArgs a(*this, "softmax_shard_sums");
  check_shard(a, logits, vocab_start, V, {{"sumexp", sumexp}, {"target_logit", target_logit}, {"maxes", maxes}});
  a.i32("targets", targets).len("targets", targets, mat_of(logits).rows, "N");
  run("softmax_shard_sums",
      [&] { softmax_shard_sums_impl(sumexp, target_logit, logits, maxes, targets, vocab_start, V); });
}

void Ops::crossentropy_shard_finish(Tensor losses, Tensor dlogits, Tensor logits, Tensor maxes, Tensor sumexp,
                                    Tensor target_logit, Tensor targets, int64_t vocab_start, int64_t V,
                                    float dloss) {
  OpArgs a(*this, "crossentropy_shard_finish");
  check_shard(a, logits, vocab_start, V, {{"maxes", maxes}, {"sumexp", sumexp}, {"target_logit", target_logit}});
  const int64_t N = mat_of(logits).rows;
  a.i32("targets", targets).len("targets", targets, N, "N").f32_opt("losses", losses).len("losses", losses, N, "N");
  a.data_opt("dlogits", dlogits).like("dlogits", dlogits, "logits", logits);
  run("crossentropy_shard_finish", [&] {
    crossentropy_shard_finish_impl(losses, dlogits, logits, maxes, sumexp, target_logit, targets, vocab_start, V,
                                   dloss);
  });
}

// ---- optimizer -----------------------------------------------------------------------------------

void Ops::adamw(Tensor param, Tensor grad, Tensor m, Tensor v, float lr, float beta1, float beta2, float eps,
                float weight_decay, int64_t step, float grad_scale) {
  OpArgs(*this, "adamw")
      .f32("param", param)
      .f32("grad", grad)
      .f32("m", m)
      .f32("v", v)
      .require(grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(),
               "param {}, grad {}, m {}, v {} must have equal lengths", param.str(), grad.str(), m.str(), v.str())
      .require(step >= 1, "step must be >= 1 (bias correction), got {}", step);
  run("adamw", [&] { adamw_impl(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale); });
}

void Ops::adamw_runs(Tensor param, Tensor grad, Tensor m, Tensor v, const std::vector<AdamWRun>& runs, float lr,
                     float beta1, float beta2, float eps, int64_t step, float grad_scale) {
  // param and grad of one length, m and v of another; every run inside them, of non-negative length,
  // and no two runs sharing a parameter or a moment element.
  OpArgs a(*this, "adamw_runs");
  a.f32("param", param).f32("grad", grad).f32("m", m).f32("v", v);
  a.require(grad.numel() == param.numel() && v.numel() == m.numel(),
            "param {} and grad {} must have the same length, and m {} and v {}", param.str(), grad.str(), m.str(),
            v.str());
  a.require(step >= 1, "step must be >= 1 (bias correction), got {}", step);
  std::vector<std::pair<int64_t, int64_t>> p, s;
  for (const AdamWRun& r : runs) {
    a.require(r.count >= 0 && r.begin >= 0 && r.state >= 0 && r.begin + r.count <= param.numel() &&
                  r.state + r.count <= m.numel(),
              "run of {} elements at {} (state {}) lies outside param {} or m {}", r.count, r.begin, r.state,
              param.str(), m.str());
    if (r.count == 0) continue;
    p.emplace_back(r.begin, r.begin + r.count);
    s.emplace_back(r.state, r.state + r.count);
  }
  for (auto* ranges : {&p, &s}) {
    std::sort(ranges->begin(), ranges->end());
    for (size_t i = 1; i < ranges->size(); ++i)
      a.require((*ranges)[i - 1].second <= (*ranges)[i].first, "runs overlap at [{}, {}) and [{}, {}) of {}",
                (*ranges)[i - 1].first, (*ranges)[i - 1].second, (*ranges)[i].first, (*ranges)[i].second,
                ranges == &p ? "param" : "m");
  }
  run("adamw", [&] { adamw_runs_impl(param, grad, m, v, runs, lr, beta1, beta2, eps, step, grad_scale); });
}

double Ops::sum_squares(Tensor t) {
  OpArgs(*this, "sum_squares").data("t", t);
  return run("sum_squares", [&] { return sum_squares_impl(t); });
}

double Ops::sum(Tensor t) {
  OpArgs(*this, "sum").data("t", t);
  return run("sum", [&] { return sum_impl(t); });
}

// ---- mixture of experts --------------------------------------------------------------------------

namespace {
// logits (N,E) in the data dtype, probs (N,E) f32, topk (N,K) i32 and gates (N,K) f32 with
// 1 <= K <= E, lse (N) f32 optional.
void check_router(OpArgs& a, const Tensor& probs, const Tensor& topk, const char* gates_name, const Tensor& gates,
                  const char* lse_name, const Tensor& lse, const Tensor& logits) {
  a.data("logits", logits).f32("probs", probs).i32("topk", topk).f32(gates_name, gates).f32_opt(lse_name, lse);
  const Mat ml = mat_of(logits), mp = mat_of(probs), mt = mat_of(topk), mg = mat_of(gates);
  a.require(mp.rows == ml.rows && mp.cols == ml.cols, "probs {} must match logits {} (N,E)", probs.shape.str(),
            logits.shape.str());
  a.require(mt.rows == ml.rows && mg.rows == ml.rows && mt.cols == mg.cols && mt.cols >= 1 && mt.cols <= ml.cols,
            "topk {} and {} {} must be (N,K) with 1 <= K <= E for logits {}", topk.shape.str(), gates_name,
            gates.shape.str(), logits.shape.str());
  a.len(lse_name, lse, ml.rows, "N");
}
// out (N,C), rows (M,C), slot (M) i32, gates (N,K) f32.
void check_combine(OpArgs& a, const char* out_name, const Tensor& out, const Tensor& rows, const Tensor& slot,
                   const Tensor& gates) {
  a.i32("slot", slot).f32("gates", gates);
  const Mat mo = mat_of(out), mr = mat_of(rows), mg = mat_of(gates);
  a.require(mo.cols == mr.cols && slot.numel() == mr.rows && mg.rows == mo.rows,
            "{} {} (N,C), rows {} (M,C), slot {} (M), gates {} (N,K) do not fit", out_name, out.shape.str(),
            rows.shape.str(), slot.shape.str(), gates.shape.str());
}
}  // namespace

void Ops::moe_router_forward(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                             bool normalize) {
  OpArgs a(*this, "moe_router_forward");
  check_router(a, probs, topk, "gates", gates, "lse", lse, logits);
  run("moe_router_forward", [&] { moe_router_forward_impl(probs, topk, gates, lse, logits, sigmoid, normalize); });
}

void Ops::moe_router_backward(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits, Tensor probs,
                              Tensor topk, bool sigmoid, bool normalize) {
  OpArgs a(*this, "moe_router_backward");
  check_router(a, probs, topk, "dgates", dgates, "dlse", dlse, logits);
  a.data("dlogits", dlogits).f32_opt("dprobs", dprobs);
  const Mat ml = mat_of(logits);
  a.require(mat_of(dlogits).rows == ml.rows && mat_of(dlogits).cols == ml.cols, "dlogits {} must match logits {}",
            dlogits.shape.str(), logits.shape.str());
  a.require(!dprobs.defined() || dprobs.numel() == logits.numel(), "dprobs {} must match logits {}",
            dprobs.shape.str(), logits.shape.str());
  run("moe_router_backward", [&] {
    moe_router_backward_impl(dlogits, dgates, dprobs, dlse, logits, probs, topk, sigmoid, normalize);
  });
}

void Ops::moe_combine(Tensor out, Tensor rows, Tensor slot, Tensor gates) {
  OpArgs a(*this, "moe_combine");
  a.data("out", out).data("rows", rows);
  check_combine(a, "out", out, rows, slot, gates);
  run("moe_combine", [&] { moe_combine_impl(out, rows, slot, gates); });
}

void Ops::moe_combine_backward(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot, Tensor gates) {
  OpArgs a(*this, "moe_combine_backward");
  a.data("dout", dout).data_opt("drows", drows).data_opt("rows", rows).f32_opt("dgates", dgates);
  a.require(drows.defined() || rows.defined(), "drows or rows is required");
  check_combine(a, "dout", dout, drows.defined() ? drows : rows, slot, gates);
  a.require(!dgates.defined() || (rows.defined() && dgates.numel() == gates.numel() &&
                                  rows.numel() == slot.numel() * mat_of(dout).cols),
            "dgates {} needs rows (M,C) and the shape of gates {}", dgates.shape.str(), gates.shape.str());
  run("moe_combine_backward", [&] { moe_combine_backward_impl(drows, dgates, dout, rows, slot, gates); });
}

}  // namespace mpigpt
