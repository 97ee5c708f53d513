// llm.c GPT-2 model files (gpt2_124M.bin from Karpathy's llm.c train_gpt2.py): a header of 256
// int32 (magic 20240326, version 3 = fp32 or 5 = bf16, max_seq_len, vocab_size, num_layers,
// num_heads, channels, padded_vocab_size, zeros), then the parameters in this order, each
// stacked over layers, PyTorch nn.Linear (out, in) layout: wte (Vp,C), wpe (maxT,C), ln1w, ln1b
// (L,C), qkvw (L,3C,C), qkvb (L,3C), attprojw (L,C,C), attprojb (L,C), ln2w, ln2b (L,C),
// fcw (L,4C,C), fcb (L,4C), fcprojw (L,C,4C), fcprojb (L,C), lnfw, lnfb (C). The output head is
// tied to wte; wte's rows [V, Vp) are zero. llm.c's Llama 3 files are not supported.
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
