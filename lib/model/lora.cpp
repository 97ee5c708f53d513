// LoRA's adapted linear layer, written against ops.h.
#include "lib/model/lora.h"

#include <algorithm>
#include <numeric>

#include "lib/core/error.h"

namespace mpigpt {

void lora_forward(Ops& ops, Tensor out, Tensor u, Tensor x, Tensor A, Tensor B, float s) {
  ops.linear_forward(u, x, A, Tensor());  // u = x A^T
  ops.scale(u, s);
  ops.gemm(out, u, B, false, true, 1.0f, 1.0f);  // out += u B^T
}

void lora_backward(Ops& ops, Tensor dx, Tensor dA, Tensor dB, Tensor du, Tensor dout, Tensor x, Tensor u, Tensor A,
                   Tensor B, float s) {
  // du = dout B, dB += dout^T (s x A^T); then du *= s is d(loss)/d(x A^T).
  ops.linear_backward(du, dB, Tensor(), dout, u, B);
  ops.scale(du, s);
  ops.linear_backward(Tensor(), dA, Tensor(), du, x, A);  // dA += du^T x
  if (dx.defined()) ops.gemm(dx, du, A, false, false, 1.0f, 1.0f);  // dx += du A
}

bool LoraParts::structured() const {
  return std::any_of(blocks.begin(), blocks.end(), [](int b) { return b != 0; });
}

void lora_mask_grad(Ops& ops, Tensor dB, const LoraParts& parts, int64_t r, Tensor zeros) {
  if (!parts.structured()) return;
  const int64_t width = dB.size(-1);
  const int64_t rows = std::accumulate(parts.rows.begin(), parts.rows.end(), int64_t(0));
  MPIGPT_CHECK(rows == dB.size(0) && width % r == 0, "lora_mask_grad: B's gradient {} is not {} rows in blocks of {}",
               dB.str(), rows, r);
  int64_t row0 = 0;
  for (size_t p = 0; p < parts.rows.size(); ++p) {
    const int64_t n = parts.rows[p];
    const Tensor part = dB.flat_slice(row0 * width, n * width).view({n, width});
    const Tensor zero = zeros.flat_slice(0, n * r).view({n, r});
    for (int64_t col = 0; col < width; col += r)
      if (col / r != parts.blocks[p]) ops.copy_cols(part, col, zero, 0, r);
    row0 += n;
  }
}

}  // namespace mpigpt
