// Merging LoRA adapters into their weights, and the base checksum's independence of padding rows.
#include <doctest/doctest.h>

#include "lib/train/adapter_checkpoint.h"
#include "lib/train/trainer.h"

using namespace mpigpt;

TEST_CASE("merge_adapters adds (alpha / rank) B A to the adapted weight only") {
  TensorMap model, adapters;
  model["layers.0.attn.proj.weight"] = HostTensor{Shape{3, 2}, {1, 2, 3, 4, 5, 6}};
  model["layers.0.attn_norm.weight"] = HostTensor{Shape{2}, {7, 8}};
  adapters["layers.0.attn.proj.lora_A.weight"] = HostTensor{Shape{1, 2}, {0.5f, -1}};  // A (r=1, in=2)
  adapters["layers.0.attn.proj.lora_B.weight"] = HostTensor{Shape{3, 1}, {2, 0, -4}};  // B (out=3, r=1)
  LoraDims lora;
  lora.rank = 1;
  lora.alpha = 2;
  merge_adapters(model, adapters, lora);
  // W + 2 * B A, B A = [[1, -2], [0, 0], [-2, 4]]
  CHECK(model.at("layers.0.attn.proj.weight").data == std::vector<float>{3, -2, 3, 4, 1, 14});
  CHECK(model.at("layers.0.attn_norm.weight").data == std::vector<float>{7, 8});
  adapters.erase("layers.0.attn.proj.lora_B.weight");
  CHECK_THROWS_WITH(merge_adapters(model, adapters, lora), doctest::Contains("has no lora_B"));
}

TEST_CASE("merge_adapters adds (alpha / rank) B_e A_e to each routed expert's weight") {
  TensorMap model, adapters;
  model["layers.0.mlp.experts.proj.weight"] = HostTensor{Shape{2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8}};  // (E, out, in)
  adapters["layers.0.mlp.experts.proj.lora_A.weight"] = HostTensor{Shape{2, 1, 2}, {1, 0, 0.5f, -1}};  // (E, r, in)
  adapters["layers.0.mlp.experts.proj.lora_B.weight"] = HostTensor{Shape{2, 2, 1}, {1, 2, -2, 4}};  // (E, out, r)
  LoraDims lora;
  lora.rank = 1;
  lora.alpha = 2;
  merge_adapters(model, adapters, lora);
  // Expert 0: B A = [[1, 0], [2, 0]]; expert 1: B A = [[-1, 2], [2, -4]]; W += 2 B A.
  CHECK(model.at("layers.0.mlp.experts.proj.weight").data == std::vector<float>{3, 2, 7, 4, 3, 10, 11, 0});
  adapters["layers.0.mlp.experts.proj.lora_B.weight"] = HostTensor{Shape{1, 2, 1}, {1, 2}};  // one expert only
  CHECK_THROWS_WITH(merge_adapters(model, adapters, lora), doctest::Contains("do not fit the weight (2, 2, 2)"));
}

TEST_CASE("the base checksum covers every base tensor but not the vocabulary padding") {
  Config cfg;
  cfg.model.num_layers = 1;
  cfg.model.hidden = 8;
  cfg.model.num_heads = 2;
  cfg.model.seq_len = 4;
  cfg.model.vocab_size = 5;
  cfg.lora.rank = 2;
  cfg.resolve_defaults();
  const GptDims d = make_dims(cfg, 5);
  const TensorMap w = load_base_tensors(AdapterBase{"init", ""}, cfg, d);  // the seeded base
  const std::string sum = base_checksum(w, d);
  CHECK(sum.size() == 16);
  TensorMap padded = w;
  padded.at("embedding.word.weight").data.back() = 1.0f;  // a padding row (rows >= V = 5)
  CHECK(base_checksum(padded, d) == sum);
  TensorMap changed = w;
  changed.at("layers.0.attn.qkv.weight").data[3] += 1e-3f;
  CHECK(base_checksum(changed, d) != sum);
  for (const auto& [name, t] : w) CHECK(name.find("lora_") == std::string::npos);
}
