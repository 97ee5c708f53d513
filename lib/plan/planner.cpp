// `mpigpt plan`'s engine: enumerate, fit by the memory model, price by the time model (schedules
// cached per (pp, vpp, micro-batches)), rank; and the advice when no layout fits.
#include "lib/plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <atomic>
#include <thread>

#include "lib/plan/memory.h"
#include "lib/plan/time_model.h"

namespace mpigpt {

namespace {

// The model's shape per tp (the padded vocabulary follows tp; nothing else of the layout changes it).
struct DimsCache {
  const DimsOf& dims;
  std::map<int, GptDims> by_tp;
  const GptDims& of(const Config& c) {
    const int key = c.parallel.tp;
    auto it = by_tp.find(key);
    if (it == by_tp.end()) it = by_tp.emplace(key, dims(c)).first;
    return it->second;
  }
};

int64_t required_bytes(const MemoryEstimate& m) {
  int64_t most = 0;
  for (const StageMemory& s : m.stages) most = std::max(most, s.required());
  return most;
}

// The least memory any layout of `req` needs on `gpus` GPUs (INT64_MAX: no valid layout), and that
// layout; the micro-batch and recompute, where not pinned, at their least-memory choices (1, full).
std::pair<int64_t, std::string> least_memory_on(const PlanRequest& req, int gpus, const DimsOf& dims) {
  DimsCache dc{dims, {}};
  ScheduleCache schedules;
  LayoutFix fix = req.fix;
  if (!fix.mb) fix.mb = 1;
  if (!fix.recompute) fix.recompute = "full";
  const Enumeration e = enumerate_layouts(req.base, gpus, req.per_node, req.global_batch, fix, dims);
  std::pair<int64_t, std::string> best{INT64_MAX, ""};
  for (const Config& c : e.layouts) {
    const int64_t need = required_bytes(estimate_memory(c, dc.of(c), gpus, &schedules));
    if (need < best.first) best = {need, layout_name(c, gpus)};
  }
  return best;
}

// The layout's name without its recompute mode.
std::string without_recompute(const Config& c, int gpus) {
  Config k = c;
  k.engine.recompute.clear();
  return layout_name(k, gpus);
}

std::string gib(double bytes) { return fmt::format("{:.1f} GiB", bytes / (1024.0 * 1024 * 1024)); }

// One pricing thread's caches and results.
struct Worker {
  DimsCache dims;
  ScheduleCache schedules;
  std::vector<std::pair<size_t, PlanRow>> rows;  // (enumeration index, row)
  int64_t dominated = 0, out_of_memory = 0;
  std::string oom_example;
  std::optional<std::pair<size_t, PlanRow>> least;
  explicit Worker(const DimsOf& d) : dims{d, {}} {}
};

// Prices one group of layouts differing only in recompute, lightest first. Recompute only adds
// work: once one fits, the heavier ones are never faster and are not priced.
void price_group(const PlanRequest& req, const std::vector<Config>& layouts, const std::vector<size_t>& group, Worker& w) {
  bool fitted = false;
  for (size_t i : group) {
    const Config& c = layouts[i];
    if (fitted) {
      ++w.dominated;
      continue;
    }
    const GptDims& d = w.dims.of(c);
    const MemoryEstimate mem = estimate_memory(c, d, req.gpus, &w.schedules);
    PlanRow row;
    row.memory = required_bytes(mem);
    if (double(row.memory) > req.memory_bytes) {
      if (w.out_of_memory++ == 0)
        w.oom_example = fmt::format("{} needs {} per rank, the device has {}", layout_name(c, req.gpus),
                                    gib(double(row.memory)), gib(req.memory_bytes));
      if (!w.least || row.memory < w.least->second.memory) w.least = std::make_pair(i, PlanRow{c, row.memory});
      continue;
    }
    fitted = true;
    const TimeEstimate t = estimate_time(c, d, req.gpus, req.per_node, req.device, &w.schedules, &mem);
    row.step = t.step;
    row.tokens_per_s = double(c.training.global_batch) * c.model.seq_len / t.step;
    row.tflops_per_gpu = model_flops_per_step(c, d) / t.step / req.gpus / 1e12;
    row.mfu = req.device.peak_flops > 0 ? row.tflops_per_gpu * 1e12 / req.device.peak_flops : 0;
    row.bubble = t.bubble, row.exposed = t.exposed_comm();
    row.cfg = c;
    w.rows.emplace_back(i, std::move(row));
  }
}

void merge(PlanResult& out, Worker& w, std::vector<std::pair<size_t, PlanRow>>& rows) {
  out.dominated += w.dominated;
  if (w.out_of_memory > 0) {
    if (!out.rejected.count("memory")) out.example["memory"] = w.oom_example;
    out.rejected["memory"] += w.out_of_memory;
  }
  if (w.least && (!out.least_memory || w.least->second.memory < out.least_memory->memory))
    out.least_memory = w.least->second;
  for (auto& r : w.rows) rows.push_back(std::move(r));
}

}  // namespace

double model_flops_per_step(const Config& cfg, const GptDims& d) {
  return d.train_flops_per_token() * double(cfg.training.global_batch) * double(cfg.model.seq_len);
}

PlanResult run_plan(const PlanRequest& req, const DimsOf& dims, const PlanProgress& progress) {
  const auto start = std::chrono::steady_clock::now();
  PlanResult out;
  Enumeration e = enumerate_layouts(req.base, req.gpus, req.per_node, req.global_batch, req.fix, dims);
  out.considered = e.considered, out.valid = int64_t(e.layouts.size());
  out.rejected = e.rejected, out.example = e.example;
  // Groups of layouts that differ only in recompute, in enumeration order (none, selective, full).
  std::vector<std::vector<size_t>> groups;
  std::map<std::string, size_t> group_of;
  for (size_t i = 0; i < e.layouts.size(); ++i) {
    auto [it, fresh] = group_of.emplace(without_recompute(e.layouts[i], req.gpus), groups.size());
    if (fresh) groups.emplace_back();
    groups[it->second].push_back(i);
  }
  // Workers take whole groups; each has its own caches. The first one reports progress.
  const size_t n = std::max<size_t>(1, std::min<size_t>({std::thread::hardware_concurrency(), 8, groups.size()}));
  std::vector<Worker> workers(n, Worker{dims});
  std::atomic<size_t> next{0}, done{0};
  auto work = [&](size_t w) {
    for (size_t g; (g = next++) < groups.size();) {
      price_group(req, e.layouts, groups[g], workers[w]);
      done += groups[g].size();
      if (w == 0 && progress) progress(done, e.layouts.size());
    }
  };
  std::vector<std::thread> threads;
  for (size_t w = 1; w < n; ++w) threads.emplace_back(work, w);
  work(0);
  for (std::thread& t : threads) t.join();
  if (progress) progress(e.layouts.size(), e.layouts.size());
  std::vector<std::pair<size_t, PlanRow>> rows;
  for (Worker& w : workers) merge(out, w, rows);
  // Fastest first; ties in enumeration order, so that the result does not depend on the threads.
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a.second.step != b.second.step ? a.second.step < b.second.step : a.first < b.first;
  });
  for (auto& r : rows) out.rows.push_back(std::move(r.second));
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

