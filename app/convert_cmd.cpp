// `mpigpt convert`: a checkpoint to a Hugging Face model directory or an llm.c model file, and
// back; LoRA adapters to a PEFT adapter or merged into their base. One process, whole tensors.
#include <fmt/format.h>

#include <filesystem>

#include "app/commands.h"
#include "io/formats/hf_format.h"
#include "io/formats/llmc_model.h"
#include "io/formats/peft_format.h"
#include "lib/core/error.h"
#include "lib/core/log.h"
#include "lib/model/gpt_dims.h"
#include "lib/train/adapter_checkpoint.h"
#include "lib/train/checkpointing.h"
#include "lib/train/trainer.h"

namespace mpigpt::app {

namespace {

const char* kUsage =
    "usage: mpigpt convert --to hf CHECKPOINT OUT_DIR       (config.json + model.safetensors)\n"
    "       mpigpt convert --to llmc CHECKPOINT OUT.bin     (llm.c GPT-2 model file, fp32)\n"
    "       mpigpt convert --to peft ADAPTERS OUT_DIR       (PEFT adapter_config.json + adapter_model.safetensors)\n"
    "       mpigpt convert --from hf HF_DIR OUT_CHECKPOINT\n"
    "       mpigpt convert --from llmc FILE.bin OUT_CHECKPOINT\n"
    "       mpigpt convert --merge-lora ADAPTERS OUT_CHECKPOINT   (W + alpha/rank B A, on the recorded base)\n"
    "CHECKPOINT, ADAPTERS: a checkpoint.save directory (its `latest` save) or one iter_NNNNNNN save.";

// The whole-model shape of a Config, in the single-rank padding (tp 1).
GptDims dims_of(const Config& cfg) { return make_dims(cfg, cfg.model.vocab_size); }

void check_new_dir(const std::string& out) {
  if (std::error_code ec; std::filesystem::exists(out, ec) && !std::filesystem::is_empty(out, ec))
    fail("mpigpt convert: {} is not empty; a converted model starts a checkpoint directory of its own (its `latest` "
         "would replace what names the saves there): give a new or empty directory", out);
}

// The adapters of a LoRA save merged into the base it records.
void merge_lora(const std::string& in, const std::string& out) {
  check_new_dir(out);
  const MergeSummary m = merge_lora_checkpoint(in, out);
  log_line("convert: {} merged into {} -> {}/{} ({} adapters of rank {}, scale {})", m.adapters_file,
           m.base.describe(), out, checkpoint_dir_name(m.iteration), m.adapters, m.rank, m.scale);
}

// The adapters of a LoRA save as a Hugging Face PEFT adapter directory.
void to_peft_dir(const std::string& in, const std::string& out) {
  check_new_dir(out);
  Config cfg;
  const TensorMap adapters = read_model_tensors(in, &cfg, "mpigpt convert --to peft " + in);
  if (cfg.lora.rank == 0)
    fail("mpigpt convert --to peft: {} holds a full model, not LoRA adapters; convert it with --to hf", in);
  const AdapterBase base = read_adapter_base(in);
  save_peft_adapter(out, adapters, cfg.model, cfg.lora, base.format == "hf" ? base.path : "");
  log_line("convert: {} -> {} (PEFT LoRA adapter, {} adapters of rank {}, alpha {}, {} model{})",
           resolve_checkpoint(in, in), out, adapters.size() / 2, cfg.lora.rank, cfg.lora.alpha, cfg.model.family,
           base.format == "hf" ? "" : "; base_model_name_or_path null: the base is " + base.describe());
}

}  // namespace

int cmd_convert(const std::vector<std::string>& args, const MpiEnv& mpi) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h" || args[0] == "help")) {
    if (mpi.rank() == 0) fmt::print("{}\n", kUsage);
    return 0;
  }
  if (!args.empty() && args[0] == "--merge-lora") {
    if (args.size() != 3)
      fail("mpigpt convert --merge-lora takes an adapter checkpoint and an output, got {} argument(s)\n{}",
           args.size() - 1, kUsage);
    if (mpi.size() != 1) fail("mpigpt convert runs as one process (it has {}); start it without mpirun", mpi.size());
    merge_lora(args[1], args[2]);
    return 0;
  }
  if (args.size() >= 2 && args[0] == "--to" && args[1] == "peft") {
    if (args.size() != 4)
      fail("mpigpt convert --to peft takes an adapter checkpoint and an output directory, got {} argument(s)\n{}",
           args.size() - 2, kUsage);
    if (mpi.size() != 1) fail("mpigpt convert runs as one process (it has {}); start it without mpirun", mpi.size());
    to_peft_dir(args[2], args[3]);
    return 0;
  }
  if (args.empty() || (args[0] != "--to" && args[0] != "--from"))
    fail("mpigpt convert: the first argument is --to, --from or --merge-lora, not {}\n{}",
         args.empty() ? std::string("nothing") : "'" + args[0] + "'", kUsage);
  if (args.size() < 2 || (args[1] != "hf" && args[1] != "llmc"))
    fail("mpigpt convert {}: {} is not a format; the formats are hf (a Hugging Face model directory), llmc (an "
         "llm.c model file) and, with --to, peft (LoRA adapters)\n{}", args[0], args.size() < 2 ? std::string("nothing") : "'" + args[1] + "'", kUsage);
  if (args.size() != 4)
    fail("mpigpt convert {} {} takes an input and an output, got {} argument(s) after the format\n{}", args[0],
         args[1], args.size() - 2, kUsage);
  if (mpi.size() != 1) fail("mpigpt convert runs as one process (it has {}); start it without mpirun", mpi.size());
  const bool to = args[0] == "--to", hf = args[1] == "hf";
  const std::string& in = args[2];
  const std::string& out = args[3];
  if (to) {
    Config cfg;
    const TensorMap ours = read_model_tensors(in, &cfg, "mpigpt convert --to " + args[1] + " " + in);
    if (cfg.lora.rank > 0)
      fail("mpigpt convert --to {}: {} holds LoRA adapters (lora.rank = {}), not a model; merge them into their base "
           "first: mpigpt convert --merge-lora {} MERGED, then convert MERGED", args[1], in, cfg.lora.rank, in);
    const int V = cfg.model.vocab_size;
    if (hf) {
      save_hf_model(out, ours, cfg.model, V);
    } else {
      if (cfg.model.family != "gpt2")
        fail("mpigpt convert --to llmc: llm.c model files hold GPT-2 models; {} holds a {} model", in, cfg.model.family);
      TensorMap t = ours;
      const int Vp = pad_vocab(V, 128);  // llm.c pads its vocabulary to a multiple of 128
      repad_vocab(t, V, Vp);
      write_llmc_model(out, t, cfg.model, V, Vp);
    }
    log_line("convert: {} -> {} ({} tensors, {} model, vocabulary {})", resolve_checkpoint(in, in), out, ours.size(),
             cfg.model.family, V);
    return 0;
  }
  check_new_dir(out);
  Config cfg;
  TensorMap ours;
  int V = 0;
  ModelConfig m;
  if (hf) {
    m = read_hf_config(in, &V);
  } else {
    ours = read_llmc_model(in, &m, &V, nullptr);
  }
  m.vocab_size = V;
  cfg.adopt_model(m, in);
  cfg.model.seq_len = std::min(cfg.model.max_position, cfg.model.seq_len > 0 ? cfg.model.seq_len : cfg.model.max_position);
  cfg.resolve_defaults();
  const GptDims d = dims_of(cfg);
  if (hf)
    ours = load_hf_model(in, cfg.model, V, d.Vp);
  else
    repad_vocab(ours, V, d.Vp);
  write_model_checkpoint(out, ours, cfg, d, in);
  log_line("convert: {} -> {}/{} ({} tensors, {} model, vocabulary {})", in, out, checkpoint_dir_name(0), ours.size(),
           cfg.model.family, V);
  return 0;
}

}  // namespace mpigpt::app
