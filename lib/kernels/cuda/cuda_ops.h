// The CUDA backend's class. Its definitions are split by concept over cuda_*.cu; nothing outside
// lib/kernels/cuda includes this header (the rest of the program sees only ops.h).
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lib/kernels/caching_allocator.h"
#include "lib/kernels/cuda/cudnn_sdpa.h"
#include "lib/kernels/ops.h"

namespace mpigpt::cuda {

// Precision: every op takes its floating "data" tensors (inputs, outputs, their gradients,
// activations, and the compute copies of weights) in ONE dtype per call, F32 or BF16 (mixed
// precision trains with BF16 data and F32 master weights). Tensors that are always F32 whatever
// the data dtype: weight and bias GRADIENTS (fp32 accumulation), saved statistics (norm mean/rstd,
// attention lse and saved state, loss maxes/sumexp/target_logit), losses, router probs, gates and
// their gradients, optimizer state and master weights. Kernels load to float, compute in float and
// round once on store. Every kernel is queued on stream(); nothing synchronises the host except
// the ops that return a value to it (sum, sum_squares) and copies into host memory.
class CudaOps final : public Ops {
 public:
  explicit CudaOps(int device);  // cuda_ops.cu: sets the device, checks the architecture, creates the stream
  ~CudaOps() override;
  Device device() const override { return Device::CUDA; }
  std::string name() const override;
  bool computes_in(DType dt) const override { return dt == DType::F32 || dt == DType::BF16; }
  void* stream() const override { return stream_; }
  void synchronize() override;
  size_t peak_allocated() const override { return alloc_->stats().peak_in_use; }
  cudaStream_t cuda_stream() const { return stream_; }
  int device_index() const { return device_; }
  const CachingAllocator& allocator() const { return *alloc_; }

  void* allocate(size_t bytes) override;
  void release(void* p) override;
  int64_t attention_saved_numel(int64_t B, int64_t T, int64_t NH) const override { return B * NH * T; }

  // Scratch on the device for one op's temporaries (reductions, cuBLASLt workspace): served by
  // the caching allocator, so steady-state steps do no cudaMalloc. Freed when the op returns is
  // safe because every user is queued on stream() before the block can be handed out again.
  struct Scratch {
    CudaOps* ops = nullptr;
    void* ptr = nullptr;
    ~Scratch() { if (ptr) ops->release(ptr); }
  };
  Scratch scratch(size_t bytes) { return Scratch{this, allocate_uninitialised(bytes)}; }
  void* allocate_uninitialised(size_t bytes);
  cublasLtHandle_t cublaslt() const { return lt_; }
  void* cublaslt_workspace() const { return workspace_; }
  static constexpr size_t kCublasWorkspace = size_t(32) << 20;
  // GEMM autotuning (cuda_matmul.cu): when on, the first product of each configuration with at
  // least min_flop FLOPs times the heuristic's candidates on its own operands and keeps the
  // fastest when it beats the heuristic's first choice by 3% or more. Off by default (the
  // heuristic's first choice: bitwise the same result on every run); engine.gemm_autotune.
  static constexpr double kTuneMinFlop = 1e10;
  void set_gemm_autotune(bool on, double min_flop = kTuneMinFlop) {
    tune_ = on;
    tune_min_flop_ = min_flop;
  }
  bool gemm_autotune() const { return tune_ && !tune_paused_; }
  double gemm_autotune_min_flop() const { return tune_min_flop_; }
  // The grouped (MoE) products meet new row counts every step: they take the heuristic's choice.
  struct TunePause {
    CudaOps& ops;
    bool was;
    explicit TunePause(CudaOps& o) : ops(o), was(o.tune_paused_) { o.tune_paused_ = true; }
    ~TunePause() { ops.tune_paused_ = was; }
  };
  // Host-pinned staging for sum/sum_squares results (one double pair).
  double* host_result() const { return host_result_; }
  // cuBLASLt descriptors and the heuristic's algorithm per matmul configuration (shape, dtypes,
  // epilogue, alignment), so steady-state matmuls do not query the heuristic again (cuda_matmul.cu).
  struct MatmulPlans;
  MatmulPlans& matmul_plans();
  // How many matmul configurations in the plan cache had their algorithm chosen by timing.
  size_t gemm_tuned_plans();
  // adamw_runs' chunk tables on the device, one per run list met (cuda_optim.cu).
  struct AdamTables;
  AdamTables& adam_tables();
  // Who runs the causal attention ops (engine.attention_backend; cuda_attention_causal.cu). The
  // blockwise ops (ring attention, packed documents) always run the builtin kernels.
  void set_attention(CudaOptions::Attention a) { attention_ = a; }
  std::string attention_kernels(int64_t B, int64_t T, int NH, int NKV, int HD, DType dt) override;
  // The one-time measurements since the last call (linear_backward's bias-gradient choice, one per
  // configuration), for the log.
  std::vector<std::string> take_notes() override;
  void add_note(std::string note) { notes_.push_back(std::move(note)); }

