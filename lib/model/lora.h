// LoRA (Hu et al. 2021): a frozen linear layer plus a trained low-rank update,
// y = x W^T + s (x A^T) B^T with A (r, in), B (out, r), s = alpha / r; forward and backward.
#pragma once
#include <cstdint>
#include <vector>

#include "lib/kernels/ops.h"

namespace mpigpt {

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

// The row parts of a column-parallel layer's B on this rank (qkv: its q, k, v rows; SwiGLU's fc:
// gate, up) and the adapter block of each (LoraDims::part_blocks). With an adapter per projection
// (blocks not all 0) B is block-structured: part p's rows are zero outside block p's r columns.
struct LoraParts {
  std::vector<int64_t> rows;
  std::vector<int> blocks;
  bool structured() const;
};
// Keeps that structure through training: zeroes dB's entries outside it (dB (sum rows, blocks x r)
// f32; zeros (>= max rows x r) f32, all zero), so AdamW leaves them at zero as they start.
void lora_mask_grad(Ops& ops, Tensor dB, const LoraParts& parts, int64_t r, Tensor zeros);

}  // namespace mpigpt
