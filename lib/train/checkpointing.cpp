// Saving and loading checkpoints: names, boxes, metadata, `latest` and retention.
#include "lib/train/checkpointing.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "lib/core/error.h"
#include "lib/core/new_file.h"
#include "lib/train/adapter_checkpoint.h"

namespace mpigpt {

namespace fs = std::filesystem;

std::vector<LocalBox> global_boxes(const ParamInfo& p, int64_t begin, int64_t end) {
  // Local boxes of the parameter's matrix view (rows x last dimension), mapped to global boxes of
  // the global matrix view, then to the checkpoint API's view (first dimension x the rest), which
  // differs only for tensors of three or more dimensions.
  const int64_t cols = p.cols(), rows = p.numel() / cols;
  const int64_t gcols = p.global_cols(), inner = p.global.ndim > 1 ? p.global.numel() / p.global[0] : 1;
  const int64_t mrows_per_row = inner / gcols;  // matrix-view rows per first-dimension index
  std::vector<LocalBox> out;
  auto emit = [&](int64_t grow, int64_t nrows, int64_t gcol, int64_t ncols, int64_t local) {
    if (mrows_per_row == 1) return out.push_back({Box{grow, nrows, gcol, ncols}, local});
    if (ncols == gcols) {  // whole rows: one flat range of the global tensor
      for (const Box& b : flat_range_boxes(p.global[0], inner, grow * gcols, (grow + nrows) * gcols))
        out.push_back({b, local}), local += b.numel();
      return;
    }
    for (int64_t r = grow; r < grow + nrows; ++r, local += ncols)  // a column range: one box per row
      out.push_back({Box{r / mrows_per_row, 1, (r % mrows_per_row) * gcols + gcol, ncols}, local});
  };
  for (const Box& b : flat_range_boxes(rows, cols, begin, end)) {
    // A local box is contiguous (whole local rows, or part of one); its rows may straddle
    // the row blocks that map local rows to global ones.
    if (p.row_blocks.empty()) {
      emit(b.row0, b.rows, b.col0 + p.col_begin, b.cols, b.row0 * cols + b.col0);
      continue;
    }
    int64_t local_first = 0;
    for (const auto& [global_first, count] : p.row_blocks) {
      const int64_t lo = std::max(b.row0, local_first), hi = std::min(b.row0 + b.rows, local_first + count);
      if (lo < hi) emit(global_first + (lo - local_first), hi - lo, b.col0 + p.col_begin, b.cols, lo * cols + b.col0);
      local_first += count;
    }
  }
  return out;
}

std::string checkpoint_dir_name(int64_t iteration) { return fmt::format("iter_{:07d}", iteration); }

namespace {

const char* kFile = "checkpoint.h5";

std::string model_name(const std::string& p) { return "model/" + p; }
std::string moment_name(int k, const std::string& p) { return (k == 0 ? "optimizer/exp_avg/" : "optimizer/exp_avg_sq/") + p; }

// The model's shape as stored and compared on load: a checkpoint of another shape is refused
// naming the field.
std::vector<std::pair<std::string, int64_t>> shape_attrs(const GptDims& d) {
  return {{"model.num_layers", d.L}, {"model.hidden", d.C},       {"model.num_heads", d.NH},
          {"model.num_kv_heads", d.NKV}, {"model.ffn_hidden", d.F}, {"model.vocab_size", d.V},
          {"model.max_position", d.gpt2() ? d.maxT : 0}, {"model.tie_embeddings", d.tied ? 1 : 0}};
}

// The mixture-of-experts shape: stored by saves of MoE models, compared when the save has it (a
// save without it is dense: num_experts 0).
std::vector<std::pair<std::string, int64_t>> moe_shape_attrs(const GptDims& d) {
  int64_t layers = 0;  // bit l: layer l is a MoE layer
  for (int l = 0; l < d.L && l < 63; ++l)
    if (d.is_moe(l)) layers |= int64_t{1} << l;
  return {{"model.num_experts", d.moe.E},
          {"model.moe_ffn_hidden", d.moe.E > 0 ? d.moe.F : 0},
          {"model.moe_shared_expert_ffn", d.moe.E > 0 ? d.moe.shared_F : 0},
          {"model.moe_layer_mask", layers}};
}

// Every rank has to name every dataset in the same order (collective HDF5), also those of
// other pipeline stages: the whole model's table in this layout's vocabulary padding. A LoRA
// run saves and loads its adapters only (the base is frozen and comes from where it started).
std::vector<ParamInfo> global_table(const GptDims& d) {
  std::vector<ParamInfo> t = build_param_table(d);
  if (d.lora.on()) std::erase_if(t, [](const ParamInfo& p) { return !is_lora_param(p.name); });
  return t;
}

// The rows of p that hold data (vocabulary padding excluded): loading into another tp size
// changes the padding, so only the real rows are read.
int64_t valid_rows(const ParamInfo& p) { return p.valid_rows >= 0 ? p.valid_rows : p.global[0]; }

// This rank's pieces of the model tensor `name` (nothing when another rank writes it).
struct Plan {
  std::vector<Piece> params;
  std::vector<Piece> moments[2];
};

// Which parameter and state pieces this rank writes (or reads) for each global name.
// The state a checkpoint reads and writes, seen from the host: the model's and optimizer's own
// memory on the CPU backend; on a GPU host copies of the three flat buffers (parameters, Adam m and
// v), each staged by one copy, since HDF5 writes from and reads into host memory.
class HostState {
 public:
  explicit HostState(ModelRunner& r) : ops_(r.ops()), model_(r.model()) {
    const Tensor t[3] = {r.model().params_flat(), r.optimizer().m(), r.optimizer().v()};
    for (int k = 0; k < 3; ++k) {
      dev_[k] = t[k];
      if (t[k].device == Device::CPU) {
        base_[k] = t[k].f32();
      } else {
        host_[k].resize(size_t(t[k].numel()));
        base_[k] = host_[k].data();
      }
    }
  }
  float* params() const { return base_[0]; }
  float* moment(int k) const { return base_[1 + k]; }
  // device -> host before writing, host -> device after reading (no-ops on the CPU backend).
  void download() {
    for (int k = 0; k < 3; ++k)
      if (!host_[k].empty()) ops_.copy(Tensor(host_[k].data(), dev_[k].shape), dev_[k]);
  }
  void upload() {
    for (int k = 0; k < 3; ++k)
      if (!host_[k].empty()) ops_.copy(dev_[k], Tensor(host_[k].data(), dev_[k].shape));
    model_.params_changed();
  }

