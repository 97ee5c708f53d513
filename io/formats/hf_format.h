// Hugging Face model interchange: our parameters (layout-independent names, global shapes, Vp
// vocabulary rows) <-> transformers' GPT2LMHeadModel, LlamaForCausalLM and MixtralForCausalLM,
// and ModelConfig <-> config.json; docs/checkpoint-format.md (model interchange) has the tables.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

#include "io/config/config.h"
#include "io/formats/safetensors.h"
#include "io/formats/tensor_map.h"

namespace mpigpt {

// Our parameter names and global shapes for `m` with the vocabulary padded to `padded_vocab`
// rows, in lib/model's buffer order. Mirrors build_param_table (lib/model/params.cpp), which io
// may not include; hf_format_test checks that the two agree. `m` may leave num_kv_heads,
// ffn_hidden, max_position and moe_ffn_hidden 0 (resolved as Config::resolve_defaults and
// make_dims do). Any MoE configuration (either family, moe_layers, shared expert) is listed,
// also those that have no Hugging Face mapping.
std::vector<std::pair<std::string, Shape>> param_shapes(const ModelConfig& m, int padded_vocab);

// Our tensors -> HF tensors: vocabulary rows cut to `vocab`, GPT-2 matrices transposed to
// Conv1D's (in, out), Llama's qkv and [gate; up] split, MoE expert tensors (E, ...) split into
// Mixtral's per-expert w1 (gate), w3 (up), w2 (down). A tied model writes no lm_head.weight
// (transformers ties it to the input embedding on load). Every tensor of param_shapes must be
// present with its shape (vocabulary tensors: any row count >= vocab), nothing else.
// A MoE model must be one MixtralForCausalLM computes: family llama, moe_router softmax,
// moe_norm_topk_prob true, every layer MoE, no shared expert; anything else is an error naming
// the field (also in from_hf and hf_config). Capacity (Mixtral is dropless) and the z-loss
// coefficient change training only and are not carried.
TensorMap to_hf(const TensorMap& ours, const ModelConfig& m, int vocab);

// HF tensors -> ours, vocabulary tensors zero-padded to `padded_vocab` rows. Accepts GPT-2
// names with or without the "transformer." prefix, skips the attention-mask buffers
// (attn.bias, attn.masked_bias) and Llama's rotary_emb.inv_freq; a tied model's lm_head.weight,
// when present, must equal the embedding. Missing, extra or misshapen tensors are errors that
// name the tensor.
TensorMap from_hf(const TensorMap& hf, const ModelConfig& m, int vocab, int padded_vocab);

// config.json of GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM (torch_dtype float32,
// no dropout; Mixtral: intermediate_size = the expert width, router_aux_loss_coef =
// moe_aux_loss_coeff).
nlohmann::json hf_config(const ModelConfig& m, int vocab);
// Our ModelConfig from a config.json (model_type gpt2, llama or mixtral); *vocab (and
// m.vocab_size) = vocab_size. seq_len becomes n_positions (GPT-2) or
// min(max_position_embeddings, 2048) (Llama, Mixtral), a default to override. mixtral gives a
// llama-family MoE model: num_experts, moe_top_k, moe_ffn_hidden = ffn_hidden =
// intermediate_size, softmax router with renormalised top-k, every layer MoE, dropless,
// moe_aux_loss_coeff = router_aux_loss_coef. Features we do not compute (rope_scaling, attention
// or MLP biases, another activation, a sliding window, other MoE types) are errors naming the
// field; `where` names the file.
ModelConfig model_config_from_hf(const nlohmann::json& cfg, int* vocab = nullptr,
                                 const std::string& where = "config.json");

// Re-pads the vocabulary tensors (embedding.word.weight, lm_head.weight) of `ours` to
// `padded_vocab` rows: rows [vocab, padded_vocab) zero; rows beyond must be zero when cutting.
void repad_vocab(TensorMap& ours, int vocab, int padded_vocab);

// Grows the vocabulary tensors of `ours` from `vocab` to `new_vocab` words (a tokenizer with added
// tokens), padded to `padded_vocab` rows: each new row is the mean of the `vocab` existing rows
// (torchtune's resize_token_embeddings default), padding zero. new_vocab ==
// vocab only re-pads; a smaller new_vocab is an error (a vocabulary does not shrink). `source`
// names the model in messages.
void grow_vocab(TensorMap& ours, int vocab, int new_vocab, int padded_vocab, const std::string& source);

// A whole HF model directory: config.json plus model.safetensors (or shards + index above
// `shard_bytes`). Tokenizer files are not written.
void save_hf_model(const std::string& dir, const TensorMap& ours, const ModelConfig& m, int vocab,
                   uint64_t shard_bytes = kHfShardBytes);
// dir/config.json -> ModelConfig (and *vocab).
ModelConfig read_hf_config(const std::string& dir, int* vocab);
// The weights of an HF model directory as our tensors (load_safetensors_model + from_hf).
TensorMap load_hf_model(const std::string& dir, const ModelConfig& m, int vocab, int padded_vocab);

}  // namespace mpigpt
