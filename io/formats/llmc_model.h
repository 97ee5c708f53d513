// llm.c GPT-2 model files (gpt2_124M.bin from Karpathy's llm.c train_gpt2.py) <-> our parameters;
// the byte layout is in llmc_model.cpp and docs/checkpoint-format.md. llm.c's Llama 3 files are
// not supported.
#pragma once
#include <cstdint>
#include <string>

#include "io/config/config.h"
#include "io/formats/tensor_map.h"

namespace mpigpt {

inline constexpr int32_t kLlmcModelMagic = 20240326;

// Reads version 3 (fp32) or version 5 (bf16, widened to fp32) into our parameter names
// (unstacked per layer: "layers.3.attn.qkv.weight"), embedding with the file's Vp rows (rows
// beyond the vocabulary set to zero). Fills *m (gpt2, ffn_hidden 4C, seq_len = max_position =
// max_seq_len, tied), *vocab and *padded_vocab (each may be null). Magic, version, header values
// and the file size are validated; errors name the file.
TensorMap read_llmc_model(const std::string& path, ModelConfig* m, int* vocab, int* padded_vocab);

// Writes version 3 (fp32). `ours` holds every parameter of the GPT-2 model `m` (embedding with
// any number of rows >= vocab); the file's wte gets `padded_vocab` rows, rows beyond `vocab`
// zero. The model must be what llm.c computes: family gpt2, tied, ffn_hidden = 4 * hidden,
// num_kv_heads = num_heads; anything else is an error naming the field.
void write_llmc_model(const std::string& path, const TensorMap& ours, const ModelConfig& m, int vocab,
                      int padded_vocab);

}  // namespace mpigpt