 private:
  Ops& ops_;
  GPT& model_;
  Tensor dev_[3];
  float* base_[3] = {};
  std::vector<float> host_[3];
};

std::vector<Plan> make_plans(ModelRunner& r, const HostState& host, const std::vector<ParamInfo>& global,
                             bool reading) {
  GPT& m = r.model();
  const auto& table = m.params();
  std::vector<Plan> plans(global.size());
  auto index_of = [&](const ParamInfo& p) {  // -1: not saved (LoRA's frozen base)
    for (size_t g = 0; g < global.size(); ++g)
      if (global[g].name == p.name) return int(g);
    if (!p.frozen) fail("parameter {} is not in the model's table", p.name);
    return -1;
  };
  // Reading drops the vocabulary padding rows (the padding follows the tp size, so another
  // layout may have more or fewer); writing stores them (zeros) so the dataset is complete.
  auto clip = [reading](const ParamInfo& p, const LocalBox& lb) {
    LocalBox c = lb;
    if (!reading) return c;
    const int64_t end = std::min(c.box.row0 + c.box.rows, valid_rows(p));
    c.box.rows = std::max<int64_t>(0, end - c.box.row0);
    return c;
  };
  for (size_t i = 0; i < table.size(); ++i) {
    const ParamInfo& p = table[i];
    // Replicated data is written once; every holder reads it. The tied replica is stage 0's
    // word embedding: it is read like it but never written.
    const int g = index_of(p);
    if (g < 0 || (!reading && !r.writes_param(p))) continue;
    float* w = host.params() + p.offset;
    for (const LocalBox& lb : global_boxes(p, 0, p.numel())) {
      const LocalBox c = clip(p, lb);
      if (c.box.rows > 0) plans[g].params.push_back({c.box, w + c.local});
    }
  }
  for (const auto& piece : r.optimizer().pieces()) {
    const ParamInfo& p = table[piece.param];
    const int g = index_of(p);
    if (g < 0 || (!reading && !r.writes_state(p))) continue;
    const int64_t begin = piece.begin - p.offset;
    for (const LocalBox& lb : global_boxes(p, begin, begin + piece.count)) {
      const LocalBox c = clip(p, lb);
      if (c.box.rows == 0) continue;
      for (int k = 0; k < 2; ++k)
        plans[g].moments[k].push_back({c.box, host.moment(k) + piece.state + (c.local - begin)});
    }
  }
  return plans;
}

Shape stored_shape(const ParamInfo& p) { return p.global; }

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) fail("cannot open {} to sync it", path);
  ::fsync(fd);
  ::close(fd);
}

