// GPT forward and backward per model chunk and micro-batch, for both families, with tensor
// and sequence parallelism through the TensorParallel pairs.
#include "lib/model/gpt.h"
#include "lib/model/lora.h"

namespace mpigpt {

void GPT::norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor w, Tensor b) {
  if (d_.gpt2())
    ops_.layernorm_forward(out, mean, rstd, inp, w, b, d_.eps);
  else
    ops_.rmsnorm_forward(out, rstd, inp, w, d_.eps);
}

void GPT::residual_norm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b, Tensor w,
                                Tensor bias) {
  if (d_.gpt2())
    ops_.residual_layernorm_forward(sum, out, mean, rstd, a, b, w, bias, d_.eps);
  else
    ops_.residual_rmsnorm_forward(sum, out, rstd, a, b, w, d_.eps);
}

void GPT::norm_backward(Tensor dinp, Tensor dw, Tensor db, Tensor dout, Tensor inp, Tensor mean, Tensor rstd,
                        Tensor w) {
  if (d_.gpt2())
    ops_.layernorm_backward(dinp, dw, db, dout, inp, mean, rstd, w);
  else
    ops_.rmsnorm_backward(dinp, dw, dout, inp, rstd, w);
}

Tensor GPT::positions(const Slot& s) const { return masked_ ? s.positions : positions_; }

Tensor GPT::chunk_input(int c, int mb) {
  MPIGPT_CHECK(!chunks_[c].embed, "chunk {} starts with the embedding; it takes tokens, not activations", c);
  return acquire(c, mb).resid[0];
}

Tensor GPT::chunk_output(int c, int mb) const {
  const Slot* s = find(c, mb);
  MPIGPT_CHECK(s && !chunks_[c].head, "chunk_output({}, {}): no such forward in flight", c, mb);
  return s->resid.back();
}

double GPT::forward_chunk(int c, int mb, const MicroBatchInput& in, float dloss) {
  const Chunk& ch = chunks_[c];
  refresh_compute_params(c);
  Slot& s = acquire(c, mb);
  if (masked_) {
    MPIGPT_CHECK(in.pos && in.seg, "forward_chunk({}, {}): a split or packed sequence needs pos and seg", c, mb);
    const int64_t n = cp_.size() * N_;
    ops_.copy(s.pos_all, Tensor(const_cast<int32_t*>(in.pos), {n}, DType::I32));
    ops_.copy(s.seg_all, Tensor(const_cast<int32_t*>(in.seg), {n}, DType::I32));
    ops_.copy(s.positions, s.pos_all.flat_slice(cp_.rank() * N_, N_));
  }
  if (ch.embed) {
    // A vocabulary-parallel lookup: each tp rank adds the rows of its vocabulary shard (and
    // rank 0 the positions), the row-parallel reduction completes the sum.
    ops_.copy(s.tokens, Tensor(const_cast<int32_t*>(in.tokens), {N_}, DType::I32));
    Tensor x0 = tp_.row_output_target(s.resid[0], full_);
    ops_.embedding_forward(x0, s.tokens, positions(s), wte_, tp_.rank() == 0 ? wpe_ : Tensor(),
                           int64_t(tp_.rank()) * wte_.size(0));
    tp_.row_output_forward(s.resid[0], x0);
  }
  if (moe_) {  // the micro-batch index of each local row: the cp index (or 0..N-1), then the SP shard
    s.moe_index.resize(size_t(Nl_));
    const int64_t first = tp_.sequence_parallel() ? int64_t(tp_.rank()) * Nl_ : 0;
    for (int64_t t = 0; t < Nl_; ++t) s.moe_index[t] = in.token_index ? in.token_index[first + t] : int32_t(first + t);
  }
  for (int l = ch.first_layer; l < ch.end_layer; ++l) {
    const int i = l - ch.first_layer;
    const MoeLosses L = block_forward(l, s, acts(s, i), moe_acts(s, l, i), s.resid[i], s.resid[i + 1]);
    if (!d_.is_moe(l)) continue;
    aux_sum_ += L.aux + L.z;
    imbalance_sum_ += L.load_imbalance;
    ++moe_forwards_;
  }
  if (!ch.head) return 0.0;
  ops_.copy(s.targets, Tensor(const_cast<int32_t*>(in.targets), {N_}, DType::I32));
  return head_forward(s, dloss);
}

