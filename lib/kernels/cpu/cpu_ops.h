// The CPU reference backend's class (fp32, OpenBLAS, OpenMP) and the argument checks its ops share.
// Its definitions are split by concept over cpu_*.cpp; nothing outside lib/kernels/cpu includes this.
#pragma once
#include <omp.h>

#include <climits>
#include <cstdint>
#include <string>

#include "lib/kernels/ops.h"

namespace mpigpt::cpu {

class CpuOps final : public Ops {
 public:
  Device device() const override { return Device::CPU; }
  std::string name() const override;

  // memory and element-wise (cpu_ops.cpp)
  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void copy(Tensor dst, Tensor src) override;
  void fill(Tensor t, float value) override;
  void scale(Tensor t, float s) override;
  void add(Tensor out, Tensor a, Tensor b) override;

  // cpu_matmul.cpp
  void gemm(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, float alpha, float beta) override;
  void linear_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias) override;
  void linear_residual_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor residual) override;
  void linear_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight) override;
  void linear_gelu_forward(Tensor out, Tensor pre, Tensor inp, Tensor weight, Tensor bias) override;
  void linear_backward_gelu(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act, Tensor weight,
                            Tensor pre) override;

  // cpu_embedding.cpp
  void embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                         int64_t vocab_start) override;
  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                          int64_t vocab_start) override;

  // cpu_norm.cpp
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight, Tensor bias,
                         float eps) override;
  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean, Tensor rstd,
                          Tensor weight) override;
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) override;
  void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor rstd, Tensor weight) override;
  void residual_layernorm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                  Tensor bias, float eps) override;
  void residual_rmsnorm_forward(Tensor sum, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                float eps) override;

  // cpu_activation.cpp
  void gelu_forward(Tensor out, Tensor inp) override;
  void gelu_backward(Tensor dinp, Tensor dout, Tensor inp) override;
  void swiglu_forward(Tensor out, Tensor inp) override;
  void swiglu_backward(Tensor dinp, Tensor dout, Tensor inp) override;

  // cpu_attention.cpp
  void rope_forward(Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta) override;
  void rope_backward(Tensor dqkv, Tensor positions, int NH, int NKV, int HD, float theta) override;
  int64_t attention_saved_numel(int64_t B, int64_t T, int64_t NH) const override { return B * NH * T * T; }
  std::string attention_kernels(int64_t, int64_t, int, int, int, DType) override {
    return "the CPU backend's (fp32, the T x T probabilities saved)";
  }
  void attention_forward(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) override;
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                          int HD) override;

  // cpu_attention_block.cpp
  void attention_block_forward(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg, Tensor kpos,
                               Tensor kseg, int NH, int NKV, int HD) override;
  void attention_merge(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse) override;
  void attention_block_backward(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out, Tensor lse,
                                Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV, int HD) override;
  void copy_cols(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t ncols) override;
  void gather_rows(Tensor out, Tensor inp, Tensor index) override;
  void scatter_add_rows(Tensor dinp, Tensor dout, Tensor index) override;

  // cpu_loss.cpp
  void crossentropy_forward_backward(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets, int64_t V,
                                     float dloss) override;
  void softmax_shard_max(Tensor maxes, Tensor logits, int64_t vocab_start, int64_t V) override;
  void softmax_shard_sums(Tensor sumexp, Tensor target_logit, Tensor logits, Tensor maxes, Tensor targets,
                          int64_t vocab_start, int64_t V) override;
  void crossentropy_shard_finish(Tensor losses, Tensor dlogits, Tensor logits, Tensor maxes, Tensor sumexp,
                                 Tensor target_logit, Tensor targets, int64_t vocab_start, int64_t V,
                                 float dloss) override;

  // cpu_optim.cpp
  void adamw(Tensor param, Tensor grad, Tensor m, Tensor v, float lr, float beta1, float beta2, float eps,
             float weight_decay, int64_t step, float grad_scale) override;
  void adamw_runs(Tensor param, Tensor grad, Tensor m, Tensor v, const std::vector<AdamWRun>& runs, float lr,
                  float beta1, float beta2, float eps, int64_t step, float grad_scale) override;
  double sum_squares(Tensor t) override;
  double sum(Tensor t) override;

  // cpu_moe.cpp
  void moe_router_forward(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                          bool normalize) override;
  void moe_router_backward(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits, Tensor probs,
                           Tensor topk, bool sigmoid, bool normalize) override;
  void grouped_linear_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, const int64_t* group_rows) override;
  void grouped_linear_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight,
                               const int64_t* group_rows) override;
  void moe_combine(Tensor out, Tensor rows, Tensor slot, Tensor gates) override;
  void moe_combine_backward(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot, Tensor gates) override;
};

// ---- argument checks shared by the ops (cheap: shapes, dtypes, devices; never per element) -------

// A tensor seen as a matrix: cols = its last dimension, rows = everything before it.
struct Mat {
  int64_t rows, cols;
};
inline Mat mat_of(const Tensor& t) {
  int64_t c = t.ndim() > 0 ? t.size(-1) : 1;
  return {c > 0 ? t.numel() / c : 0, c};
}

// The f32 data of a required CPU tensor, with an error naming the op and the argument otherwise.
inline float* f32_arg(const Tensor& t, const char* op, const char* what) {
  MPIGPT_CHECK(t.defined(), "{}: {} is required but undefined", op, what);
  MPIGPT_CHECK(t.dtype == DType::F32, "{}: {} must be f32, got {}", op, what, t.str());
  MPIGPT_CHECK(t.device == Device::CPU, "{}: {} {} is not on the CPU", op, what, t.str());
  return static_cast<float*>(t.ptr);
}
// As f32_arg, but an undefined tensor ("not wanted") gives nullptr.
inline float* f32_opt(const Tensor& t, const char* op, const char* what) {
  return t.defined() ? f32_arg(t, op, what) : nullptr;
}
inline int32_t* i32_arg(const Tensor& t, const char* op, const char* what) {
  MPIGPT_CHECK(t.defined(), "{}: {} is required but undefined", op, what);
  MPIGPT_CHECK(t.dtype == DType::I32, "{}: {} must be i32, got {}", op, what, t.str());
  MPIGPT_CHECK(t.device == Device::CPU, "{}: {} {} is not on the CPU", op, what, t.str());
  return static_cast<int32_t*>(t.ptr);
}
// A BLAS dimension (LP64 OpenBLAS takes int).
inline int blas_int(int64_t x, const char* op) {
  MPIGPT_CHECK(x >= 0 && x <= INT_MAX, "{}: dimension {} does not fit a BLAS int", op, x);
  return int(x);
}

// c (M,N) = alpha * op(a) (M,K) @ op(b) (K,N) + beta * c, row-major with leading dimensions, through
// cblas_sgemm (defined in cpu_matmul.cpp); beta = 0 overwrites c whatever it held (even NaN).
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc, const char* op);

// Parallelise a loop only when it has enough work to pay for waking the team (~1 us).
constexpr int64_t kParallelMin = 1 << 14;

}  // namespace mpigpt::cpu
