// GPT forward and backward over one micro-batch, for both families.
#include "lib/model/gpt.h"


namespace mpigpt {

GPT::GPT(const GptDims& d, Ops& ops, int B) : d_(d), ops_(ops), B_(B), arena_(ops) {
  MPIGPT_CHECK(d.C % d.NH == 0 && d.NH % d.NKV == 0, "C={} NH={} NKV={}", d.C, d.NH, d.NKV);
  MPIGPT_CHECK(d.Vp >= d.V && d.T <= d.maxT, "V={} Vp={} T={} maxT={}", d.V, d.Vp, d.T, d.maxT);
  table_ = build_param_table(d);
  num_params_ = table_.back().offset + table_.back().numel();
  params_ = Buffer(ops, size_t(num_params_) * 4);
  grads_ = Buffer(ops, size_t(num_params_) * 4);

  const bool g = d.gpt2();
  for (int l = 0; l < d.L; ++l) {
    w_.push_back(weights(params_, l));
    g_.push_back(weights(grads_, l));
  }
  wte_ = view_of(params_, "embedding.word.weight");
  dwte_ = view_of(grads_, "embedding.word.weight");
  if (g) {
    wpe_ = view_of(params_, "embedding.position.weight");
    dwpe_ = view_of(grads_, "embedding.position.weight");
    nfb_ = view_of(params_, "final_norm.bias");
    dnfb_ = view_of(grads_, "final_norm.bias");
  }
  nfw_ = view_of(params_, "final_norm.weight");
  dnfw_ = view_of(grads_, "final_norm.weight");
  head_ = d.tied ? wte_ : view_of(params_, "lm_head.weight");
  dhead_ = d.tied ? dwte_ : view_of(grads_, "lm_head.weight");

  // Activations: one arena for everything a step keeps alive.
  const int64_t N = int64_t(B) * d.T, C = d.C, F = d.F;
  arena_.plan(&tokens_, {N}, DType::I32);
  arena_.plan(&targets_, {N}, DType::I32);
  arena_.plan(&positions_, {N}, DType::I32);
  arena_.plan(&losses_, {N});
  resid_.resize(d.L + 1);
  for (auto& r : resid_) arena_.plan(&r, {N, C});
  a_.resize(d.L);
  for (auto& a : a_) {
    arena_.plan(&a.n1, {N, C});
    if (g) arena_.plan(&a.n1_mean, {N});
    arena_.plan(&a.n1_rstd, {N});
    arena_.plan(&a.qkv, {N, d.qkv_dim()});
    arena_.plan(&a.att_saved, {ops.attention_saved_numel(B, d.T, d.NH)});
    arena_.plan(&a.att, {N, int64_t(d.NH) * d.HD()});
    arena_.plan(&a.mid, {N, C});
    arena_.plan(&a.n2, {N, C});
    if (g) arena_.plan(&a.n2_mean, {N});
    arena_.plan(&a.n2_rstd, {N});
    arena_.plan(&a.fc, {N, g ? F : 2 * F});
    arena_.plan(&a.act, {N, F});
  }
  arena_.plan(&xf_, {N, C});
  if (g) arena_.plan(&xf_mean_, {N});
  arena_.plan(&xf_rstd_, {N});
  arena_.plan(&logits_, {N, d.Vp});
  arena_.plan(&dres_, {N, C});
  arena_.plan(&dn_, {N, C});
  arena_.plan(&dqkv_, {N, d.qkv_dim()});
  arena_.plan(&datt_, {N, int64_t(d.NH) * d.HD()});
  arena_.plan(&dfc_, {N, g ? F : 2 * F});
  arena_.plan(&dact_, {N, F});
  arena_.commit();

  // Without packing, positions restart at 0 in every row.
  std::vector<int32_t> pos(N);
  for (int64_t i = 0; i < N; ++i) pos[i] = int32_t(i % d.T);
  ops.copy(positions_, Tensor(pos.data(), {N}, DType::I32));
}

Tensor GPT::view_of(const Buffer& buf, const std::string& name) const {
  for (const auto& p : table_)
    if (p.name == name) return Tensor(static_cast<float*>(buf.data()) + p.offset, p.shape, DType::F32, ops_.device());
  return Tensor();  // not a parameter of this family (e.g. biases in Llama)
}

GPT::Block GPT::weights(const Buffer& buf, int l) const {
  const std::string p = "layers." + std::to_string(l) + ".";
  auto v = [&](const char* n) { return view_of(buf, p + n); };
  return Block{v("attn_norm.weight"), v("attn_norm.bias"), v("attn.qkv.weight"), v("attn.qkv.bias"),
               v("attn.proj.weight"), v("attn.proj.bias"), v("mlp_norm.weight"), v("mlp_norm.bias"),
               v("mlp.fc.weight"),    v("mlp.fc.bias"),    v("mlp.proj.weight"), v("mlp.proj.bias")};
}

Tensor GPT::param(int i) const {
  const auto& p = table_.at(i);
  return Tensor(static_cast<float*>(params_.data()) + p.offset, p.shape, DType::F32, ops_.device());
}

Tensor GPT::grad(int i) const {
  const auto& p = table_.at(i);
  return Tensor(static_cast<float*>(grads_.data()) + p.offset, p.shape, DType::F32, ops_.device());
}

void GPT::init_weights(uint64_t seed) {
  std::vector<float> host;
  for (size_t i = 0; i < table_.size(); ++i) {
    host.resize(table_[i].numel());
    init_param(table_[i], seed, host.data());
    ops_.copy(param(int(i)), Tensor(host.data(), table_[i].shape));
  }
}

void GPT::zero_grads() { ops_.fill(grads_flat(), 0.0f); }

void GPT::norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor w, Tensor b) {
  if (d_.gpt2())
    ops_.layernorm_forward(out, mean, rstd, inp, w, b, d_.eps);
  else
    ops_.rmsnorm_forward(out, rstd, inp, w, d_.eps);
}

