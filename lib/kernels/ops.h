// The op interface: every numerical operation the model and optimizer need, filled by one backend
// per device (cpu/ fp32 + OpenBLAS, the reference; cuda/ bf16 or f32: cuBLASLt, cuDNN and builtin
// kernels). Model code calls only this table and never branches on the backend (DESIGN principle 5).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lib/core/tensor.h"

namespace mpigpt {

// One run of Ops::adamw_runs: elements [begin, begin + count) of the parameters and gradients,
// [state, state + count) of the moments, updated with this weight decay.
struct AdamWRun {
  int64_t begin = 0, count = 0, state = 0;
  float weight_decay = 0.0f;
};

struct OpTime {
  std::string op;
  double seconds = 0.0;
  int64_t calls = 0;
};

// The ops are non-virtual fronts (ops*.cpp) that check each call's contract once for every backend,
// time it when profiling, and call the backend's *_impl.
// Dimension letters: B batch, T sequence, C channels, N = B*T rows, V vocab (Vp padded),
// NH query heads, NKV key/value heads, HD head dim, F MLP hidden, OC/IC linear out/in features.
// Argument order: outputs (gradients prefixed d), inputs, saved activations, weights, sizes.
// Gradient conventions: weight/bias gradients always ACCUMULATE (+=, so micro-batches add up);
// input gradients OVERWRITE unless the op says "accumulates" (norms add into the residual
// stream gradient they are given). An undefined Tensor (ptr == nullptr) means "not wanted".
class Ops {
 public:
  virtual ~Ops() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;
  // The backend's native stream that every op is queued on (a cudaStream_t for CUDA), or nullptr
  // for a backend whose ops complete before they return (the CPU). Communication orders its own
  // streams against it.
  virtual void* stream() const { return nullptr; }
  // Block the host until every op queued so far has finished (timing, host reads).
  virtual void synchronize() {}
  // High-water mark of the bytes this backend's allocator has handed out (0: not tracked; the
  // CPU's memory is reported by the process's peak resident size instead).
  virtual size_t peak_allocated() const { return 0; }
  // Lines the backend asks to be logged, each given once: the choices it made by measuring (with
  // engine.gemm_autotune, the way to a linear layer's bias gradient). Ranks choose for themselves.
  virtual std::vector<std::string> take_notes() { return {}; }
  // Which kernels run the causal attention ops at this call shape (B,T,NH,NKV,HD) and data dtype,
  // and why, for the start-up log; fails, naming the reason, where the configured choice cannot run
  // it (CudaOptions::Attention::Cudnn).
  virtual std::string attention_kernels(int64_t B, int64_t T, int NH, int NKV, int HD, DType dt) = 0;
  // Whether its ops take floating data in dtype dt (the CPU: f32; CUDA: f32 and bf16).
  virtual bool computes_in(DType dt) const = 0;

  // Per-op timing (`mpigpt bench --profile-ops`): from profile_ops(true) on, each op's time from
  // its call to the end of its device work (a synchronize after each, so the ops no longer overlap
  // each other or communication), by name; an op that another op calls counts in its caller's.
  // profile_ops(true) also clears the times so far.
  void profile_ops(bool on);
  std::vector<OpTime> op_times() const;  // largest time first

  // ---- memory ---------------------------------------------------------------------------
  virtual void* allocate(size_t bytes) = 0;  // zero-filled, 64-byte aligned
  virtual void release(void* p) = 0;
  // dst = src (equal numel); either side may live on the host. Backends that compute in bf16
  // also convert f32 <-> bf16 between device tensors (CudaOps::copy).
  void copy(Tensor dst, Tensor src);
  void fill(Tensor t, float value);
  void scale(Tensor t, float s);  // t *= s
  // out = a + b (out may alias a or b). Shapes: equal numel.
  void add(Tensor out, Tensor a, Tensor b);

