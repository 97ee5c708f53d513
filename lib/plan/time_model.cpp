// The time model: stage passes priced from the profile, the schedule simulated on them, then the
// gradient reduction, embedding sum and optimizer step with mpigpt's overlap rules.
#include "lib/plan/time_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "lib/core/error.h"
#include "lib/plan/comm_model.h"
#include "lib/plan/memory.h"
#include "lib/plan/shared_sim.h"
#include "lib/plan/step_work.h"
#include "parallel/rank_grid.h"
#include "parallel/schedule.h"

namespace mpigpt {

namespace {

struct Ctx {
  const Config& cfg;
  const GptDims& d;
  int world, per_node;
  const DeviceProfile& dev;
  bool shared;
  // Per group: its size and link (building the rank grid for each call dominated a planner's run).
  mutable std::map<std::string, std::pair<int, Link>> groups;
  const std::pair<int, Link>& group(const std::string& g) const {
    auto it = groups.find(g);
    if (it == groups.end())
      it = groups.emplace(g, std::make_pair(group_size(cfg, world, g), group_inside_node(cfg, world, per_node, g)
                                                                          ? dev.intra_node : dev.inter_node)).first;
    return it->second;
  }
  Link link(const std::string& g) const { return group(g).second; }
  double seconds(const CommCall& c) const {
    const auto& [size, l] = group(c.group);
    return call_seconds(c, size, l, dev.reduce_rate);
  }
};

// One micro-batch's forward or backward through one virtual stage.
struct Pass {
  double compute = 0, exposed = 0;
  std::map<std::string, double> comm, hidden;  // per group: all of it, and what compute hid
  double time() const { return compute + exposed; }
};

Pass stage_pass(const Ctx& x, std::pair<int, int> layers, bool embed, bool head, bool backward) {
  const auto [first, end] = layers;
  const Work w = backward ? backward_work(x.cfg, x.d, first, end, embed, head)
                          : forward_work(x.cfg, x.d, first, end, embed, head);
  Pass p;
  p.compute = w.seconds(x.dev);
  double ring = 0;
  for (const CommCall& c : stage_comm(x.cfg, x.d, first, end, embed, head, backward)) {
    const double t = x.seconds(c);
    p.comm[c.group] += t;
    if (c.group == "cp" && c.kind == CommKind::P2P) ring += t;
    else p.exposed += t;
  }
  // The context-parallel ring sends the next K/V block while the current one is computed; on shared
  // cores the copies take core time like everything else.
  const double hidden = x.shared ? 0.0 : std::min(ring, w.attention_seconds(x.dev));
  p.exposed += ring - hidden;
  if (ring > 0) p.hidden["cp"] = hidden;
  return p;
}

void add_group(std::map<std::string, GroupTime>& g, const std::string& name, double seconds, double exposed) {
  GroupTime& t = g[name];
  t.group = name;
  t.seconds += seconds;
  t.exposed += exposed;
}

// What a pipeline rank does after its last backward: gradient reduction (and the parameter
// gather with the distributed optimizer), the tied embedding's sum, the optimizer step.
struct After {
  double reduce = 0, gather = 0, embedding = 0, optimizer = 0;
  double reduce_exposed = 0, gather_exposed = 0;
  double work() const { return reduce + gather + embedding + optimizer; }
  double exposed() const { return reduce_exposed + gather_exposed + embedding + optimizer; }
};

After after_pipeline(const Ctx& x, const StageMemory& mem, int pp_rank, double last_backward, double first_forward) {
  const Config& cfg = x.cfg;
  const EngineConfig& e = cfg.engine;
  // The trained parameters' elements (LoRA: the adapters; the frozen base is neither reduced nor gathered).
  const double held = double(mem.grads) / 4, owned = double(mem.optimizer) / 8;
  const double grad_bytes = held * (e.grad_accum_dtype == "bf16" ? 2 : 4);
  After a;
  if (e.distributed_optimizer) {
    a.reduce = x.seconds({"dp_cp", CommKind::ReduceScatter, grad_bytes, 1});
    a.gather = x.seconds({"dp_cp", CommKind::AllGather, held * double(dtype_size(x.d.act)), 1});
  } else {
    a.reduce = x.seconds({"dp_cp", CommKind::AllReduce, grad_bytes, 1});
  }
  const int p = cfg.parallel.pp;
  if (p > 1 && x.d.tied && (pp_rank == 0 || pp_rank == p - 1))
    a.embedding = x.seconds({"embedding", CommKind::AllReduce, double(x.d.Vp / cfg.parallel.tp) * x.d.C * 4, 1});
  Work opt;
  opt.optimizer = owned, opt.grad_zero = held;
  a.optimizer = opt.other_seconds(x.dev);
  // Buckets reduce during the last micro-batch's backward (the last bucket after it) and gather
  // during the next step's first forward (the first bucket before it): mpigpt's two overlaps.
  const double bucket = std::min(1.0, double(e.bucket_size) / std::max(held, 1.0));
  a.reduce_exposed = a.reduce, a.gather_exposed = a.gather;
  if (!x.shared && e.overlap_grad_reduce) a.reduce_exposed = std::max(a.reduce - last_backward, a.reduce * bucket);
  if (!x.shared && e.overlap_param_gather) a.gather_exposed = std::max(a.gather - first_forward, a.gather * bucket);
  return a;
}

}  // namespace

double TimeEstimate::exposed_comm() const {
  double s = 0;
  for (const GroupTime& g : groups) s += g.exposed;
  return s;
}

// Each group's time on the pipeline rank that spends the most in it (seconds and exposed apart).
static std::vector<GroupTime> busiest_groups(const std::vector<std::map<std::string, GroupTime>>& per_rank,
                                             const Config& cfg, int world_size, int per_node) {
  std::map<std::string, GroupTime> most;
  for (const auto& rank : per_rank)
    for (const auto& [g, gt] : rank) {
      GroupTime& w = most[g];
      w.group = g;
      w.seconds = std::max(w.seconds, gt.seconds), w.exposed = std::max(w.exposed, gt.exposed);
    }
  std::vector<GroupTime> out;
  for (auto& [g, gt] : most) {
    if (gt.seconds <= 0) continue;
    gt.ranks = group_size(cfg, world_size, g);
    gt.inside_node = group_inside_node(cfg, world_size, per_node, g);
    out.push_back(gt);
  }
  return out;
}

TimeEstimate estimate_time(const Config& cfg, const GptDims& d, int world_size, int per_node,
                           const DeviceProfile& device, ScheduleCache* cache, const MemoryEstimate* memory) {
  const ParallelConfig& p = cfg.parallel;
  const Ctx x{cfg, d, world_size, per_node, device, device.shared_cores > 0, {}};
  const MemoryEstimate mem = memory ? *memory : estimate_memory(cfg, d, world_size, cache);
  const int m = mem.micro_batches, S = p.pp * p.vpp;
  TimeEstimate t;
  t.device = device.name, t.micro_batches = m, t.shared_cores = x.shared;
  const std::vector<int> stage_layers = pipeline_layers(p, d.L);
  std::vector<double> fwd(static_cast<size_t>(S)), bwd(static_cast<size_t>(S));
  std::vector<std::map<std::string, GroupTime>> per_rank(size_t(p.pp));
  t.stages.resize(size_t(p.pp));
  const double p2p = p.pp > 1 ? x.link("pp").seconds(p2p_bytes(cfg, d)) : 0.0;
  for (int r = 0; r < p.pp; ++r) {
    const auto chunks = layers_of_stage(stage_layers, p.pp, r);
    StageTime& st = t.stages[size_t(r)];
    st.pp_rank = r;
    for (size_t c = 0; c < chunks.size(); ++c) {
      const int s = virtual_stage(p.pp, r, int(c));
      const bool embed = s == 0, head = s == S - 1;
      Pass f = stage_pass(x, chunks[c], embed, head, false), b = stage_pass(x, chunks[c], embed, head, true);
      if (device.blocking_p2p && p2p > 0) {  // each send waits for its transfer: part of the pass
        if (!head) f.comm["pp"] += p2p, f.exposed += p2p;
        if (!embed) b.comm["pp"] += p2p, b.exposed += p2p;
      }
      // On shared cores communication is core work that nothing hides.
      fwd[size_t(s)] = x.shared ? f.compute + f.exposed : f.time();
      bwd[size_t(s)] = x.shared ? b.compute + b.exposed : b.time();
      st.forward += fwd[size_t(s)], st.backward += bwd[size_t(s)];
      st.compute += m * (f.compute + b.compute);
      st.layers += chunks[c].second - chunks[c].first;
      for (const Pass* q : {&f, &b})
        for (const auto& [g, sec] : q->comm) add_group(per_rank[size_t(r)], g, m * sec, m * (sec - (q->hidden.count(g) ? q->hidden.at(g) : 0.0)));
    }
  }
  Schedule own;
  if (!cache) own = make_schedule(p.pp, p.vpp, m);
  const Schedule& sched = cache ? cache->schedule(p.pp, p.vpp, m) : own;
  const int copies = world_size / p.pp;
  // Blocking sends end when the message has arrived: the passes already hold the transfer.
  const SimCosts costs{fwd, bwd, device.blocking_p2p ? 0.0 : p2p}, free_p2p{fwd, bwd, 0.0};
  auto replay = [&](const SimCosts& c) {
    if (x.shared) return simulate_shared(sched, p.pp, p.vpp, c, copies, device.shared_cores);
    return cache ? cache->simulated(p.pp, p.vpp, m, c) : simulate(sched, p.pp, p.vpp, c);
  };
  const SimResult sim = replay(costs);
  const SimResult sim0 = p2p > 0 ? replay(free_p2p) : sim;
  MPIGPT_CHECK(sim.ok(), "time model: the schedule does not replay: {}", sim.errors.empty() ? "" : sim.errors[0]);
  t.pipeline = sim.makespan;
  std::vector<double> after_work;
  double after_shared = 0;
  for (int r = 0; r < p.pp; ++r) {
    StageTime& st = t.stages[size_t(r)];
    const After a = after_pipeline(x, mem.stages[size_t(r)], r, st.backward, st.forward);
    st.compute += a.optimizer;
    st.pipeline_end = sim.finish[size_t(r)];
    st.after = x.shared ? a.work() : a.exposed();
    for (int k = 0; k < copies; ++k) after_work.push_back(a.work());
    add_group(per_rank[size_t(r)], "dp_cp", a.reduce + a.gather, x.shared ? a.reduce + a.gather : a.reduce_exposed + a.gather_exposed);
    add_group(per_rank[size_t(r)], "embedding", a.embedding, a.embedding);
    if (p.pp > 1 && !device.blocking_p2p) {  // (blocking sends were counted with the passes)
      const double msgs = 2.0 * m * p.vpp;  // each micro-batch's activation in and gradient out, per chunk
      add_group(per_rank[size_t(r)], "pp", msgs * p2p, sim.makespan - sim0.makespan);
    }
    t.optimizer = std::max(t.optimizer, a.optimizer);
    t.compute = std::max(t.compute, st.compute);
    t.step = std::max(t.step, st.pipeline_end + st.after);
  }
  if (x.shared) {  // the ranks' reductions and optimizer steps share the cores after the pipeline
    after_shared = shared_makespan(after_work, device.shared_cores);
    t.step = sim.makespan + after_shared;
  }
  t.bubble = sim.makespan - sim.ideal;
  t.groups = busiest_groups(per_rank, cfg, world_size, per_node);
  return t;
}

std::string TimeEstimate::report() const {
  std::string s = fmt::format("step {:.4g} ms on {} ({} micro-batches{}): compute {:.4g} ms (optimizer {:.4g}), "
                              "pipeline {:.4g} ms, bubble {:.4g} ms, exposed communication {:.4g} ms\n",
                              step * 1e3, device, micro_batches, shared_cores ? ", ranks sharing cores" : "",
                              compute * 1e3, optimizer * 1e3, pipeline * 1e3, bubble * 1e3, exposed_comm() * 1e3);
  for (const GroupTime& g : groups)
    s += fmt::format("  {:<12} {} ranks, {}: {:.4g} ms, exposed {:.4g} ms\n", g.group, g.ranks,
                     g.inside_node ? "inside a node" : "across nodes", g.seconds * 1e3, g.exposed * 1e3);
  for (const StageTime& st : stages)
    s += fmt::format("  stage {}: {} layers, forward {:.4g} ms + backward {:.4g} ms per micro-batch, compute "
                     "{:.4g} ms, pipeline ends {:.4g} ms, then {:.4g} ms\n", st.pp_rank, st.layers, st.forward * 1e3,
                     st.backward * 1e3, st.compute * 1e3, st.pipeline_end * 1e3, st.after * 1e3);
  return s;
}

}  // namespace mpigpt
