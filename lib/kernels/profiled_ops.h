// ProfiledOps: a decorator over any backend that times every op by name, for
// the per-kernel breakdown of a training step (`mpigpt bench --profile-ops`).
// Each op is followed by a synchronize of the backend, so a GPU op's time is
// its kernels' time plus one launch latency (a few microseconds) and the ops no
// longer overlap one another or communication: the step is slower under the
// profiler, the breakdown is what it is for. Memory and shape queries pass
// through untimed.
#pragma once
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "lib/kernels/ops.h"

namespace mpigpt {

struct OpTime {
  std::string op;
  double seconds = 0.0;
  int64_t calls = 0;
};

class ProfiledOps final : public Ops {
 public:
  explicit ProfiledOps(Ops& inner) : inner_(&inner) {}
  // Total time and calls per op since the last reset, largest time first.
  std::vector<OpTime> report() const {
    std::vector<OpTime> r;
    for (const auto& [op, t] : times_) r.push_back({op, t.seconds, t.calls});
    std::sort(r.begin(), r.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
    return r;
  }
  void reset() { times_.clear(); }

  void* stream() const override { return inner_->stream(); }
  void synchronize() override { inner_->synchronize(); }
  size_t peak_allocated() const override { return inner_->peak_allocated(); }
  Device device() const override { return inner_->device(); }
  std::string name() const override { return inner_->name(); }
  std::vector<std::string> take_notes() override { return inner_->take_notes(); }
  std::string attention_kernels(int64_t B, int64_t T, int NH, int NKV, int HD, DType dt) override {
    return inner_->attention_kernels(B, T, NH, NKV, HD, dt);
  }
  void* allocate(size_t bytes) override { return inner_->allocate(bytes); }
  void release(void* p) override { inner_->release(p); }
  void copy(Tensor dst, Tensor src) override {
    timed("copy", [&] { inner_->copy(dst, src); });
  }
  void fill(Tensor t, float value) override {
    timed("fill", [&] { inner_->fill(t, value); });
  }
  void scale(Tensor t, float s) override {
    timed("scale", [&] { inner_->scale(t, s); });
  }
  void add(Tensor out, Tensor a, Tensor b) override {
    timed("add", [&] { inner_->add(out, a, b); });
  }
  void gemm(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, float alpha, float beta) override {
    timed("gemm", [&] { inner_->gemm(c, a, b, trans_a, trans_b, alpha, beta); });
  }
  void linear_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias) override {
    timed("linear_forward", [&] { inner_->linear_forward(out, inp, weight, bias); });
  }
  void linear_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight) override {
    timed("linear_backward", [&] { inner_->linear_backward(dinp, dweight, dbias, dout, inp, weight); });
  }
  void linear_residual_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor residual) override {
    timed("linear_residual_forward", [&] { inner_->linear_residual_forward(out, inp, weight, bias, residual); });
  }
  void linear_gelu_forward(Tensor out, Tensor pre, Tensor inp, Tensor weight, Tensor bias) override {
    timed("linear_gelu_forward", [&] { inner_->linear_gelu_forward(out, pre, inp, weight, bias); });
  }
  void linear_backward_gelu(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act, Tensor weight,
                            Tensor pre) override {
    timed("linear_backward_gelu", [&] { inner_->linear_backward_gelu(dpre, dweight, dbias, dout, act, weight, pre); });
  }
  void embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                         int64_t vocab_start) override {
    timed("embedding_forward", [&] { inner_->embedding_forward(out, tokens, positions, wte, wpe, vocab_start); });
  }
  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                          int64_t vocab_start) override {
    timed("embedding_backward", [&] { inner_->embedding_backward(dwte, dwpe, dout, tokens, positions, vocab_start); });
  }
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight, Tensor bias,
                         float eps) override {
    timed("layernorm_forward", [&] { inner_->layernorm_forward(out, mean, rstd, inp, weight, bias, eps); });
  }
  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean, Tensor rstd,
                          Tensor weight) override {
    timed("layernorm_backward",
          [&] { inner_->layernorm_backward(dinp, dweight, dbias, dout, inp, mean, rstd, weight); });
  }
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) override {
    timed("rmsnorm_forward", [&] { inner_->rmsnorm_forward(out, rstd, inp, weight, eps); });
  }
  void residual_layernorm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                  Tensor bias, float eps) override {
    timed("residual_layernorm_forward",
          [&] { inner_->residual_layernorm_forward(sum, out, mean, rstd, a, b, weight, bias, eps); });
  }
  void residual_rmsnorm_forward(Tensor sum, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                float eps) override {
    timed("residual_rmsnorm_forward", [&] { inner_->residual_rmsnorm_forward(sum, out, rstd, a, b, weight, eps); });
  }
  void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor rstd, Tensor weight) override {
    timed("rmsnorm_backward", [&] { inner_->rmsnorm_backward(dinp, dweight, dout, inp, rstd, weight); });
  }
  void gelu_forward(Tensor out, Tensor inp) override {
    timed("gelu_forward", [&] { inner_->gelu_forward(out, inp); });
  }
  void gelu_backward(Tensor dinp, Tensor dout, Tensor inp) override {
    timed("gelu_backward", [&] { inner_->gelu_backward(dinp, dout, inp); });
  }
  void swiglu_forward(Tensor out, Tensor inp) override {
    timed("swiglu_forward", [&] { inner_->swiglu_forward(out, inp); });
  }
  void swiglu_backward(Tensor dinp, Tensor dout, Tensor inp) override {
    timed("swiglu_backward", [&] { inner_->swiglu_backward(dinp, dout, inp); });
  }
  void rope_forward(Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta) override {
    timed("rope_forward", [&] { inner_->rope_forward(qkv, positions, NH, NKV, HD, theta); });
  }
  void rope_backward(Tensor dqkv, Tensor positions, int NH, int NKV, int HD, float theta) override {
    timed("rope_backward", [&] { inner_->rope_backward(dqkv, positions, NH, NKV, HD, theta); });
  }
  int64_t attention_saved_numel(int64_t B, int64_t T, int64_t NH) const override {
    return inner_->attention_saved_numel(B, T, NH);
  }
  void attention_forward(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) override {
    timed("attention_forward", [&] { inner_->attention_forward(out, saved, qkv, NH, NKV, HD); });
  }
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                          int HD) override {
    timed("attention_backward", [&] { inner_->attention_backward(dqkv, dout, qkv, out, saved, NH, NKV, HD); });
  }
  void attention_block_forward(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg, Tensor kpos,
                               Tensor kseg, int NH, int NKV, int HD) override {
    timed("attention_block_forward",
          [&] { inner_->attention_block_forward(out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD); });
  }
  void attention_merge(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse) override {
    timed("attention_merge", [&] { inner_->attention_merge(out, lse, blk_out, blk_lse); });
  }
  void attention_block_backward(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out, Tensor lse,
                                Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV, int HD) override {
    timed("attention_block_backward", [&] {
      inner_->attention_block_backward(dqkv, dkv, dout, qkv, kv, out, lse, qpos, qseg, kpos, kseg, NH, NKV, HD);
    });
  }
  void copy_cols(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t ncols) override {
    timed("copy_cols", [&] { inner_->copy_cols(dst, dst_col, src, src_col, ncols); });
  }
  void gather_rows(Tensor out, Tensor inp, Tensor index) override {
    timed("gather_rows", [&] { inner_->gather_rows(out, inp, index); });
  }
  void scatter_add_rows(Tensor dinp, Tensor dout, Tensor index) override {
    timed("scatter_add_rows", [&] { inner_->scatter_add_rows(dinp, dout, index); });
  }
  void crossentropy_forward_backward(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets, int64_t V,
                                     float dloss) override {
    timed("crossentropy_forward_backward",
          [&] { inner_->crossentropy_forward_backward(losses, dlogits, logits, targets, V, dloss); });
  }
  void softmax_shard_max(Tensor maxes, Tensor logits, int64_t vocab_start, int64_t V) override {
    timed("softmax_shard_max", [&] { inner_->softmax_shard_max(maxes, logits, vocab_start, V); });
  }
  void softmax_shard_sums(Tensor sumexp, Tensor target_logit, Tensor logits, Tensor maxes, Tensor targets,
                          int64_t vocab_start, int64_t V) override {
    timed("softmax_shard_sums",
          [&] { inner_->softmax_shard_sums(sumexp, target_logit, logits, maxes, targets, vocab_start, V); });
  }
  void crossentropy_shard_finish(Tensor losses, Tensor dlogits, Tensor logits, Tensor maxes, Tensor sumexp,
                                 Tensor target_logit, Tensor targets, int64_t vocab_start, int64_t V,
                                 float dloss) override {
    timed("crossentropy_shard_finish", [&] {
      inner_->crossentropy_shard_finish(losses, dlogits, logits, maxes, sumexp, target_logit, targets, vocab_start, V,
                                        dloss);
    });
  }
  void adamw(Tensor param, Tensor grad, Tensor m, Tensor v, float lr, float beta1, float beta2, float eps,
             float weight_decay, int64_t step, float grad_scale) override {
    timed("adamw", [&] { inner_->adamw(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale); });
  }
  void adamw_runs(Tensor param, Tensor grad, Tensor m, Tensor v, const std::vector<AdamWRun>& runs, float lr,
                  float beta1, float beta2, float eps, int64_t step, float grad_scale) override {
    timed("adamw", [&] { inner_->adamw_runs(param, grad, m, v, runs, lr, beta1, beta2, eps, step, grad_scale); });
  }
  double sum_squares(Tensor t) override {
    return timed("sum_squares", [&] { return inner_->sum_squares(t); });
  }
  double sum(Tensor t) override {
    return timed("sum", [&] { return inner_->sum(t); });
  }
  void moe_router_forward(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                          bool normalize) override {
    timed("moe_router_forward",
          [&] { inner_->moe_router_forward(probs, topk, gates, lse, logits, sigmoid, normalize); });
  }
  void moe_router_backward(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits, Tensor probs,
                           Tensor topk, bool sigmoid, bool normalize) override {
    timed("moe_router_backward",
          [&] { inner_->moe_router_backward(dlogits, dgates, dprobs, dlse, logits, probs, topk, sigmoid, normalize); });
  }
  void grouped_linear_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, const int64_t* group_rows) override {
    timed("grouped_linear_forward", [&] { inner_->grouped_linear_forward(out, inp, weight, bias, group_rows); });
  }
  void grouped_linear_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight,
                               const int64_t* group_rows) override {
    timed("grouped_linear_backward",
          [&] { inner_->grouped_linear_backward(dinp, dweight, dbias, dout, inp, weight, group_rows); });
  }
  void moe_combine(Tensor out, Tensor rows, Tensor slot, Tensor gates) override {
    timed("moe_combine", [&] { inner_->moe_combine(out, rows, slot, gates); });
  }
  void moe_combine_backward(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot, Tensor gates) override {
    timed("moe_combine_backward", [&] { inner_->moe_combine_backward(drows, dgates, dout, rows, slot, gates); });
  }

 private:
  struct Total {
    double seconds = 0.0;
    int64_t calls = 0;
  };
  // Runs one op and adds the time from its call to the end of its device work.
  template <class F>
  auto timed(const char* op, F&& f) -> decltype(f()) {
    const auto t0 = std::chrono::steady_clock::now();
    auto done = [&] {
      inner_->synchronize();
      Total& t = times_[op];
      t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++t.calls;
    };
    if constexpr (std::is_void_v<decltype(f())>) {
      f();
      done();
    } else {
      auto r = f();
      done();
      return r;
    }
  }
  Ops* inner_;
  std::map<std::string, Total> times_;
};

}  // namespace mpigpt
