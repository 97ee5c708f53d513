// Hugging Face PEFT LoRA adapters <-> mpigpt's: adapter_config.json + adapter_model.safetensors,
// PEFT's module names (docs/user-guide.md, "Fine-tuning with LoRA" has the table).
#pragma once
#include <nlohmann/json.hpp>

#include <string>

#include "io/config/config.h"
#include "io/formats/tensor_map.h"

namespace mpigpt {

inline constexpr const char* kPeftConfigFile = "adapter_config.json";
inline constexpr const char* kPeftWeightsFile = "adapter_model.safetensors";

// adapter_config.json of a PEFT LoraConfig for adapters `l` on model `m` (GPT-2: fan_in_fan_out,
// its Conv1D modules; Llama: the Linear q/k/v/o/gate/up/down projections; Mixtral: q/k/v/o and
// every expert's w1/w2/w3; GPT-2 MoE has no Hugging Face form: an error); `base_model` is
// base_model_name_or_path (empty: null).
nlohmann::json peft_config(const ModelConfig& m, const LoraConfig& l, const std::string& base_model);
// The lora settings of a PEFT adapter_config.json for model `m`: rank, alpha, dropout, targets
// (PEFT's target_modules as ours, matched as PEFT does: a module's full name or a suffix after a
// dot, alike in every layer and expert; every named projection of a fused layer with an adapter
// of its own: q_proj -> q). Anything mpigpt does not compute (another peft_type, bias, rslora, DoRA, rank
// or alpha patterns, modules_to_save, layers_to_transform, a target module we have no adapter for)
// is an error naming the field; `where` names the file. *base_model receives
// base_model_name_or_path ("" when null).
LoraConfig lora_config_from_peft(const nlohmann::json& cfg, const ModelConfig& m, const std::string& where,
                                 std::string* base_model = nullptr);

// Our adapters (layers.N.<layer>.lora_{A,B}.weight, global) -> PEFT's tensors: the fused qkv and
// Llama's [gate; up] become one adapter per HF projection, B split by rows and A copied to each
// (targets qkv, fc1) or each projection's block of A's rows and of B's columns (q, k, v, gate, up);
// the routed experts' (E, ...) adapters one per expert (Mixtral's w1 / w3: expert e's gate / up).
// Every adapter `l` implies must be present with its shape, nothing else; B zero outside its blocks.
TensorMap to_peft(const TensorMap& ours, const ModelConfig& m, const LoraConfig& l);
// PEFT's tensors -> ours: the projections' adapters fused again (B's row blocks joined; under a
// shared target their A must be bitwise equal; else each its block). A missing, unknown or
// misshapen key is an error naming it; `where` names the file.
TensorMap from_peft(const TensorMap& peft, const ModelConfig& m, const LoraConfig& l, const std::string& where);

// Writes dir/adapter_config.json and dir/adapter_model.safetensors (dir created if needed).
void save_peft_adapter(const std::string& dir, const TensorMap& ours, const ModelConfig& m, const LoraConfig& l,
                       const std::string& base_model);
// dir/adapter_config.json as lora settings for `m` (lora_config_from_peft), the projections of a
// fused layer as one shared target (qkv, fc1) where adapter_model.safetensors holds equal lora_A.
LoraConfig read_peft_config(const std::string& dir, const ModelConfig& m, std::string* base_model = nullptr);
// dir/adapter_model.safetensors as our adapters (from_peft).
TensorMap load_peft_adapter(const std::string& dir, const ModelConfig& m, const LoraConfig& l);
// base_model_name_or_path of dir/adapter_config.json without interpreting the rest ("" when null).
std::string peft_base_model(const std::string& dir);

}  // namespace mpigpt
