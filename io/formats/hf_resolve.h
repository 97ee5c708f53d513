// Which of our models a Hugging Face class can hold: the model config resolved and checked, shared
// by the tensor mapping (hf_format.cpp) and the config.json translation (hf_config.cpp).
#pragma once
#include <vector>

#include "io/config/config.h"

namespace mpigpt::hf_detail {

// `m` with the derived defaults filled in and checked for what the parameter table relies on.
ModelConfig resolved(const ModelConfig& in);

// Whether layer l of the resolved `m` is a mixture-of-experts layer (lib/model's GptDims::is_moe).
std::vector<bool> moe_layer_flags(const ModelConfig& m);

// resolved(in), refusing what the Hugging Face classes cannot represent. Dense models map to
// GPT2LMHeadModel / LlamaForCausalLM; llama-family MoE models to MixtralForCausalLM, whose every
// layer is a softmax-routed MoE with renormalised top-k weights and no shared expert. Capacity
// and the aux/z-loss coefficients change training only, not the function the weights compute.
ModelConfig resolved_for_hf(const ModelConfig& in);

// The vocabulary arguments of `fn`: vocab positive, padded_vocab at least vocab.
void check_vocab(int vocab, int padded_vocab, const char* fn);

}  // namespace mpigpt::hf_detail
