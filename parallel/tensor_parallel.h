// Tensor (and sequence) parallelism: the communication around column- and row-parallel layers,
// as forward/backward pairs over the tp group (Megatron's f/g and sequence-parallel g/ḡ). Every
// op returns at once when the group has one rank.
#pragma once
#include "lib/core/tensor.h"
#include "parallel/comm.h"

namespace mpigpt {

// Tokens are the rows of (N, C) activations; with sequence parallelism tp rank r holds rows
// [r*N/tp, (r+1)*N/tp) of the flattened batch outside the tensor-parallel regions (norms,
// residual), so an all-gather of the shards is the full activation in order.
class TensorParallel {
 public:
  // tp: the tensor-parallel group (nullptr: one rank); sp: sequence parallelism.
  TensorParallel(const Comm* tp, bool sp);
  int size() const { return size_; }
  int rank() const { return rank_; }
  bool sequence_parallel() const { return sp_; }
  const Comm* group() const { return tp_; }  // the tp group (nullptr: one rank)
  // Rows a rank holds outside tensor-parallel regions: N, or N/tp with sequence parallelism.
  int64_t local_rows(int64_t N) const { return sp_ ? N / size_ : N; }

  // Entering a column-parallel layer (QKV, MLP up, output head), local (Nl,C) -> full (N,C).
  //   forward:  SP: all-gather of the shards into `full_buf`; else identity (returns `local`).
  //   backward: SP: reduce-scatter of dfull (partial sums over tp) into dlocal_buf;
  //             else all-reduce of dfull in place. Returns the gradient of `local`.
  Tensor column_input_forward(Tensor full_buf, Tensor local) const;
  Tensor column_input_backward(Tensor dlocal_buf, Tensor dfull) const;

  // Leaving a row-parallel layer (attention out, MLP down, vocab-parallel embedding): the
  // layer writes its partial sum (N,C) into row_output_target(out, scratch), then
  //   forward:  SP: reduce-scatter into out (Nl,C); else all-reduce in place (out is the target).
  //   backward: SP: all-gather of dout (Nl,C) into dfull_buf (N,C); else identity (returns dout).
  Tensor row_output_target(Tensor out, Tensor scratch) const { return sp_ ? scratch : out; }
  void row_output_forward(Tensor out, Tensor partial) const;
  Tensor row_output_backward(Tensor dfull_buf, Tensor dout) const;

  // Gradients of parameters replicated over tp but computed from sequence shards (norms):
  // summed over tp. Identity without sequence parallelism (every rank saw every token).
  void sum_replicated_grad(Tensor grad) const;

  // Vocabulary-parallel softmax statistics: per-row max and sums over the tp group.
  void allreduce_max(Tensor t) const;
  void allreduce_sum(Tensor t) const;

 private:
  const Comm* tp_;
  int size_ = 1, rank_ = 0;
  bool sp_ = false;
};

}  // namespace mpigpt