  // ---- matrix products ------------------------------------------------------------------
  // c (M,N) = alpha * op(a) @ op(b) + beta * c, row-major; op(x) = x^T when trans_x.
  void gemm(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, float alpha, float beta);
  // out (N,OC) = inp (N,IC) @ weight (OC,IC)^T + bias (OC); bias optional.
  void linear_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias);
  // The residual add after a layer's last product fused into it: out (N,OC) = inp @ weight^T + bias
  // + residual (N,OC), residual in the data dtype and not out itself (on the GPU cuBLASLt reads it
  // as the product's C; the CPU runs linear_forward and add, which is the reference).
  void linear_residual_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor residual);
  // dinp (N,IC) = dout @ weight; dweight (OC,IC) += dout^T @ inp; dbias (OC) += sum over rows.
  void linear_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                               Tensor weight);
  // The GPT-2 MLP's GELU fused into the products around it (cuBLASLt epilogues on the GPU; the
  // CPU runs the two ops in turn, which is the reference):
  // pre (N,OC) = inp @ weight^T + bias (saved for the backward), out (N,OC) = gelu(pre).
  void linear_gelu_forward(Tensor out, Tensor pre, Tensor inp, Tensor weight, Tensor bias);
  // The backward of a linear layer whose input is act = gelu(pre), straight into pre:
  // dpre (N,IC) = (dout @ weight) * gelu'(pre), overwritten; dweight += dout^T @ act and dbias +=
  // the column sums of dout, as linear_backward.
  void linear_backward_gelu(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act,
                                    Tensor weight, Tensor pre);

  // ---- embedding ------------------------------------------------------------------------
  // out (N,C) = wte[tokens - vocab_start] (+ wpe[positions] when wpe is given).
  // tokens, positions (N) i32. wte holds rows [vocab_start, vocab_start + rows) of the
  // vocabulary (the whole vocabulary unless it is split over tensor-parallel ranks); a token
  // outside that range contributes zeros.
  void embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                                 int64_t vocab_start);
  // dwte += scatter of dout rows by token, dwpe += scatter by position (each optional).
  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                                  int64_t vocab_start);

  // ---- normalisation ----------------------------------------------------------------------
  // LayerNorm over C: out (N,C), mean (N), rstd (N) saved; inp (N,C); weight, bias (C).
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                                 Tensor bias, float eps);
  // dinp (N,C) ACCUMULATES; dweight, dbias (C) accumulate.
  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                                  Tensor mean, Tensor rstd, Tensor weight);
  // RMSNorm over C: out = inp * rstd * weight; rstd (N) saved.
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps);
  // dinp (N,C) ACCUMULATES; dweight (C) accumulates.
  void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor rstd,
                                Tensor weight);
  // The residual add fused into the norm after it: sum (N,C) = a + b (sum may alias a or b, in
  // the data dtype), then the norm of sum as layernorm_forward / rmsnorm_forward.
  void residual_layernorm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                          Tensor weight, Tensor bias, float eps);
  void residual_rmsnorm_forward(Tensor sum, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                        float eps);

  // ---- activations ------------------------------------------------------------------------
  // GELU, tanh approximation (GPT-2). out, inp same shape; dinp may alias dout.
  void gelu_forward(Tensor out, Tensor inp);
  void gelu_backward(Tensor dinp, Tensor dout, Tensor inp);
  // SwiGLU: inp (N, 2F) = [gate | up] per row, out (N,F) = silu(gate) * up.
  void swiglu_forward(Tensor out, Tensor inp);
  // dinp (N,2F) from dout (N,F).
  void swiglu_backward(Tensor dinp, Tensor dout, Tensor inp);

  // ---- attention --------------------------------------------------------------------------
  // qkv (N, (NH + 2*NKV)*HD) rows hold the NH query heads, then NKV key heads, then NKV value
  // heads (HD each). Rotary embedding (rotate-half convention of GPT-NeoX / HF Llama: element
  // i pairs with i + HD/2, angle = pos * theta^(-2i/HD)) applied in place to the q and k heads.
  void rope_forward(Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta);
  // dqkv in place: the inverse rotation of its q and k heads (v untouched).
  void rope_backward(Tensor dqkv, Tensor positions, int NH, int NKV, int HD, float theta);
  // Elements of f32 state attention_forward saves for attention_backward (backend-specific:
  // the CPU keeps the probabilities, a fused kernel only the log-sum-exp).
  virtual int64_t attention_saved_numel(int64_t B, int64_t T, int64_t NH) const = 0;
  // Causal softmax(q k^T / sqrt(HD)) v per (batch, head); query head h reads key/value head
  // h / (NH/NKV) (grouped-query attention). out (B,T,NH*HD), qkv (B,T,(NH+2*NKV)*HD).
  void attention_forward(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD);
  // dqkv (B,T,(NH+2*NKV)*HD) overwritten.
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH,
                                  int NKV, int HD);

  // ---- blockwise attention (context parallelism, packed sequences) --------------------------
  // Attention of one block of queries against one block of keys/values with an explicit mask
  // given by per-token positions and document ids: key j is visible to query i (same batch row
  // b) iff kseg[b,j] == qseg[b,i] and kpos[b,j] <= qpos[b,i]. Ring attention calls it once per
  // (local queries, arriving K/V block) and merges the partial results by their log-sum-exp;
  // packed sequences use document ids so no token attends across a document boundary.
  //   qkv (B,Tq,(NH+2*NKV)*HD): only its NH query heads are read (rotary already applied).
  //   kv  (B,Tk,2*NKV*HD): rows [NKV key heads | NKV value heads].
  //   qpos, qseg (B,Tq) i32; kpos, kseg (B,Tk) i32.
  //   out (B,Tq,NH*HD) = softmax(q k^T / sqrt(HD) over the visible keys) v, normalised within
  //   this block; lse (B,NH,Tq) f32 = log sum_j exp(q.k_j / sqrt(HD)) over the visible keys.
  //   A query with no visible key gets out = 0 and lse = -inf.
  void attention_block_forward(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                                       Tensor kpos, Tensor kseg, int NH, int NKV, int HD);
  // Merge a block's partial result into the running one (in place): with m = logaddexp(lse,
  // blk_lse): out = out * exp(lse - m) + blk_out * exp(blk_lse - m), lse = m. -inf on either
  // side is handled (a row that stays -inf keeps out = 0). out, blk_out (B,Tq,NH*HD); lse,
  // blk_lse (B,NH,Tq).
  void attention_merge(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse);
  // Backward of one block given the FINAL (merged over all blocks) out and lse of the queries:
  // P = exp(q.k/sqrt(HD) - lse) on visible pairs, D = rowsum(dout * out) per (b,h,i),
  // dS = P * (dout.v - D). The query-head columns of dqkv (B,Tq,(NH+2*NKV)*HD) ACCUMULATE
  // dS k / sqrt(HD) (its key/value columns are untouched); dkv (B,Tk,2*NKV*HD) ACCUMULATES the
  // key gradient dS^T q / sqrt(HD) and the value gradient P^T dout (grouped-query heads summed).
  void attention_block_backward(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out,
                                        Tensor lse, Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH,
                                        int NKV, int HD);
  // Column block copy between row-major matrices with the same number of rows:
  // dst (N,Dd)[:, dst_col : dst_col+ncols] = src (N,Ds)[:, src_col : src_col+ncols].
  void copy_cols(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t ncols);
  // Row gather by index: out (M,C)[i] = inp (N,C)[index[i]], index (M) i32 in [0, N).
  void gather_rows(Tensor out, Tensor inp, Tensor index);
  // Its transpose: dinp (N,C)[index[i]] += dout (M,C)[i] (ACCUMULATES; indices may repeat).
  void scatter_add_rows(Tensor dinp, Tensor dout, Tensor index);

  // ---- loss ---------------------------------------------------------------------------------
  // Fused softmax + cross-entropy over the first V of Vp columns of logits (N,Vp).
  // losses (N) = -log softmax(row)[target]; a row whose target is < 0 is ignored (loss 0).
  // When dlogits (N,Vp) is given (it may alias logits) it receives
  // (softmax - onehot(target)) * dloss for kept rows, 0 for ignored rows and padded columns.
  void crossentropy_forward_backward(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets,
                                             int64_t V, float dloss);

  // The same loss with the vocabulary split over tensor-parallel ranks (Megatron's
  // vocab-parallel cross-entropy), as three per-shard steps the caller joins with all-reduces:
  //   softmax_shard_max -> all-reduce MAX of maxes -> softmax_shard_sums -> all-reduce SUM of
  //   sumexp and target_logit -> crossentropy_shard_finish.
  // Each rank holds logits (N,Vl) for the global columns [vocab_start, vocab_start + Vl); global
  // columns >= V are padding and never enter the softmax (a shard may be all padding). targets (N)
  // i32 hold global ids < V; a row whose target is < 0 is ignored. With one shard (vocab_start 0,
  // Vl = Vp) the three steps give crossentropy_forward_backward's result to fp32 rounding.
  // sumexp and target_logit may be two halves of one (2,N) buffer so that one all-reduce sums both.
  //
  // maxes (N) = max over this shard's valid columns of logits (N,Vl); -inf where it has none.
  void softmax_shard_max(Tensor maxes, Tensor logits, int64_t vocab_start, int64_t V);
  // With maxes (N) the global row maxima: sumexp (N) = sum over the valid columns of
  // exp(logits - maxes); target_logit (N) = logits[row, target - vocab_start] when the target lies
  // in this shard, else 0. Both are 0 on ignored rows.
  void softmax_shard_sums(Tensor sumexp, Tensor target_logit, Tensor logits, Tensor maxes, Tensor targets,
                                  int64_t vocab_start, int64_t V);
  // With the global maxes, sumexp and target_logit (N): losses (N) = log(sumexp) + maxes -
  // target_logit, 0 on ignored rows (every rank gets the full losses). When dlogits (N,Vl) is given
  // (it may alias logits) it receives this shard's (softmax - onehot(target)) * dloss for kept
  // rows, 0 for ignored rows and padded columns. losses is optional too.
  void crossentropy_shard_finish(Tensor losses, Tensor dlogits, Tensor logits, Tensor maxes, Tensor sumexp,
                                         Tensor target_logit, Tensor targets, int64_t vocab_start, int64_t V,
                                         float dloss);

  // ---- optimizer ----------------------------------------------------------------------------
  // AdamW on a flat range, decoupled weight decay and bias correction (step >= 1):
  //   g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  //   param -= lr * ( (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps) + weight_decay * param )
  void adamw(Tensor param, Tensor grad, Tensor m, Tensor v, float lr, float beta1, float beta2,
                     float eps, float weight_decay, int64_t step, float grad_scale);
  // The same update over many runs of flat f32 buffers in one call (one launch on a GPU: the
  // optimizer step of every tensor at once): run r updates param[begin, begin + count) with grad at
  // the same offsets and m, v at [state, state + count), with its own weight decay. param and grad
  // have the same length, m and v too; runs do not overlap (op_checks.h: check_adamw_runs).
  void adamw_runs(Tensor param, Tensor grad, Tensor m, Tensor v, const std::vector<AdamWRun>& runs,
                          float lr, float beta1, float beta2, float eps, int64_t step, float grad_scale);
  // Sum of squares (for the global gradient norm) and plain sum, returned to the host in double.
  double sum_squares(Tensor t);
  double sum(Tensor t);

  // ---- mixture of experts -------------------------------------------------------------------
  // E experts, K experts per token (top-k), M routed rows (one per kept (token, k) assignment).
  // Router: probs (N,E) = softmax(logits) over E, or sigmoid(logits) element-wise when sigmoid;
  // topk (N,K) i32 = the K experts of largest prob per row, in descending order of prob (ties:
  // lower expert index first); gates (N,K) = their probs, divided by the sum of the K when
  // normalize; lse (N) = logsumexp of the logits row (for the router z-loss; optional).
  void moe_router_forward(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                                  bool normalize);
  // dlogits (N,E) OVERWRITTEN with the gradient of a loss that depends on gates (dgates (N,K)),
  // on probs directly (dprobs (N,E), optional: the load-balancing loss) and on lse (dlse (N),
  // optional: the z-loss, d lse / d logits = softmax(logits) also for a sigmoid router). The
  // top-k choice itself is piecewise constant and has no gradient. logits, probs, topk: forward's.
  void moe_router_backward(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits,
                                   Tensor probs, Tensor topk, bool sigmoid, bool normalize);
  // Grouped linear: G = weight.size(0) groups of consecutive rows of inp (M,IC), group g having
  // group_rows[g] rows (a HOST array of G counts summing to M), each through its own weight[g]
  // (G,OC,IC) and bias[g] (G,OC, optional): out (M,OC) = inp_g @ weight[g]^T + bias[g] per group.
  void grouped_linear_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                      const int64_t* group_rows);
  // dinp (M,IC) OVERWRITTEN (optional); dweight (G,OC,IC) and dbias (G,OC, optional) ACCUMULATE.
  void grouped_linear_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                                       Tensor weight, const int64_t* group_rows);
  // Weighted combine of routed rows back into tokens: for each row i of rows (M,C), with
  // s = slot[i] (slot (M) i32 in [0, N*K), the flat (token, k) position): out (N,C) row s / K
  // ACCUMULATES gates.flat[s] * rows[i]. gates (N,K). Slots must be distinct.
  void moe_combine(Tensor out, Tensor rows, Tensor slot, Tensor gates);
  // Its backward: drows (M,C)[i] = gates.flat[s] * dout[s / K] (OVERWRITTEN); dgates.flat[s] =
  // dout[s / K] . rows[i] (OVERWRITTEN at the M slots, every other entry untouched).
  void moe_combine_backward(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot,
                                    Tensor gates);
 protected:
  // The backends' implementations of the ops above, called with checked arguments.
  virtual void copy_impl(Tensor dst, Tensor src) = 0;
  virtual void fill_impl(Tensor t, float value) = 0;
  virtual void scale_impl(Tensor t, float s) = 0;
  virtual void add_impl(Tensor out, Tensor a, Tensor b) = 0;
  virtual void gemm_impl(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, float alpha, float beta) = 0;
  virtual void linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias) = 0;
  virtual void linear_residual_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor residual) = 0;
  virtual void linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                                    Tensor weight) = 0;
  virtual void linear_gelu_forward_impl(Tensor out, Tensor pre, Tensor inp, Tensor weight, Tensor bias) = 0;
  virtual void linear_backward_gelu_impl(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act,
                                         Tensor weight, Tensor pre) = 0;
  virtual void embedding_forward_impl(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                                      int64_t vocab_start) = 0;
  virtual void embedding_backward_impl(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                                       int64_t vocab_start) = 0;
  virtual void layernorm_forward_impl(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight, Tensor bias,
                                      float eps) = 0;
  virtual void layernorm_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                                       Tensor rstd, Tensor weight) = 0;
  virtual void rmsnorm_forward_impl(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) = 0;
  virtual void rmsnorm_backward_impl(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor rstd,
                                     Tensor weight) = 0;
  virtual void residual_layernorm_forward_impl(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                               Tensor weight, Tensor bias, float eps) = 0;
  virtual void residual_rmsnorm_forward_impl(Tensor sum, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                             float eps) = 0;
  virtual void gelu_forward_impl(Tensor out, Tensor inp) = 0;
  virtual void gelu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) = 0;
  virtual void swiglu_forward_impl(Tensor out, Tensor inp) = 0;
  virtual void swiglu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) = 0;
  virtual void rope_forward_impl(Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta) = 0;
  virtual void rope_backward_impl(Tensor dqkv, Tensor positions, int NH, int NKV, int HD, float theta) = 0;
  virtual void attention_forward_impl(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) = 0;
  virtual void attention_backward_impl(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                                       int HD) = 0;
  virtual void attention_block_forward_impl(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                                            Tensor kpos, Tensor kseg, int NH, int NKV, int HD) = 0;
  virtual void attention_merge_impl(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse) = 0;
  virtual void attention_block_backward_impl(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out,
                                             Tensor lse, Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH,
                                             int NKV, int HD) = 0;
  virtual void copy_cols_impl(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t ncols) = 0;
  virtual void gather_rows_impl(Tensor out, Tensor inp, Tensor index) = 0;
  virtual void scatter_add_rows_impl(Tensor dinp, Tensor dout, Tensor index) = 0;
  virtual void crossentropy_forward_backward_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets,
                                                  int64_t V, float dloss) = 0;
  virtual void softmax_shard_max_impl(Tensor maxes, Tensor logits, int64_t vocab_start, int64_t V) = 0;
  virtual void softmax_shard_sums_impl(Tensor sumexp, Tensor target_logit, Tensor logits, Tensor maxes, Tensor targets,
                                       int64_t vocab_start, int64_t V) = 0;
  virtual void crossentropy_shard_finish_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor maxes, Tensor sumexp,
                                              Tensor target_logit, Tensor targets, int64_t vocab_start, int64_t V,
                                              float dloss) = 0;
  virtual void adamw_impl(Tensor param, Tensor grad, Tensor m, Tensor v, float lr, float beta1, float beta2, float eps,
                          float weight_decay, int64_t step, float grad_scale) = 0;
  virtual void adamw_runs_impl(Tensor param, Tensor grad, Tensor m, Tensor v, const std::vector<AdamWRun>& runs,
                               float lr, float beta1, float beta2, float eps, int64_t step, float grad_scale) = 0;
  virtual double sum_squares_impl(Tensor t) = 0;
  virtual double sum_impl(Tensor t) = 0;
  virtual void moe_router_forward_impl(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                                       bool normalize) = 0;
  virtual void moe_router_backward_impl(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits,
                                        Tensor probs, Tensor topk, bool sigmoid, bool normalize) = 0;
  virtual void grouped_linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                           const int64_t* group_rows) = 0;
  virtual void grouped_linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                                            Tensor weight, const int64_t* group_rows) = 0;
  virtual void moe_combine_impl(Tensor out, Tensor rows, Tensor slot, Tensor gates) = 0;
  virtual void moe_combine_backward_impl(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot,
                                         Tensor gates) = 0;

 private:
  // Runs one op: checked already, timed when profiling (outermost ops only).
  template <class F>
  auto run(const char* op, F&& f) -> decltype(f());
  struct Profile;
  std::shared_ptr<Profile> profile_;
  int depth_ = 0;  // ops running (an op may call others)
};

// The CPU reference backend (fp32, OpenBLAS, OpenMP threads).
std::unique_ptr<Ops> make_cpu_ops();
// The CUDA backend on GPU `device` (lib/kernels/cuda/; bf16 or f32 compute, cuBLASLt, fused
// kernels). Only in builds with MPIGPT_WITH_CUDA; without it this fails with a message saying so.
struct CudaOptions {
  // Time cuBLASLt's candidate algorithms on each large GEMM shape's first product and keep the
  // fastest (engine.gemm_autotune; off, the heuristic's first choice, bitwise reproducible).
  bool gemm_autotune = false;
  // Who runs the causal attention ops (engine.attention_backend): cuDNN's fused attention where it
  // loads and runs the call (bf16 data) and the builtin kernels elsewhere (Default); cuDNN or an
  // error naming why not (Cudnn); the builtin kernels always (Builtin).
  enum class Attention { Default, Cudnn, Builtin };
  Attention attention = Attention::Default;
};
std::unique_ptr<Ops> make_cuda_ops(int device, const CudaOptions& options = {});

}  // namespace mpigpt
