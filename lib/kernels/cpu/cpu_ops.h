// The CPU reference backend's class (fp32, OpenBLAS, OpenMP), its definitions split by concept over
// cpu_*.cpp; nothing outside lib/kernels/cpu includes this.
#pragma once
#include <omp.h>

#include <climits>
#include <cstdint>
#include <string>

#include "lib/kernels/op_checks.h"
#include "lib/kernels/ops.h"

namespace mpigpt::cpu {

class CpuOps final : public Ops {
 public:
  Device device() const override { return Device::CPU; }
  std::string name() const override;
  bool computes_in(DType dt) const override { return dt == DType::F32; }
  void* allocate(size_t bytes) override;
  void release(void* p) override;
  int64_t attention_saved_numel(int64_t B, int64_t T, int64_t NH) const override { return B * NH * T * T; }
  std::string attention_kernels(int64_t, int64_t, int, int, int, DType) override {
    return "the CPU backend's (fp32, the T x T probabilities saved)";
  }

 protected:
  // memory and element-wise (cpu_ops.cpp)
  void copy_impl(Tensor dst, Tensor src) override;
  void fill_impl(Tensor t, float value) override;
  void scale_impl(Tensor t, float s) override;
  void add_impl(Tensor out, Tensor a, Tensor b) override;

  // cpu_matmul.cpp
  void gemm_impl(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, float alpha, float beta) override;
  void linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias) override;
  void linear_residual_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor residual) override;
  void linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight) override;
  void linear_gelu_forward_impl(Tensor out, Tensor pre, Tensor inp, Tensor weight, Tensor bias) override;
  void linear_backward_gelu_impl(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act, Tensor weight,
                                 Tensor pre) override;

  // cpu_embedding.cpp
  void embedding_forward_impl(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                              int64_t vocab_start) override;
  void embedding_backward_impl(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                               int64_t vocab_start) override;

  // cpu_norm.cpp
  void layernorm_forward_impl(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight, Tensor bias,
                              float eps) override;
  void layernorm_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                               Tensor rstd,
                               Tensor weight) override;
  void rmsnorm_forward_impl(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) override;
  void rmsnorm_backward_impl(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor rstd, Tensor weight) override;
  void residual_layernorm_forward_impl(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                       Tensor weight,
                                       Tensor bias, float eps) override;
  void residual_rmsnorm_forward_impl(Tensor sum, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                     float eps) override;

  // cpu_activation.cpp
  void gelu_forward_impl(Tensor out, Tensor inp) override;
  void gelu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) override;
  void swiglu_forward_impl(Tensor out, Tensor inp) override;
  void swiglu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) override;

  // cpu_attention.cpp
  void rope_forward_impl(Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta) override;
  void rope_backward_impl(Tensor dqkv, Tensor positions, int NH, int NKV, int HD, float theta) override;
  void attention_forward_impl(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) override;
  void attention_backward_impl(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                               int HD) override;

  // cpu_attention_block.cpp
  void attention_block_forward_impl(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                                    Tensor kpos,
                                    Tensor kseg, int NH, int NKV, int HD) override;
  void attention_merge_impl(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse) override;
  void attention_block_backward_impl(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out,
                                     Tensor lse,
                                Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV, int HD) override;
  void copy_cols_impl(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t ncols) override;
  void gather_rows_impl(Tensor out, Tensor inp, Tensor index) override;
  void scatter_add_rows_impl(Tensor dinp, Tensor dout, Tensor index) override;

  // cpu_loss.cpp
  void crossentropy_forward_backward_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets, int64_t V,
                                          float dloss) override;
  void softmax_shard_max_impl(Tensor maxes, Tensor logits, int64_t vocab_start, int64_t V) override;
  void softmax_shard_sums_impl(Tensor sumexp, Tensor target_logit, Tensor logits, Tensor maxes, Tensor targets,
                               int64_t vocab_start, int64_t V) override;
  void crossentropy_shard_finish_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor maxes, Tensor sumexp,
                                      Tensor target_logit, Tensor targets, int64_t vocab_start, int64_t V,
                                      float dloss) override;

  // cpu_optim.cpp
  void adamw_impl(Tensor param, Tensor grad, Tensor m, Tensor v, float lr, float beta1, float beta2, float eps,
                  float weight_decay, int64_t step, float grad_scale) override;
  void adamw_runs_impl(Tensor param, Tensor grad, Tensor m, Tensor v, const std::vector<AdamWRun>& runs, float lr,
                       float beta1, float beta2, float eps, int64_t step, float grad_scale) override;
  double sum_squares_impl(Tensor t) override;
  double sum_impl(Tensor t) override;

  // cpu_moe.cpp
  void moe_router_forward_impl(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                               bool normalize) override;
  void moe_router_backward_impl(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits, Tensor probs,
                                Tensor topk, bool sigmoid, bool normalize) override;
  void grouped_linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                   const int64_t* group_rows) override;
  void grouped_linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight,
                                    const int64_t* group_rows) override;
  void moe_combine_impl(Tensor out, Tensor rows, Tensor slot, Tensor gates) override;
  void moe_combine_backward_impl(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot,
                                 Tensor gates) override;
};

// The data of a tensor the op's front has checked (nullptr when undefined).
inline float* f32(const Tensor& t) { return static_cast<float*>(t.ptr); }
inline int32_t* i32(const Tensor& t) { return static_cast<int32_t*>(t.ptr); }
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