// Rank 0 does a file-system step; every rank learns whether it worked (no rank waits alone).
template <class F>
void on_rank0(const Comm& world, const std::string& what, F&& f) {
  std::string err;
  if (world.rank() == 0) {
    try {
      f();
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  int64_t failed = err.empty() ? 0 : 1;
  world.allreduce_sum(&failed, 1);
  if (failed) fail("{}{}", what, err.empty() ? std::string(" failed on rank 0") : ": " + err);
}

void write_meta(CheckpointWriter& w, const CheckpointMeta& meta, const Config& cfg, const GptDims& d, int64_t step,
                const std::string& layout) {
  w.attr("iteration", meta.iteration);
  w.attr("consumed_samples", meta.consumed_samples);
  w.attr("consumed_tokens", meta.consumed_tokens);
  w.attr("lr", meta.lr);
  w.attr("optimizer.step", step);
  // The generators are counter-based (weights and data drawn by (seed, index)): the seed and
  // the sampler position are their whole state.
  w.attr("rng.seed", int64_t(cfg.training.seed));
  w.attr("data.sampler_position", meta.consumed_samples);
  w.attr("model.family", cfg.model.family);
  for (const auto& [k, v] : shape_attrs(d)) w.attr(k, v);
  w.attr("model.qkv_bias", int64_t(d.qkv_bias));
  if (d.moe.E > 0)
    for (const auto& [k, v] : moe_shape_attrs(d)) w.attr(k, v);
  w.attr("config", cfg.to_ini());
  w.attr("layout", layout);
}

// Points root/latest at `name` atomically (rank 0 only).
void point_latest(const std::string& root, const std::string& name) {
  NewFile latest(root + "/latest");
  latest.write(name + "\n");
  latest.commit(true);  // atomic: `latest` names a complete save at every moment
}

// Writes the save of `meta` into `file` and checks that it opens and holds every dataset.
void write_save(const std::string& file, const CheckpointMeta& meta, ModelRunner& r, const Config& cfg,
                const SaveHook& midway) {
  const Comm& world = r.mesh().world();
  const GptDims& d = r.model().dims();
  const std::vector<ParamInfo> global = global_table(d);
  const std::string base = d.lora.on() ? base_checksum(r) : std::string();
  r.gather_masters();  // a bf16 gather left other ranks' slices of the f32 masters stale
  {
    HostState host(r);
    host.download();
    std::vector<Plan> plans = make_plans(r, host, global, false);
    CheckpointWriter w(world.mpi(), file);
    for (size_t g = 0; g < global.size(); ++g) w.write(model_name(global[g].name), stored_shape(global[g]), plans[g].params);
    for (int k = 0; k < 2; ++k)
      for (size_t g = 0; g < global.size(); ++g)
        w.write(moment_name(k, global[g].name), stored_shape(global[g]), plans[g].moments[k]);
    const ParallelConfig& pc = cfg.parallel;
    write_meta(w, meta, cfg, d, r.optimizer().steps(),
               fmt::format("{} ranks: tp {} pp {} vpp {} (layers per virtual stage {}) cp {} ep {} expert_tp {} dp {} "
                           "(order {}), sequence parallel {}, distributed optimizer {}", world.size(), pc.tp, pc.pp,
                           pc.vpp, fmt::join(pipeline_layers(pc, cfg.model.num_layers), ","), pc.cp, pc.ep,
                           pc.expert_tp, r.mesh().dp_size(), pc.order, pc.sequence_parallel ? "on" : "off",
                           cfg.engine.distributed_optimizer ? "on" : "off"));
    if (d.lora.on()) write_adapter_attrs(w, cfg, base);
    if (midway) midway(meta.iteration);
    w.close();
  }
  CheckpointReader check(world.mpi(), file);
  for (const auto& p : global)
    for (const std::string& n : {model_name(p.name), moment_name(0, p.name), moment_name(1, p.name)})
      if (!(check.shape(n) == stored_shape(p))) fail("checkpoint {}: dataset {} was not written completely", file, n);
}

// Moves the complete save `partial` to its name `dir` (replacing an older save of that iteration
// in one step, so that `latest` never names a missing directory).
void move_into_place(const std::string& partial, const std::string& dir) {
  if (!fs::exists(dir)) return fs::rename(partial, dir);
  if (::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) != 0)
    fail("cannot replace the older save {} ({})", dir, std::strerror(errno));
  fs::remove_all(partial);  // now the older save
}

// What a failed save left and what to do, for its message.
std::string after_failed_save(const std::string& root, const std::string& partial, int64_t bytes) {
  std::ifstream in(root + "/latest");
  std::string latest;
  in >> latest;
  return fmt::format("The save was not completed: {} was removed and {}. A save takes at least {:.1f} MiB: make room "
                     "for it there or choose another checkpoint.save, then resume.", partial,
                     latest.empty() ? "there is no complete save in " + root + " yet"
                                    : root + "/latest still names " + latest,
                     bytes / 1048576.0);
}

}  // namespace

