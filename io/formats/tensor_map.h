// Whole (global, unsharded) tensors in host memory by name: what interchange formats (Hugging
// Face safetensors, llm.c model files) and single-process checkpoint conversion exchange. Names
// are mpigpt's layout-independent parameter names ("layers.3.attn.qkv.weight").
#pragma once
#include <map>
#include <string>
#include <vector>

#include "lib/core/tensor.h"

namespace mpigpt {

struct HostTensor {
  Shape shape;
  std::vector<float> data;  // shape.numel() floats, row-major
};

using TensorMap = std::map<std::string, HostTensor>;

}  // namespace mpigpt