double GPT::head_forward(Slot& s, float dloss) {
  norm_forward(s.xf, s.xf_mean, s.xf_rstd, s.resid.back(), nfw_, nfb_);
  Tensor xf = tp_.column_input_forward(s.xf_full, s.xf);
  ops_.linear_forward(s.logits, xf, head_, Tensor());
  s.have_grad_logits = dloss != 0.0f;
  Tensor dlogits = s.have_grad_logits ? s.logits : Tensor();
  if (tp_.size() == 1) {
    ops_.crossentropy_forward_backward(s.losses, dlogits, s.logits, s.targets, d_.V, dloss);
  } else {
    // Vocabulary-parallel cross-entropy: the row max, then the sum of exponentials and the
    // target's logit over the tp group; the gradient needs nothing more (Megatron's scheme).
    const int64_t vocab_start = int64_t(tp_.rank()) * s.logits.size(1);
    ops_.softmax_shard_max(ce_max_, s.logits, vocab_start, d_.V);
    tp_.allreduce_max(ce_max_);
    ops_.softmax_shard_sums(ce_sum_, ce_target_, s.logits, ce_max_, s.targets, vocab_start, d_.V);
    tp_.allreduce_sum(ce_target_);
    tp_.allreduce_sum(ce_sum_);
    ops_.crossentropy_shard_finish(s.losses, dlogits, s.logits, ce_max_, ce_sum_, ce_target_, s.targets,
                                   vocab_start, d_.V, dloss);
  }
  return ops_.sum(s.losses);
}

MoeLosses GPT::block_forward(int l, const Slot& s, BlockActs& a, MoeActs* m, Tensor x_in, Tensor x_out) {
  const Block& w = w_[local_of_layer_[l]];
  const bool bias_here = tp_.rank() == 0;  // a row-parallel bias is added once, before the reduction
  norm_forward(a.n1, a.n1_mean, a.n1_rstd, x_in, w.n1w, w.n1b);
  Tensor n1 = tp_.column_input_forward(gathered_, a.n1);
  ops_.linear_forward(a.qkv, n1, w.qkvw, w.qkvb);
  lora_forward(w.lqkv, a.qkv, a.uqkv, n1);
  if (!d_.gpt2()) ops_.rope_forward(a.qkv, positions(s), nh_, nkv_, d_.HD(), d_.rope_theta);
  attention_core(s, a);
  Tensor mid = tp_.row_output_target(a.mid, full_);
  ops_.linear_forward(mid, a.att, w.projw, bias_here ? w.projb : Tensor());
  lora_forward(w.lproj, mid, a.uproj, a.att);  // row-parallel: each rank's partial update, summed with the base's
  tp_.row_output_forward(a.mid, mid);
  residual_norm_forward(a.mid, a.n2, a.n2_mean, a.n2_rstd, a.mid, x_in, w.n2w, w.n2b);  // mid += x_in, then norm2
  if (w.is_moe) {  // on this rank's rows (the SP shard); the dispatcher reaches the experts
    const MoeLosses L = moe_->forward(*m, x_out, a.n2, s.moe_index.data(), w.moe);
    ops_.add(x_out, x_out, a.mid);
    return L;
  }
  Tensor n2 = tp_.column_input_forward(gathered_, a.n2);
  if (d_.gpt2() && !w.lfc.on()) {
    ops_.linear_gelu_forward(a.act, a.fc, n2, w.fcw, w.fcb);
  } else {  // the LoRA update joins the product before the activation
    ops_.linear_forward(a.fc, n2, w.fcw, w.fcb);
    lora_forward(w.lfc, a.fc, a.ufc, n2);
    if (d_.gpt2())
      ops_.gelu_forward(a.act, a.fc);
    else
      ops_.swiglu_forward(a.act, a.fc);
  }
  if (tp_.size() == 1) {  // x_out = mid + proj(...) in one product (the residual read as its C)
    ops_.linear_residual_forward(x_out, a.act, w.fpw, w.fpb, a.mid);
    lora_forward(w.lfp, x_out, a.ufp, a.act);
    return {};
  }
  Tensor out = tp_.row_output_target(x_out, full_);
  ops_.linear_forward(out, a.act, w.fpw, bias_here ? w.fpb : Tensor());
  lora_forward(w.lfp, out, a.ufp, a.act);
  tp_.row_output_forward(x_out, out);
  ops_.add(x_out, x_out, a.mid);
  return {};
}

