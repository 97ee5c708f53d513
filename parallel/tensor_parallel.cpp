// Tensor- and sequence-parallel communication pairs.
#include "parallel/tensor_parallel.h"

namespace mpigpt {

TensorParallel::TensorParallel(const Comm* tp, bool sp) : tp_(tp) {
  if (tp_ && tp_->size() > 1) {
    size_ = tp_->size();
    rank_ = tp_->rank();
  }
  sp_ = sp && size_ > 1;  // sequence parallelism on one rank is plain execution
}

Tensor TensorParallel::column_input_forward(Tensor full_buf, Tensor local) const {
  if (!sp_) return local;
  tp_->all_gather(full_buf, local);
  return full_buf;
}

Tensor TensorParallel::column_input_backward(Tensor dlocal_buf, Tensor dfull) const {
  if (size_ == 1) return dfull;
  if (!sp_) {
    tp_->allreduce_sum(dfull);
    return dfull;
  }
  tp_->reduce_scatter_sum(dlocal_buf, dfull);
  return dlocal_buf;
}

void TensorParallel::row_output_forward(Tensor out, Tensor partial) const {
  if (size_ == 1) return;
  if (sp_)
    tp_->reduce_scatter_sum(out, partial);
  else
    tp_->allreduce_sum(out);
}

Tensor TensorParallel::row_output_backward(Tensor dfull_buf, Tensor dout) const {
  if (!sp_) return dout;
  tp_->all_gather(dfull_buf, dout);
  return dfull_buf;
}

void TensorParallel::sum_replicated_grad(Tensor grad) const {
  if (sp_) tp_->allreduce_sum(grad);
}

void TensorParallel::allreduce_max(Tensor t) const {
  if (size_ > 1) tp_->allreduce_max(t);
}

void TensorParallel::allreduce_sum(Tensor t) const {
  if (size_ > 1) tp_->allreduce_sum(t);
}

}  // namespace mpigpt
