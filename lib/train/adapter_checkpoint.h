// LoRA adapter checkpoints (docs/checkpoint-format.md): the record of the base model and the lora
// settings a save of adapters carries, the base's layout-independent checksum, and merging.
#pragma once
#include <string>

#include "io/checkpoint/checkpoint_file.h"
#include "io/config/config.h"
#include "io/formats/tensor_map.h"
#include "lib/model/gpt_dims.h"
#include "lib/train/model_runner.h"

namespace mpigpt {

// Where a LoRA run's frozen base comes from: format hf | llmc | checkpoint (the path as given to
// checkpoint.init_from_*, made absolute) or init (the seeded initialisation, path empty).
struct AdapterBase {
  std::string format, path;
  std::string describe() const;  // "the Hugging Face model /x" / "the seeded initialisation"
};
AdapterBase base_of(const Config& cfg);

// The checksum of the base (every parameter but the adapters, vocabulary padding rows excluded),
// 16 hex digits: per tensor the checkpoint checksum of its global elements, combined by name, so
// that any layout and the whole tensors give the same value. Collective over the mesh's world.
std::string base_checksum(ModelRunner& runner);
// The same from whole tensors in this layout's padding (one process).
std::string base_checksum(const TensorMap& model, const GptDims& d);

// Root attributes of an adapter save: lora.rank, lora.alpha, lora.targets, lora.base_format,
// lora.base_path, lora.base_checksum.
void write_adapter_attrs(CheckpointWriter& w, const Config& cfg, const std::string& checksum);
// Before an adapter save is read into a LoRA run: the same lora settings and the same base, else
// an error naming the file, the field or both bases. Collective.
void check_adapter_load(const CheckpointReader& in, const std::string& file, ModelRunner& runner, const Config& cfg);

// The base recorded in the adapter save `root` points to (one process; an error if it holds no
// adapters).
AdapterBase read_adapter_base(const std::string& root, std::string* checksum = nullptr);
// A LoRA run resuming adapters (checkpoint.load) without a checkpoint.init_from_*: take the base
// the save records, so that the model's shape and weights come from it.
void adopt_adapter_base(Config& cfg);

// checkpoint.init_from_peft (docs/user-guide.md): before the model is adopted, a run without a
// checkpoint.init_from_* takes the adapter's base_model_name_or_path as init_from_hf (an error if
// it is not a Hugging Face model directory); after, lora.rank, alpha and targets come from
// adapter_config.json, or must equal it when lora.rank is set (an error naming the field).
void adopt_peft_base(Config& cfg);
void adopt_peft_lora(Config& cfg);

// One process: the base's whole tensors (in the padding of d, vocabulary grown to d.V as a run
// grows it), `cfg` the adapter run's configuration.
TensorMap load_base_tensors(const AdapterBase& base, const Config& cfg, const GptDims& d);
// W += (alpha / rank) B A for every adapted weight of `model`, W_e += s B_e A_e per routed expert
// for the (E, ...) expert tensors (the adapters are not added to it).
void merge_adapters(TensorMap& model, const TensorMap& adapters, const LoraDims& lora);

// One process (`mpigpt convert --merge-lora`): the adapter save `in` points to merged into the
// base it records (refused if the base's checksum changed), written as a full checkpoint into
// out/iter_N (N, consumed samples and tokens: the adapters'; zero Adam moments, optimizer step 0).
struct MergeSummary {
  std::string adapters_file;
  AdapterBase base;
  int64_t iteration = 0, adapters = 0;
  int rank = 0;
  float scale = 0;
};
MergeSummary merge_lora_checkpoint(const std::string& in, const std::string& out);

}  // namespace mpigpt