// att = softmax(q k^T / sqrt(HD)) v from a.qkv, saving a.att_saved.
void GPT::attention_core(const Slot& s, BlockActs& a) {
  auto as3 = [&](Tensor t) { return t.view({B_, Tl_, t.size(1)}); };
  if (masked_)
    cp_.attention_forward(as3(a.att), a.att_saved.view({B_, nh_, Tl_}), as3(a.qkv), s.pos_all, s.seg_all, nh_, nkv_,
                          d_.HD());
  else
    ops_.attention_forward(as3(a.att), a.att_saved, as3(a.qkv), nh_, nkv_, d_.HD());
}

void GPT::backward_chunk(int c, int mb, const GradsFinal& final) {
  const Chunk& ch = chunks_[c];
  Slot* s = find(c, mb);
  MPIGPT_CHECK(s, "backward_chunk({}, {}) without its forward", c, mb);
  if (ch.head) {
    head_backward(*s);
    if (final && head_params_.first < head_params_.second) final(head_params_.first, head_params_.second);
  }
  // On entry dres_ = d(loss)/d(chunk output); on exit d(loss)/d(chunk input).
  for (int l = ch.end_layer - 1; l >= ch.first_layer; --l) {
    const int i = l - ch.first_layer;
    BlockActs& a = acts(*s, i);
    MoeActs* m = moe_acts(*s, l, i);
    // Full recomputation: the layer's forward again from its saved input, with the same
    // collectives in the same order on every rank. Its output (resid[i + 1] once more) goes to
    // scratch; its MoE losses and load were counted by the first forward and are dropped here.
    if (recompute_ == Recompute::Full) block_forward(l, *s, a, m, s->resid[i], rc_out_);
    block_backward(l, *s, a, m, s->resid[i], dres_);
    if (final) final(layer_params_[local_of_layer_[l]].first, layer_params_[local_of_layer_[l]].second);
  }
  if (ch.embed) {
    if (dwte_.defined()) {  // else frozen (LoRA): nothing below the first layer wants a gradient
      Tensor dx0 = tp_.row_output_backward(full_, dres_);
      ops_.embedding_backward(dwte_, dwpe_, dx0, s->tokens, positions(*s), int64_t(tp_.rank()) * dwte_.size(0));
    }
    if (final) final(embed_params_.first, embed_params_.second);
  }
  release(c, mb);
}

void GPT::head_backward(Slot& s) {
  MPIGPT_CHECK(s.have_grad_logits, "backward needs a forward with dloss != 0 before it");
  s.have_grad_logits = false;
  // s.logits now holds d(loss)/d(logits); full_ receives the (partial over tp) d(xf).
  ops_.linear_backward(full_, dhead_, Tensor(), s.logits, s.xf_full, head_);
  Tensor dxf = tp_.column_input_backward(dn_, full_);
  ops_.fill(dres_, 0.0f);
  norm_backward(dres_, dnfw_, dnfb_, dxf, s.resid.back(), s.xf_mean, s.xf_rstd, nfw_);
}