std::vector<std::string> plan_advice(const PlanRequest& req, const PlanResult& result, const DimsOf& dims) {
  std::vector<std::string> lines;
  if (!result.rows.empty()) return lines;
  if (result.valid == 0) {
    lines.push_back(fmt::format("no layout of {} GPUs passes the configuration's checks (the reasons above); "
                                "change --gpus, --global-batch or --fix", req.gpus));
  } else if (result.least_memory) {
    lines.push_back(fmt::format("the layout needing least memory, {}, needs {} per rank; the device has {}",
                                layout_name(result.least_memory->cfg, req.gpus),
                                gib(double(result.least_memory->memory)), gib(req.memory_bytes)));
  }
  // Unpinned fields: full recompute, a micro-batch of 1, or any other pinned field set free.
  struct Try {
    const char* what;
    bool pinned;
    void (*clear)(LayoutFix&);
  };
  const Try tries[] = {
      {"engine.recompute = full (unpin recompute)", req.fix.recompute && *req.fix.recompute != "full",
       [](LayoutFix& f) { f.recompute = "full"; }},
      {"a smaller micro-batch (unpin mb)", req.fix.mb && *req.fix.mb > 1, [](LayoutFix& f) { f.mb.reset(); }},
      {"the distributed optimizer (unpin distopt)", req.fix.distopt && !*req.fix.distopt, [](LayoutFix& f) { f.distopt.reset(); }},
      {"other tp/pp/cp/vpp/dp (unpin them)", req.fix.tp || req.fix.pp || req.fix.cp || req.fix.vpp || req.fix.dp,
       [](LayoutFix& f) { f.tp.reset(), f.pp.reset(), f.cp.reset(), f.vpp.reset(), f.dp.reset(); }},
  };
  for (const Try& t : tries) {
    if (!t.pinned) continue;
    PlanRequest r = req;
    t.clear(r.fix);
    const auto [need, name] = least_memory_on(r, req.gpus, dims);
    if (double(need) <= req.memory_bytes)
      lines.push_back(fmt::format("fits on {} GPUs with {}: {} needs {}", req.gpus, t.what, name, gib(double(need))));
  }
  // More GPUs, whole nodes at a time, with every field as pinned.
  for (int k = 2; k <= 64; k *= 2) {
    const int gpus = req.gpus * k;
    const auto [need, name] = least_memory_on(req, gpus, dims);
    if (double(need) <= req.memory_bytes) {
      lines.push_back(fmt::format("fits on {} GPUs ({} nodes of {}): {} needs {} per rank", gpus, gpus / req.per_node,
                                  req.per_node, name, gib(double(need))));
      break;
    }
    if (k == 64) lines.push_back(fmt::format("nothing fits on up to {} GPUs either", gpus));
  }
  return lines;
}

}  // namespace mpigpt