 protected:
  // memory and element-wise (cuda_ops.cu)
  void copy_impl(Tensor dst, Tensor src) override;
  void fill_impl(Tensor t, float value) override;
  void scale_impl(Tensor t, float s) override;
  void add_impl(Tensor out, Tensor a, Tensor b) override;

  // cuda_matmul.cu (cuBLASLt)
  void gemm_impl(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, float alpha, float beta) override;
  void linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias) override;
  void linear_residual_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor residual) override;
  void linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight) override;
  void linear_gelu_forward_impl(Tensor out, Tensor pre, Tensor inp, Tensor weight, Tensor bias) override;
  void linear_backward_gelu_impl(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act, Tensor weight,
                                 Tensor pre) override;
  void grouped_linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                   const int64_t* group_rows) override;
  void grouped_linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight,
                                    const int64_t* group_rows) override;

  // cuda_embedding.cu
  void embedding_forward_impl(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                              int64_t vocab_start) override;
  void embedding_backward_impl(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                               int64_t vocab_start) override;

  // cuda_norm.cu
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

  // cuda_activation.cu
  void gelu_forward_impl(Tensor out, Tensor inp) override;
  void gelu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) override;
  void swiglu_forward_impl(Tensor out, Tensor inp) override;
  void swiglu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) override;
  void rope_forward_impl(Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta) override;
  void rope_backward_impl(Tensor dqkv, Tensor positions, int NH, int NKV, int HD, float theta) override;

  // cuda_attention.cu (fused, FlashAttention-2 style: the T x T matrix never exists; saved = lse)
  void attention_forward_impl(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) override;
  void attention_backward_impl(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                               int HD) override;
  void attention_block_forward_impl(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                                    Tensor kpos,
                                    Tensor kseg, int NH, int NKV, int HD) override;
  void attention_merge_impl(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse) override;
  void attention_block_backward_impl(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out,
                                     Tensor lse,
                                Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV, int HD) override;

  // cuda_rows.cu
  void copy_cols_impl(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t ncols) override;
  void gather_rows_impl(Tensor out, Tensor inp, Tensor index) override;
  void scatter_add_rows_impl(Tensor dinp, Tensor dout, Tensor index) override;

  // cuda_loss.cu
  void crossentropy_forward_backward_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets, int64_t V,
                                          float dloss) override;
  void softmax_shard_max_impl(Tensor maxes, Tensor logits, int64_t vocab_start, int64_t V) override;
  void softmax_shard_sums_impl(Tensor sumexp, Tensor target_logit, Tensor logits, Tensor maxes, Tensor targets,
                               int64_t vocab_start, int64_t V) override;
  void crossentropy_shard_finish_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor maxes, Tensor sumexp,
                                      Tensor target_logit, Tensor targets, int64_t vocab_start, int64_t V,
                                      float dloss) override;

  // cuda_optim.cu
  void adamw_impl(Tensor param, Tensor grad, Tensor m, Tensor v, float lr, float beta1, float beta2, float eps,
                  float weight_decay, int64_t step, float grad_scale) override;
  void adamw_runs_impl(Tensor param, Tensor grad, Tensor m, Tensor v, const std::vector<AdamWRun>& runs, float lr,
                       float beta1, float beta2, float eps, int64_t step, float grad_scale) override;
  double sum_squares_impl(Tensor t) override;
  double sum_impl(Tensor t) override;

  // cuda_moe.cu
  void moe_router_forward_impl(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                               bool normalize) override;
  void moe_router_backward_impl(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits, Tensor probs,
                                Tensor topk, bool sigmoid, bool normalize) override;
  void moe_combine_impl(Tensor out, Tensor rows, Tensor slot, Tensor gates) override;
  void moe_combine_backward_impl(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot,
                                 Tensor gates) override;

 private:
  // Why cuDNN's fused attention cannot run this call (it does not load, the data is not bf16, it
  // has no plan for the shape), or empty where it runs it.
  std::string cudnn_refusal(const SdpaShape& shape, DType dt);
  // cuDNN for this causal call, or null where the builtin kernels run it; fails where
  // engine.attention_backend = cudnn and cuDNN cannot run it.
  CudnnSdpa* cudnn_for(const SdpaShape& shape, DType dt, const char* op);

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  double* host_result_ = nullptr;
  bool tune_ = false, tune_paused_ = false;
  CudaOptions::Attention attention_ = CudaOptions::Attention::Default;
  std::vector<std::string> notes_;
  std::unique_ptr<CudnnSdpa> sdpa_;  // created on first use
  std::string cudnn_missing_;        // why cuDNN could not be loaded (then never tried again)
  double tune_min_flop_ = kTuneMinFlop;
  std::unique_ptr<CachingAllocator> alloc_;
  std::unique_ptr<MatmulPlans, void (*)(MatmulPlans*)> plans_{nullptr, nullptr};  // created on first use
  std::unique_ptr<AdamTables, void (*)(AdamTables*)> adam_tables_{nullptr, nullptr};  // before alloc_ goes
};

}  // namespace mpigpt::cuda