int64_t checkpoint_bytes(const GptDims& d) {
  int64_t n = 0;
  for (const ParamInfo& p : global_table(d)) n += p.global.numel();
  return n * 3 * int64_t(sizeof(float));  // weights and the two Adam moments, fp32
}

SaveStats save_checkpoint(const std::string& root, const CheckpointMeta& meta, ModelRunner& r, const Config& cfg,
                          int keep_last, const SaveHook& midway) {
  const auto t0 = std::chrono::steady_clock::now();
  const Comm& world = r.mesh().world();
  const std::string name = checkpoint_dir_name(meta.iteration), dir = root + "/" + name;
  const std::string partial = dir + ".partial";  // marked as incomplete until it is renamed
  on_rank0(world, "checkpoint.save: cannot create " + partial, [&] {
    fs::remove_all(partial);  // left by a save that was killed
    fs::create_directories(partial);
  });
  try {
    write_save(partial + "/" + kFile, meta, r, cfg, midway);
  } catch (const std::exception& e) {
    if (world.rank() == 0) {
      std::error_code ec;
      fs::remove_all(partial, ec);
    }
    fail("{}\n{}", e.what(), after_failed_save(root, partial, checkpoint_bytes(r.model().dims())));
  }
  int64_t bytes = 0;
  on_rank0(world, "checkpoint.save: cannot complete the save " + dir, [&] {
    bytes = int64_t(fs::file_size(partial + "/" + kFile));
    move_into_place(partial, dir);
    fsync_path(root, true);
    point_latest(root, name);
    if (keep_last > 0) {
      std::vector<std::string> saves;
      for (const auto& e : fs::directory_iterator(root))
        if (const std::string n = e.path().filename().string();
            e.is_directory() && n.rfind("iter_", 0) == 0 && n.find('.') == std::string::npos)
          saves.push_back(n);
      std::sort(saves.begin(), saves.end());
      for (size_t i = 0; i + size_t(keep_last) < saves.size(); ++i)
        if (saves[i] != name) fs::remove_all(root + "/" + saves[i]);
    }
  });
  world.allreduce_sum(&bytes, 1);
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), bytes};
}

std::string resolve_checkpoint(const std::string& root, const std::string& given) {
  if (fs::exists(root + "/" + kFile)) return root + "/" + kFile;
  const std::string latest = root + "/latest";
  std::ifstream in(latest);
  if (!in)
    fail("{}: no {} (it names the newest complete save) and no {} there; pass the directory given to "
         "--checkpoint.save or one of its iter_NNNNNNN directories",
         given.empty() ? "checkpoint.load = " + root : given, latest, kFile);
  std::string name;
  in >> name;
  const std::string file = root + "/" + name + "/" + kFile;
  if (name.empty() || !fs::exists(file))
    fail("{} names '{}', but {} does not exist; the save directory is damaged: pass an iter_NNNNNNN directory "
         "instead", latest, name, file);
  return file;
}