void GPT::norm_backward(Tensor dinp, Tensor dw, Tensor db, Tensor dout, Tensor inp, Tensor mean, Tensor rstd,
                        Tensor w) {
  if (d_.gpt2())
    ops_.layernorm_backward(dinp, dw, db, dout, inp, mean, rstd, w);
  else
    ops_.rmsnorm_backward(dinp, dw, dout, inp, rstd, w);
}

double GPT::forward(const int32_t* tokens, const int32_t* targets, float dloss) {
  const int64_t N = int64_t(B_) * d_.T;
  ops_.copy(tokens_, Tensor(const_cast<int32_t*>(tokens), {N}, DType::I32));
  ops_.copy(targets_, Tensor(const_cast<int32_t*>(targets), {N}, DType::I32));
  ops_.embedding_forward(resid_[0], tokens_, positions_, wte_, wpe_, 0);
  for (int l = 0; l < d_.L; ++l) block_forward(l, resid_[l], resid_[l + 1]);
  norm_forward(xf_, xf_mean_, xf_rstd_, resid_[d_.L], nfw_, nfb_);
  ops_.linear_forward(logits_, xf_, head_, Tensor());
  have_grad_logits_ = dloss != 0.0f;
  ops_.crossentropy_forward_backward(losses_, have_grad_logits_ ? logits_ : Tensor(), logits_, targets_, d_.V,
                                     dloss);
  return ops_.sum(losses_);
}

void GPT::block_forward(int l, Tensor x_in, Tensor x_out) {
  const Block& w = w_[l];
  BlockActs& a = a_[l];
  auto as3 = [&](Tensor t) { return t.view({B_, d_.T, t.size(1)}); };
  norm_forward(a.n1, a.n1_mean, a.n1_rstd, x_in, w.n1w, w.n1b);
  ops_.linear_forward(a.qkv, a.n1, w.qkvw, w.qkvb);
  if (!d_.gpt2()) ops_.rope_forward(a.qkv, positions_, d_.NH, d_.NKV, d_.HD(), d_.rope_theta);
  ops_.attention_forward(as3(a.att), a.att_saved, as3(a.qkv), d_.NH, d_.NKV, d_.HD());
  ops_.linear_forward(a.mid, a.att, w.projw, w.projb);
  ops_.add(a.mid, a.mid, x_in);
  norm_forward(a.n2, a.n2_mean, a.n2_rstd, a.mid, w.n2w, w.n2b);
  ops_.linear_forward(a.fc, a.n2, w.fcw, w.fcb);
  if (d_.gpt2())
    ops_.gelu_forward(a.act, a.fc);
  else
    ops_.swiglu_forward(a.act, a.fc);
  ops_.linear_forward(x_out, a.act, w.fpw, w.fpb);
  ops_.add(x_out, x_out, a.mid);
}

void GPT::backward() {
  MPIGPT_CHECK(have_grad_logits_, "backward() needs a forward() with dloss != 0 before it");
  have_grad_logits_ = false;
  // logits_ now holds d(loss)/d(logits).
  ops_.linear_backward(dn_, dhead_, Tensor(), logits_, xf_, head_);
  ops_.fill(dres_, 0.0f);
  norm_backward(dres_, dnfw_, dnfb_, dn_, resid_[d_.L], xf_mean_, xf_rstd_, nfw_);
  for (int l = d_.L - 1; l >= 0; --l) block_backward(l, resid_[l], dres_);
  ops_.embedding_backward(dwte_, dwpe_, dres_, tokens_, positions_, 0);
}

// On entry dres = d(loss)/d(x_out); on exit d(loss)/d(x_in).
void GPT::block_backward(int l, Tensor x_in, Tensor dres) {
  const Block& w = w_[l];
  const Block& g = g_[l];
  BlockActs& a = a_[l];
  auto as3 = [&](Tensor t) { return t.view({B_, d_.T, t.size(1)}); };
  // x_out = mid + proj(act(fc(norm2(mid))))
  ops_.linear_backward(dact_, g.fpw, g.fpb, dres, a.act, w.fpw);
  if (d_.gpt2())
    ops_.gelu_backward(dfc_, dact_, a.fc);
  else
    ops_.swiglu_backward(dfc_, dact_, a.fc);
  ops_.linear_backward(dn_, g.fcw, g.fcb, dfc_, a.n2, w.fcw);
  norm_backward(dres, g.n2w, g.n2b, dn_, a.mid, a.n2_mean, a.n2_rstd, w.n2w);  // dres = d(mid)
  // mid = x_in + proj(attention(qkv(norm1(x_in))))
  ops_.linear_backward(datt_, g.projw, g.projb, dres, a.att, w.projw);
  ops_.attention_backward(as3(dqkv_), as3(datt_), as3(a.qkv), as3(a.att), a.att_saved, d_.NH, d_.NKV, d_.HD());
  if (!d_.gpt2()) ops_.rope_backward(dqkv_, positions_, d_.NH, d_.NKV, d_.HD(), d_.rope_theta);
  ops_.linear_backward(dn_, g.qkvw, g.qkvb, dqkv_, a.n1, w.qkvw);
  norm_backward(dres, g.n1w, g.n1b, dn_, x_in, a.n1_mean, a.n1_rstd, w.n1w);  // dres = d(x_in)
}

}  // namespace mpigpt
