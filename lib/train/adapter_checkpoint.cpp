// LoRA adapter checkpoints: the base record and its checksum, the checks on load, the merge.
#include "lib/train/adapter_checkpoint.h"

#include <mpi.h>

#include <filesystem>
#include <map>

#include <fmt/format.h>

#include "io/checkpoint/hdf5_collective.h"
#include "io/formats/hf_format.h"
#include "io/formats/llmc_model.h"
#include "io/formats/peft_format.h"
#include "lib/core/error.h"
#include "lib/core/log.h"
#include "lib/model/params.h"
#include "lib/train/checkpointing.h"
#include "lib/train/trainer.h"

namespace mpigpt {

namespace {

uint64_t mix64(uint64_t z) {  // splitmix64's finalizer, as the dataset checksum uses it
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// The base's tensors (every parameter but the adapters) in the whole model's table order.
std::vector<ParamInfo> base_params(const GptDims& d) {
  std::vector<ParamInfo> out;
  for (ParamInfo& p : build_param_table(d))
    if (!is_lora_param(p.name)) out.push_back(std::move(p));
  return out;
}

int64_t data_rows(const ParamInfo& p) { return p.valid_rows >= 0 ? p.valid_rows : p.global[0]; }

// Per-tensor checksums combined by name: the same sums in another order give another value.
std::string combine(const std::vector<ParamInfo>& params, const std::vector<uint64_t>& sums) {
  uint64_t h = 0;
  for (size_t i = 0; i < params.size(); ++i) h += mix64(sums[i] ^ fnv1a(params[i].name));
  return fmt::format("{:016x}", h);
}

std::string trained_on(const std::string& file, const AdapterBase& base) {
  return fmt::format("checkpoint {} holds LoRA adapters trained on {}", file, base.describe());
}

}  // namespace

std::string AdapterBase::describe() const {
  if (format == "hf") return "the Hugging Face model " + path;
  if (format == "llmc") return "the llm.c model " + path;
  if (format == "checkpoint") return "the checkpoint " + path;
  return "the seeded initialisation (no checkpoint.init_from_*)";
}

AdapterBase base_of(const Config& cfg) {
  const CheckpointConfig& k = cfg.checkpoint;
  auto abs = [](const std::string& p) { return std::filesystem::absolute(p).lexically_normal().string(); };
  if (!k.init_from_hf.empty()) return {"hf", abs(k.init_from_hf)};
  if (!k.init_from_llmc.empty()) return {"llmc", abs(k.init_from_llmc)};
  if (!k.init_from_checkpoint.empty()) return {"checkpoint", abs(k.init_from_checkpoint)};
  return {"init", ""};
}

std::string base_checksum(ModelRunner& r) {
  const GptDims& d = r.model().dims();
  const std::vector<ParamInfo> global = base_params(d);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < global.size(); ++i) index[global[i].name] = i;
  const Tensor flat = r.model().params_flat();
  std::vector<float> host;
  const float* w = nullptr;
  if (flat.device == Device::CPU) {
    w = flat.f32();
  } else {
    host.resize(size_t(flat.numel()));
    r.ops().copy(Tensor(host.data(), flat.shape), flat);
    w = host.data();
  }
  std::vector<uint64_t> sums(global.size(), 0);
  for (const ParamInfo& p : r.model().params()) {
    auto it = index.find(p.name);
    if (it == index.end() || !r.writes_param(p)) continue;  // an adapter, or another rank's copy
    const int64_t api_cols = p.global.numel() / p.global[0];
    for (const LocalBox& lb : global_boxes(p, 0, p.numel())) {
      const int64_t rows = std::min(lb.box.row0 + lb.box.rows, data_rows(p)) - lb.box.row0;
      for (int64_t i = 0; i < rows; ++i)  // a box's data is packed: rows of box.cols
        sums[it->second] += h5::checksum_range((lb.box.row0 + i) * api_cols + lb.box.col0,
                                           w + p.offset + lb.local + i * lb.box.cols, lb.box.cols);
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, sums.data(), int(sums.size()), MPI_UINT64_T, MPI_SUM, r.mesh().world().mpi());
  return combine(global, sums);
}

std::string base_checksum(const TensorMap& model, const GptDims& d) {
  const std::vector<ParamInfo> global = base_params(d);
  std::vector<uint64_t> sums(global.size(), 0);
  for (size_t i = 0; i < global.size(); ++i) {
    const ParamInfo& p = global[i];
    auto it = model.find(p.name);
    if (it == model.end()) fail("the base model has no tensor {}", p.name);
    sums[i] = h5::checksum_range(0, it->second.data.data(), data_rows(p) * (p.global.numel() / p.global[0]));
  }
  return combine(global, sums);
}

void write_adapter_attrs(CheckpointWriter& w, const Config& cfg, const std::string& checksum) {
  const AdapterBase b = base_of(cfg);
  w.attr("lora.rank", int64_t(cfg.lora.rank));
  w.attr("lora.alpha", cfg.lora.alpha);
  w.attr("lora.rslora", int64_t(cfg.lora.rslora));
  w.attr("lora.targets", cfg.lora.targets);
  w.attr("lora.base_format", b.format);
  w.attr("lora.base_path", b.path);
  w.attr("lora.base_checksum", checksum);
}

void check_adapter_load(const CheckpointReader& in, const std::string& file, ModelRunner& r, const Config& cfg) {
  const LoraConfig& l = cfg.lora;
  const int64_t rank = in.attr_int("lora.rank");
  const double alpha = in.attr_double("lora.alpha");
  const std::string targets = in.attr_string("lora.targets");
  auto refuse = [&](const char* field, const std::string& saved, const std::string& now) {
    fail("checkpoint {} holds adapters of {} = {}; this run has {} = {}: resume with the lora settings the adapters "
         "were trained with", file, field, saved, field, now);
  };
  if (rank != l.rank) refuse("lora.rank", std::to_string(rank), std::to_string(l.rank));
  if (alpha != l.alpha) refuse("lora.alpha", fmt::format("{}", alpha), fmt::format("{}", l.alpha));
  const bool rslora = in.has_attr("lora.rslora") && in.attr_int("lora.rslora") != 0;  // absent: saved before rsLoRA
  if (rslora != l.rslora) refuse("lora.rslora", fmt::format("{}", rslora), fmt::format("{}", l.rslora));
  if (lora_target_set(targets) != lora_target_set(l.targets)) refuse("lora.targets", targets, l.targets);
  const AdapterBase saved{in.attr_string("lora.base_format"), in.attr_string("lora.base_path")};
  const std::string want = in.attr_string("lora.base_checksum"), have = base_checksum(r);
  if (want != have)
    fail("{} (base checksum {}); this run's base is {} (checksum {}), a different model: resume on the base the "
         "adapters were trained on (checkpoint.init_from_{} = {}), or start new adapters without checkpoint.load",
         trained_on(file, saved), want, base_of(cfg).describe(), have,
         saved.format == "init" ? "*" : saved.format, saved.path.empty() ? "unset" : saved.path);
}

AdapterBase read_adapter_base(const std::string& root, std::string* checksum) {
  const std::string file = resolve_checkpoint(root);
  CheckpointReader in(MPI_COMM_SELF, file);
  if (!in.has_attr("lora.rank"))
    fail("checkpoint {} holds a full model, not LoRA adapters: to fine-tune it with LoRA pass it as "
         "checkpoint.init_from_checkpoint (--init-from-checkpoint {}), not checkpoint.load", file, root);
  if (checksum) *checksum = in.attr_string("lora.base_checksum");
  return {in.attr_string("lora.base_format"), in.attr_string("lora.base_path")};
}

void adopt_adapter_base(Config& cfg) {
  CheckpointConfig& k = cfg.checkpoint;
  if (cfg.lora.rank == 0 || k.load.empty() || !k.init_from_hf.empty() || !k.init_from_llmc.empty() ||
      !k.init_from_checkpoint.empty())
    return;
  const AdapterBase b = read_adapter_base(k.load);
  if (b.format == "init") return;
  if (!std::filesystem::exists(b.path))
    fail("{}, which no longer exists; pass that base (or a copy of it) with checkpoint.init_from_{}",
         trained_on(resolve_checkpoint(k.load), b), b.format);
  (b.format == "hf" ? k.init_from_hf : b.format == "llmc" ? k.init_from_llmc : k.init_from_checkpoint) = b.path;
}

void adopt_peft_base(Config& cfg) {
  CheckpointConfig& k = cfg.checkpoint;
  if (k.init_from_peft.empty() || !k.init_from_hf.empty() || !k.init_from_llmc.empty() ||
      !k.init_from_checkpoint.empty())
    return;
  const std::string base = peft_base_model(k.init_from_peft);
  if (base.empty() || !std::filesystem::exists(std::filesystem::path(base) / "config.json"))
    fail("checkpoint.init_from_peft = {}: its base_model_name_or_path is {}, not a Hugging Face model directory "
         "here; pass the base the adapter was trained on with --init-from-hf (or another checkpoint.init_from_*)",
         k.init_from_peft, base.empty() ? "null" : "'" + base + "'");
  k.init_from_hf = base;
}

void adopt_peft_lora(Config& cfg) {
  if (cfg.checkpoint.init_from_peft.empty()) return;
  const LoraConfig peft = read_peft_config(cfg.checkpoint.init_from_peft, cfg.model);
  LoraConfig& l = cfg.lora;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (peft.dropout != 0 && rank == 0)  // a training setting, not part of the adapter's function
    log_line("lora: warning: the PEFT adapter {} was trained with lora_dropout = {}; mpigpt fine-tunes it without "
             "dropout (lora.dropout = 0)", cfg.checkpoint.init_from_peft, peft.dropout);
  if (l.rank == 0) {
    l.rank = peft.rank;
    l.alpha = peft.alpha;
    l.rslora = peft.rslora;
    l.targets = peft.targets;
    return;
  }
  auto refuse = [&](const char* field, const std::string& ours, const std::string& theirs) {
    fail("{} = {}, but the PEFT adapter checkpoint.init_from_peft = {} has {} (adapter_config.json); leave the lora "
         "settings out to take the adapter's, or give its own", field, ours, cfg.checkpoint.init_from_peft, theirs);
  };
  if (l.rank != peft.rank) refuse("lora.rank", std::to_string(l.rank), std::to_string(peft.rank));
  if (l.alpha != peft.alpha) refuse("lora.alpha", fmt::format("{}", l.alpha), fmt::format("{}", peft.alpha));
  if (l.rslora != peft.rslora) refuse("lora.rslora", fmt::format("{}", l.rslora), fmt::format("{}", peft.rslora));
  if (lora_target_set(l.targets) != lora_target_set(peft.targets)) refuse("lora.targets", l.targets, peft.targets);
}

TensorMap load_base_tensors(const AdapterBase& base, const Config& cfg, const GptDims& d) {
  TensorMap w;
  int vocab = d.V;
  if (base.format == "hf") {
    read_hf_config(base.path, &vocab);
    w = load_hf_model(base.path, cfg.model, vocab, vocab);
  } else if (base.format == "llmc") {
    w = read_llmc_model(base.path, nullptr, &vocab, nullptr);
  } else if (base.format == "checkpoint") {
    Config saved;
    w = read_model_tensors(base.path, &saved, "the base checkpoint " + base.path);
    vocab = saved.model.vocab_size;
  } else {
    for (const ParamInfo& p : base_params(d)) {
      HostTensor& t = w[p.name];
      t.shape = p.global;
      t.data.resize(size_t(p.global.numel()));
      init_param(p, cfg.training.seed, t.data.data());
    }
    return w;
  }
  grow_vocab(w, vocab, d.V, d.Vp, base.path);
  return w;
}

void merge_adapters(TensorMap& model, const TensorMap& adapters, const LoraDims& lora) {
  const double s = lora.scale();  // the float the adapted model scales by
  for (const auto& [name, A] : adapters) {
    if (!name.ends_with(".lora_A.weight")) continue;
    const std::string stem = name.substr(0, name.size() - std::string(".lora_A.weight").size());
    auto b = adapters.find(stem + ".lora_B.weight");
    auto w = model.find(stem + ".weight");
    if (b == adapters.end() || w == model.end())
      fail("adapter {} has no lora_B or no base weight {}.weight", name, stem);
    const HostTensor& B = b->second;
    HostTensor& W = w->second;
    // A routed expert's adapters (E, r, in), (E, out, r) and weight (E, out, in): W_e += s B_e A_e.
    const int n = A.shape.ndim;
    const bool expert = n == 3;
    bool fits = (n == 2 || expert) && B.shape.ndim == n && W.shape.ndim == n;
    const int64_t E = expert ? A.shape[0] : 1, r = A.shape[expert ? 1 : 0], in = A.shape[expert ? 2 : 1],
                  out = fits ? B.shape[expert ? 1 : 0] : 0;
    fits = fits && B.shape[expert ? 2 : 1] == r && W.shape[expert ? 1 : 0] == out && W.shape[expert ? 2 : 1] == in &&
           (!expert || (B.shape[0] == E && W.shape[0] == E));
    if (!fits)
      fail("adapter {}: A {} and B {} do not fit the weight {}", stem, A.shape.str(), B.shape.str(), W.shape.str());
    for (int64_t e = 0; e < E; ++e) {
      const float *Ae = A.data.data() + e * r * in, *Be = B.data.data() + e * out * r;
      float* We = W.data.data() + e * out * in;
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          double acc = 0;
          for (int64_t k = 0; k < r; ++k) acc += double(Be[o * r + k]) * double(Ae[k * in + i]);
          We[o * in + i] = float(double(We[o * in + i]) + s * acc);
        }
    }
  }
}

MergeSummary merge_lora_checkpoint(const std::string& in, const std::string& out) {
  MergeSummary m;
  m.adapters_file = resolve_checkpoint(in, "mpigpt convert --merge-lora " + in);
  std::string want;
  m.base = read_adapter_base(in, &want);
  Config cfg;
  const TensorMap adapters = read_model_tensors(in, &cfg, "mpigpt convert --merge-lora " + in);
  CheckpointMeta meta;
  {
    CheckpointReader r(MPI_COMM_SELF, m.adapters_file);
    meta.iteration = r.attr_int("iteration");
    meta.consumed_samples = r.attr_int("consumed_samples");
    meta.consumed_tokens = r.attr_int("consumed_tokens");
    meta.lr = r.attr_double("lr");
  }
  cfg.parallel = ParallelConfig{};  // whole tensors in the single-rank padding
  cfg.engine.distributed_optimizer = false;
  const GptDims d = make_dims(cfg, cfg.model.vocab_size);
  TensorMap model = load_base_tensors(m.base, cfg, d);
  if (const std::string have = base_checksum(model, d); have != want)
    fail("mpigpt convert --merge-lora: the adapters of {} were trained on {} with checksum {}; it has checksum {} "
         "now: it changed since; merge them on the base they were trained on", m.adapters_file, m.base.describe(),
         want, have);
  merge_adapters(model, adapters, d.lora);
  Config full = cfg;
  full.lora = LoraConfig{};
  full.checkpoint = CheckpointConfig{};
  write_model_checkpoint(out, model, full, make_dims(full, full.model.vocab_size), m.adapters_file, meta);
  m.iteration = meta.iteration;
  m.adapters = int64_t(adapters.size() / 2);
  m.rank = d.lora.rank;
  m.scale = d.lora.scale();
  return m;
}

}  // namespace mpigpt
