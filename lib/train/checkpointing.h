// Checkpoints of a training run (docs/checkpoint-format.md): saving a step into
// ROOT/iter_NNNNNNN/ with the atomic `latest` pointer and retention, and loading any save into any
// layout, every rank writing and reading the hyperslabs its model shard and optimizer slices own.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "io/checkpoint/checkpoint_file.h"
#include "io/config/config.h"
#include "io/formats/tensor_map.h"
#include "lib/model/params.h"
#include "lib/train/model_runner.h"

namespace mpigpt {

// The global boxes holding local elements [begin, end) of parameter p (a tensor-parallel
// shard: row blocks and a column range), in increasing global order, each with the local
// element offset where its (contiguous) data starts.
struct LocalBox {
  Box box;
  int64_t local = 0;
};
std::vector<LocalBox> global_boxes(const ParamInfo& p, int64_t begin, int64_t end);

// "iter_0000100"
std::string checkpoint_dir_name(int64_t iteration);

// What a save carries besides the tensors.
struct CheckpointMeta {
  int64_t iteration = 0;         // steps completed
  int64_t consumed_samples = 0;  // sequences of the global batches seen
  int64_t consumed_tokens = 0;
  double lr = 0;                 // learning rate of the last step (informational)
  std::string saved_config;      // on load: the saved run's configuration (INI text)
};

// Called on every rank while a save is being written (every tensor written, the file not yet
// closed) with the save's iteration: where a test of an interrupted save injects its fault.
using SaveHook = std::function<void(int64_t iteration)>;

// Collective over the mesh's world: writes ROOT/iter_<it>.partial/checkpoint.h5, verifies it,
// renames it to ROOT/iter_<it>, then points ROOT/latest at it (write + rename) and keeps only the
// newest `keep_last` saves (0: all). Returns the seconds it took and the bytes written. A save
// that fails (a full disk, a write error) removes its partial directory and leaves `latest` as
// it was; the error says so, with the space a save needs.
struct SaveStats {
  double seconds = 0;
  int64_t bytes = 0;
};
SaveStats save_checkpoint(const std::string& root, const CheckpointMeta& meta, ModelRunner& runner,
                          const Config& cfg, int keep_last, const SaveHook& midway = {});

// Collective: the save ROOT/latest names (or ROOT itself when it is an iter_ directory), read
// into this layout. Errors name the directory, file and dataset: no `latest`, a different
// model shape, a damaged file.
CheckpointMeta load_checkpoint(const std::string& root, ModelRunner& runner, const Config& cfg);

// The path of the checkpoint file of the save that `root` points to; `given` says in messages how
// the user named root (default: "checkpoint.load = ROOT").
std::string resolve_checkpoint(const std::string& root, const std::string& given = {});

// The bytes of one save of a model of these dimensions (weights and Adam moments, fp32).
int64_t checkpoint_bytes(const GptDims& d);

// Collective: makes root (checkpoint.save) on rank 0 and proves it writable and with room for one
// save of `bytes`, every rank agreeing, so that a path that cannot take a save stops the run
// before training rather than at its first save.
void check_save_dir(const Comm& world, const std::string& root, int64_t bytes);

// Whole-model interchange (conversion, --init-from-hf/llmc), by global parameter name:
// copy this rank's shard of every parameter out of `global` (vocabulary rows padded as this
// layout pads them); `source` names the origin in errors.
void load_weights(ModelRunner& runner, const TensorMap& global, const std::string& source);
// One process: every model tensor of the save `root` points to, and (if cfg) its configuration;
// `given` as for resolve_checkpoint.
TensorMap read_model_tensors(const std::string& root, Config* cfg, const std::string& given = {});
// One process: the configuration of the save `root` points to (its model shape resolved).
Config read_checkpoint_config(const std::string& root, const std::string& given = {});
// One process: a save (zero Adam moments, optimizer step 0) of whole tensors into root/iter_NNNNNNN,
// with meta's iteration and consumed samples (0 for a converted model; a merge keeps its adapters').
void write_model_checkpoint(const std::string& root, const TensorMap& model, const Config& cfg, const GptDims& d,
                            const std::string& source, const CheckpointMeta& meta = {});

}  // namespace mpigpt