void check_save_dir(const Comm& world, const std::string& root, int64_t bytes) {
  on_rank0(world, fmt::format("checkpoint.save = {} cannot take a save", root), [&] {
    std::error_code ec;
    fs::create_directories(root, ec);
    if (ec) fail("cannot create it ({}); choose a directory this job can write", ec.message());
    const std::string probe = fmt::format("{}/.write_probe.{}", root, ::getpid());
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0600);
    if (fd < 0)
      fail("cannot create a file in it ({}); choose a directory this job can write, or fix its permissions",
           std::strerror(errno));
    ::close(fd);
    fs::remove(probe);
    struct statvfs sv {};
    const int64_t free_bytes = ::statvfs(root.c_str(), &sv) == 0 ? int64_t(sv.f_bavail) * int64_t(sv.f_frsize) : bytes;
    if (free_bytes < bytes)
      fail("one save takes at least {:.1f} MiB and its file system has {:.1f} MiB free; make room there or choose "
           "another directory", bytes / 1048576.0, free_bytes / 1048576.0);
  });
}

CheckpointMeta load_checkpoint(const std::string& root, ModelRunner& r, const Config& cfg) {
  const Comm& world = r.mesh().world();
  const std::string file = resolve_checkpoint(root);
  CheckpointReader in(world.mpi(), file);
  const GptDims& d = r.model().dims();
  const std::string family = in.attr_string("model.family");
  if (family != cfg.model.family)
    fail("checkpoint {} holds a model.family = {} model; this run has model.family = {}: use the same model "
         "settings to resume", file, family, cfg.model.family);
  for (const auto& [k, v] : shape_attrs(d)) {
    const int64_t saved = in.attr_int(k);
    if (saved != v)
      fail("checkpoint {} was saved with {} = {}; this run has {} = {}: use the same model settings to load it",
           file, k, saved, k, v);
  }
  if (const int64_t saved = in.has_attr("model.qkv_bias") ? in.attr_int("model.qkv_bias") : 0; saved != d.qkv_bias)
    fail("checkpoint {} was saved with model.qkv_bias = {}; this run has model.qkv_bias = {}: use the same model "
         "settings to load it", file, saved ? "true" : "false", d.qkv_bias ? "true" : "false");
  for (const auto& [k, v] : moe_shape_attrs(d)) {
    const int64_t saved = in.has_attr(k) ? in.attr_int(k) : 0;
    if (saved != v)
      fail("checkpoint {} was saved with {} = {}; this run has {} = {}: use the same mixture-of-experts settings "
           "to load it", file, k, saved, k, v);
  }
  if (d.lora.on() && !in.has_attr("lora.rank"))
    fail("checkpoint {} holds a full model, not LoRA adapters: to fine-tune it with LoRA pass it as "
         "checkpoint.init_from_checkpoint (--init-from-checkpoint), not checkpoint.load", file);
  if (!d.lora.on() && in.has_attr("lora.rank"))
    fail("checkpoint {} holds LoRA adapters (lora.rank = {}), not a full model: resume it with the lora settings it "
         "records (mpigpt checkpoint info), or merge them into their base first (mpigpt convert --merge-lora)",
         file, in.attr_int("lora.rank"));
  if (d.lora.on()) check_adapter_load(in, file, r, cfg);
  const std::vector<ParamInfo> global = global_table(d);
  HostState host(r);
  host.download();  // what no dataset overwrites (the vocabulary padding) keeps its value
  std::vector<Plan> plans = make_plans(r, host, global, true);
  for (size_t g = 0; g < global.size(); ++g) {
    const ParamInfo& p = global[g];
    const std::string names[3] = {model_name(p.name), moment_name(0, p.name), moment_name(1, p.name)};
    const std::vector<Piece>* pieces[3] = {&plans[g].params, &plans[g].moments[0], &plans[g].moments[1]};
    for (int k = 0; k < 3; ++k) {
      const Shape s = in.shape(names[k]);
      // Only the vocabulary padding may differ (it follows the tensor-parallel size).
      const bool ok = s.ndim == p.global.ndim && s[0] >= valid_rows(p) &&
                      (s.ndim == 1 || s.numel() / s[0] == p.global.numel() / p.global[0]);
      if (!ok)
        fail("checkpoint {}: dataset {} has shape {}, this model needs {}; it was saved from a different model",
             file, names[k], s.str(), p.global.str());
      in.verify(names[k]);  // a damaged save is refused naming the dataset, not trained on
      in.read(names[k], *pieces[k]);
    }
  }
  host.upload();
  r.optimizer().set_steps(in.attr_int("optimizer.step"));
  CheckpointMeta meta;
  meta.iteration = in.attr_int("iteration");
  meta.consumed_samples = in.attr_int("consumed_samples");
  meta.consumed_tokens = in.attr_int("consumed_tokens");
  meta.lr = in.attr_double("lr");
  meta.saved_config = in.attr_string("config");
  return meta;
}

}  // namespace mpigpt

