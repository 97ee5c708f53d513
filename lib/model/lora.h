// LoRA (Hu et al. 2021): a frozen linear layer plus a trained low-rank update,
// y = x W^T + s (x A^T) B^T with A (r, in), B (out, r), s = alpha / r; forward and backward.
#pragma once
#include <string>

#include "lib/kernels/ops.h"

namespace mpigpt {

// lora.targets, "qkv,proj,fc1,fc2" (any non-empty subset), as LoraTarget bits; fails naming the field.
unsigned parse_lora_targets(const std::string& list);

// out (N,OUT) += s (x A^T) B^T, x (N,IN), A (r,IN), B (OUT,r); u (N,r) receives s x A^T, which the
// backward reads. Built from linear_forward and gemm (beta 1): no kernel of its own. Under tensor
// parallelism the caller passes its shards: column-parallel base, B's rows of this rank (A
// whole); row-parallel, A's input columns of this rank (B whole), out the partial sum that the
// base's reduction completes.
void lora_forward(Ops& ops, Tensor out, Tensor u, Tensor x, Tensor A, Tensor B, float s);
// The backward of lora_forward from dout (N,OUT): dA (r,IN) and dB (OUT,r) accumulate (f32), dx
// (N,IN) accumulates (optional); du (N,r) is scratch. Under tensor parallelism the replicated
// factor's gradient is partial: the caller sums it over the tp group.
void lora_backward(Ops& ops, Tensor dx, Tensor dA, Tensor dB, Tensor du, Tensor dout, Tensor x, Tensor u, Tensor A,
                   Tensor B, float s);

}  // namespace mpigpt