// On entry dres = d(loss)/d(x_out); on exit d(loss)/d(x_in).
void GPT::block_backward(int l, const Slot& s, BlockActs& a, MoeActs* m, Tensor x_in, Tensor dres) {
  const Block& w = w_[local_of_layer_[l]];
  const Block& g = g_[local_of_layer_[l]];
  auto as3 = [&](Tensor t) { return t.view({B_, Tl_, t.size(1)}); };
  Tensor dn2;
  if (w.is_moe) {  // x_out = mid + moe(norm2(mid)), on this rank's rows
    moe_->backward(dn_, *m, dres, w.moe, g.moe, aux_scale_);
    expert_lora_mask(g.moe.fc_lora_B);
    dn2 = dn_;
  } else {
    mlp_backward(w, g, a, dres);
    dn2 = tp_.column_input_backward(dn_, full_);
  }
  norm_backward(dres, g.n2w, g.n2b, dn2, a.mid, a.n2_mean, a.n2_rstd, w.n2w);  // dres = d(mid)
  // mid = x_in + proj(attention(qkv(norm1(x_in))))
  Tensor dmid = tp_.row_output_backward(full_, dres);
  ops_.linear_backward(datt_, g.projw, g.projb, dmid, a.att, w.projw);
  lora_backward(w.lproj, g.lproj, datt_, dmid, a.att, a.uproj);
  // Selective recomputation: the attention state again (a.att gets the same values once more).
  if (recomputes_attention()) attention_core(s, a);
  if (masked_)
    cp_.attention_backward(as3(dqkv_), as3(datt_), as3(a.qkv), as3(a.att), a.att_saved.view({B_, nh_, Tl_}),
                           s.pos_all, s.seg_all, nh_, nkv_, d_.HD());
  else
    ops_.attention_backward(as3(dqkv_), as3(datt_), as3(a.qkv), as3(a.att), a.att_saved, nh_, nkv_, d_.HD());
  if (!d_.gpt2()) ops_.rope_backward(dqkv_, positions(s), nh_, nkv_, d_.HD(), d_.rope_theta);
  const Tensor n1 = tp_.column_input_forward(gathered_, a.n1);  // gathered again (sequence parallelism)
  ops_.linear_backward(full_, g.qkvw, g.qkvb, dqkv_, n1, w.qkvw);
  lora_backward(w.lqkv, g.lqkv, full_, dqkv_, n1, a.uqkv, lqkv_parts_);
  Tensor dn1 = tp_.column_input_backward(dn_, full_);
  norm_backward(dres, g.n1w, g.n1b, dn1, x_in, a.n1_mean, a.n1_rstd, w.n1w);  // dres = d(x_in)
}

// x_out = mid + proj(act(fc(norm2(mid)))) of a dense layer: from dres = d(x_out), the (partial over
// tp) gradient of norm2's output into full_.
void GPT::mlp_backward(const Block& w, const Block& g, BlockActs& a, Tensor dres) {
  Tensor dout = tp_.row_output_backward(full_, dres);
  if (w.lfp.on()) {  // the update's input gradient joins the projection's before the activation's backward
    ops_.linear_backward(dact_, g.fpw, g.fpb, dout, a.act, w.fpw);
    lora_backward(w.lfp, g.lfp, dact_, dout, a.act, a.ufp);
    if (d_.gpt2())
      ops_.gelu_backward(dfc_, dact_, a.fc);
    else
      ops_.swiglu_backward(dfc_, dact_, a.fc);
  } else if (d_.gpt2()) {
    ops_.linear_backward_gelu(dfc_, g.fpw, g.fpb, dout, a.act, w.fpw, a.fc);
  } else {
    ops_.linear_backward(dact_, g.fpw, g.fpb, dout, a.act, w.fpw);
    ops_.swiglu_backward(dfc_, dact_, a.fc);
  }
  const Tensor n2 = tp_.column_input_forward(gathered_, a.n2);  // gathered again (sequence parallelism)
  ops_.linear_backward(full_, g.fcw, g.fcb, dfc_, n2, w.fcw);
  lora_backward(w.lfc, g.lfc, full_, dfc_, n2, a.ufc, lfc_parts_);
}

void GPT::lora_forward(const Lora& w, Tensor out, Tensor u, Tensor x) {
  if (w.on()) mpigpt::lora_forward(ops_, out, u, x, w.A, w.B, d_.lora.scale());
}

void GPT::lora_backward(const Lora& w, const Lora& g, Tensor dx, Tensor dout, Tensor x, Tensor u,
                        const LoraParts& parts) {
  if (!w.on()) return;
  Tensor du = dlora_.flat_slice(0, dout.size(0) * u.size(1)).view({dout.size(0), u.size(1)});
  mpigpt::lora_backward(ops_, dx, g.A, g.B, du, dout, x, u, w.A, w.B, d_.lora.scale());
  lora_mask_grad(ops_, g.B, parts, d_.lora.rank, lora_zeros_);
}

void GPT::expert_lora_mask(Tensor dB) {
  if (!dB.defined() || d_.gpt2() || !lfc_parts_.structured()) return;
  const int64_t H = dB.size(1), w = dB.size(2);
  const LoraParts parts{{H / 2, H / 2}, lfc_parts_.blocks};
  for (int64_t e = 0; e < dB.size(0); ++e)
    lora_mask_grad(ops_, dB.flat_slice(e * H * w, H * w).view({H, w}), parts, d_.lora.rank, lora_zeros_);
}

}  // namespace mpigpt