namespace mpigpt {

void load_weights(ModelRunner& r, const TensorMap& global, const std::string& source) {
  GPT& m = r.model();
  HostState host(r);
  host.download();
  for (size_t i = 0; i < m.params().size(); ++i) {
    const ParamInfo& p = m.params()[i];
    auto it = global.find(p.name);
    if (it == global.end() && is_lora_param(p.name)) continue;  // a base model: the adapters keep their init
    if (it == global.end()) fail("{} has no tensor {}; it holds a different model", source, p.name);
    if (!(it->second.shape == p.global))
      fail("{}: tensor {} has shape {}, this model needs {}; set the model options to match it", source, p.name,
           it->second.shape.str(), p.global.str());
    float* dst = host.params() + p.offset;
    const float* src = it->second.data.data();
    for (int64_t k = 0; k < p.numel(); ++k) dst[k] = src[p.global_index(k)];
  }
  host.upload();
}

namespace {

Config saved_config(const CheckpointReader& in, const std::string& file) {
  Config cfg = parse_config_text(in.attr_string("config"), file + " (its saved configuration)");
  cfg.model.vocab_size = int(in.attr_int("model.vocab_size"));  // 0 in the INI: it came from the tokenizer
  cfg.resolve_defaults();
  return cfg;
}

}  // namespace

Config read_checkpoint_config(const std::string& root, const std::string& given) {
  const std::string file = resolve_checkpoint(root, given);
  return saved_config(CheckpointReader(MPI_COMM_SELF, file), file);
}

TensorMap read_model_tensors(const std::string& root, Config* cfg, const std::string& given) {
  const std::string file = resolve_checkpoint(root, given);
  CheckpointReader in(MPI_COMM_SELF, file);
  TensorMap out;
  for (const std::string& n : in.names()) {
    if (n.rfind("model/", 0) != 0) continue;
    HostTensor t;
    t.shape = in.shape(n);
    t.data.resize(size_t(t.shape.numel()));
    const int64_t rows = t.shape[0], cols = t.shape.numel() / std::max<int64_t>(rows, 1);
    in.read(n, {Piece{Box{0, rows, 0, cols}, t.data.data()}});
    out[n.substr(6)] = std::move(t);
  }
  if (cfg) *cfg = saved_config(in, file);
  return out;
}

void write_model_checkpoint(const std::string& root, const TensorMap& model, const Config& cfg, const GptDims& d,
                            const std::string& source, const CheckpointMeta& meta) {
  const std::string name = checkpoint_dir_name(meta.iteration), dir = root + "/" + name, file = dir + "/" + kFile;
  fs::create_directories(dir);
  CheckpointWriter w(MPI_COMM_SELF, file);
  const std::vector<ParamInfo> table = global_table(d);
  std::vector<float> zeros;
  for (int k = -1; k < 2; ++k)
    for (const ParamInfo& p : table) {
      auto it = model.find(p.name);
      if (it == model.end()) fail("{} has no tensor {}", source, p.name);
      if (!(it->second.shape == p.global))
        fail("{}: tensor {} has shape {}, expected {}", source, p.name, it->second.shape.str(), p.global.str());
      const int64_t rows = p.global[0], cols = p.global.numel() / rows;
      float* data = const_cast<float*>(it->second.data.data());
      if (k >= 0) {  // Adam starts from zero moments at step 0
        zeros.assign(size_t(p.global.numel()), 0.0f);
        data = zeros.data();
      }
      w.write(k < 0 ? model_name(p.name) : moment_name(k, p.name), p.global, {Piece{Box{0, rows, 0, cols}, data}});
    }
  write_meta(w, meta, cfg, d, 0, "converted from " + source);
  w.close();
  point_latest(root, name);
}

}  // namespace mpigpt
