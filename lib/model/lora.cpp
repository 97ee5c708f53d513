// LoRA's adapted linear layer, written against ops.h.
#include "lib/model/lora.h"

#include <sstream>

#include "lib/core/error.h"
#include "lib/model/gpt_dims.h"

namespace mpigpt {

unsigned parse_lora_targets(const std::string& list) {
  unsigned bits = 0;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item == "qkv") bits |= kLoraQkv;
    else if (item == "proj") bits |= kLoraProj;
    else if (item == "fc1") bits |= kLoraFc1;
    else if (item == "fc2") bits |= kLoraFc2;
    else fail("lora.targets = '{}': '{}' is not a linear layer LoRA adapts; write a comma list of qkv, proj, fc1, fc2", list, item);
  }
  if (bits == 0) fail("lora.targets = '{}' names no layer; write a comma list of qkv, proj, fc1, fc2", list);
  return bits;
}

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

}  // namespace mpigpt
