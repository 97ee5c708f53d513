// The parameter table of a GPT: every weight's global name, shape, kind and place in the one
// flat parameter buffer, and its initialisation from the counter-based RNG indexed by the
// element's position in the global tensor (DESIGN principle 3).
#pragma once
#include <string>
#include <vector>

#include "lib/core/tensor.h"
#include "lib/model/gpt_dims.h"

namespace mpigpt {

enum class ParamKind { Weight, Bias, Norm, Embedding };
const char* param_kind_name(ParamKind k);

struct ParamInfo {
  std::string name;    // stable, layout-independent (global layer numbers), e.g. "layers.3.attn.qkv.weight"
  Shape shape;         // global shape
  ParamKind kind;
  int64_t offset = 0;  // first element in the flat buffer
  float init_std = 0;  // normal(0, init_std); 0 with kind Norm = ones, else zeros
  int64_t valid_rows = -1;  // rows beyond this (vocabulary padding) initialise to zero; -1 = all
  int64_t numel() const { return shape.numel(); }
};

// Parameters in buffer order: embedding, blocks 0..L-1, final norm, output head (untied only).
std::vector<ParamInfo> build_param_table(const GptDims& d);

// Write the initial values of `p` into `dst` (host memory, p.numel() floats).
void init_param(const ParamInfo& p, uint64_t seed, float* dst);

}  // namespace mpigpt
