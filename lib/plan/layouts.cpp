// Layout enumeration for `mpigpt plan`: the divisors of the GPUs, batch and layers, the --fix pins,
// and Config::validate as the judge of what mpigpt accepts.
#include "lib/plan/layouts.h"

#include <fmt/format.h>

#include <regex>
#include <sstream>
#include <tuple>

#include "lib/core/error.h"
#include "lib/plan/stage_assign.h"
#include "lib/plan/step_work.h"

namespace mpigpt {

namespace {

const char* kFixFields = "tp, pp, vpp, cp, ep, dp, mb, recompute, sp, distopt, overlap";

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

bool allowed(const std::optional<int>& f, int v) { return !f || *f == v; }

int fix_int(const std::string& key, const std::string& value) {
  size_t used = 0;
  int v = 0;
  try {
    v = std::stoi(value, &used);
  } catch (...) {
    used = 0;
  }
  if (used != value.size() || v < 1)
    fail("--fix {}={}: '{}' is not a positive integer; write e.g. --fix {}=2", key, value, value, key);
  return v;
}

bool fix_bool(const std::string& key, const std::string& value) {
  if (value == "on" || value == "true" || value == "1") return true;
  if (value == "off" || value == "false" || value == "0") return false;
  fail("--fix {}={}: '{}' is not on/off (true/false, 1/0); write e.g. --fix {}=on", key, value, value, key);
}

// The field a validation message names first ("training.global_batch = 6 is not ..." -> training.global_batch).
std::string reason_of(const std::string& message) {
  static const std::regex field(R"(([a-z]+\.[a-z_]+))");
  std::smatch m;
  if (std::regex_search(message, m, field)) return m[1];
  return message.substr(0, std::min<size_t>(message.size(), 60));
}

// The sizes fixed by the outer loops; the inner loops add micro-batch, sp, recompute, distopt.
struct Grid {
  int tp, cp, pp, vpp, ep, dp;
  std::string pipeline_layout;
};

void add_variants(Enumeration& out, const Config& base, int gpus, int global_batch, const LayoutFix& fix, const Grid& g) {
  // Sequence parallelism on with tp > 1 unless fixed (--fix sp=off).
  const std::vector<bool> sps = {fix.sp ? *fix.sp : g.tp > 1};
  std::vector<bool> dists = g.dp > 1 ? std::vector<bool>{false, true} : std::vector<bool>{false};
  if (fix.distopt) dists = {*fix.distopt};
  std::vector<std::string> recomputes = {"none", "selective", "full"};
  if (fix.recompute) recomputes = {*fix.recompute};
  for (int mb : divisors(global_batch / g.dp)) {
    if (!allowed(fix.mb, mb)) continue;
    for (bool sp : sps)
      for (const std::string& rc : recomputes)
        for (bool dist : dists) {
          if (dist && g.dp == 1) {  // pinned on: nothing to shard over
            ++out.considered;
            const std::string why = "engine.distributed_optimizer";
            if (out.rejected[why]++ == 0) out.example[why] = "--fix distopt=on with dp = 1: nothing to shard over";
            continue;
          }
          Config c = base;
          ParallelConfig& p = c.parallel;
          p.tp = g.tp, p.cp = g.cp, p.pp = g.pp, p.vpp = g.vpp, p.ep = g.ep, p.sequence_parallel = sp;
          p.pipeline_layout = g.pipeline_layout;
          c.training.micro_batch = mb, c.training.global_batch = global_batch;
          c.engine.recompute = rc, c.engine.distributed_optimizer = dist;
          // Overlap what can be overlapped (unless --fix overlap=off): the gradient reduction with
          // data parallelism, the parameter gather with the distributed optimizer.
          c.engine.overlap_grad_reduce = g.dp * g.cp > 1 && fix.overlap.value_or(true);
          c.engine.overlap_param_gather = dist && c.engine.overlap_grad_reduce;
          ++out.considered;
          try {
            c.validate(gpus);
          } catch (const Error& e) {
            const std::string why = reason_of(e.what());
            if (out.rejected[why]++ == 0) out.example[why] = e.what();
            continue;
          }
          out.layouts.push_back(std::move(c));
        }
  }
}

// Interleaving where pp * vpp divides the layers (vpp 1 always: an uneven layout when pp does not).
std::vector<int> vpp_choices(int pp, int layers) {
  std::vector<int> v = {1};
  for (int k = 2; pp > 1 && pp * k <= layers; ++k)
    if (layers % (pp * k) == 0) v.push_back(k);
  return v;
}

}  // namespace

LayoutFix parse_layout_fix(const std::string& text) {
  LayoutFix f;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos)
      fail("--fix {}: '{}' is not key=value; write e.g. --fix tp=8,pp=8 (the fields: {})", text, item, kFixFields);
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "tp") f.tp = fix_int(k, v);
    else if (k == "pp") f.pp = fix_int(k, v);
    else if (k == "vpp") f.vpp = fix_int(k, v);
    else if (k == "cp") f.cp = fix_int(k, v);
    else if (k == "ep") f.ep = fix_int(k, v);
    else if (k == "dp") f.dp = fix_int(k, v);
    else if (k == "mb" || k == "micro_batch") f.mb = fix_int(k, v);
    else if (k == "sp") f.sp = fix_bool(k, v);
    else if (k == "distopt") f.distopt = fix_bool(k, v);
    else if (k == "overlap") f.overlap = fix_bool(k, v);
    else if (k == "recompute") {
      if (v != "none" && v != "selective" && v != "full")
        fail("--fix recompute={}: '{}' is not a recompute mode; write none, selective or full", v, v);
      f.recompute = v;
    } else {
      fail("--fix {}: '{}' is not a layout field; the fields are {}", text, k, kFixFields);
    }
  }
  return f;
}

std::string balanced_pipeline_layout(const Config& cfg, const GptDims& d, int stages, int micro_batches) {
  // Stage cost in FLOPs (device-independent): each layer's, the embedding's, the head's.
  auto flops = [&](int first, int end, bool embed, bool head) {
    const Work f = forward_work(cfg, d, first, end, embed, head), b = backward_work(cfg, d, first, end, embed, head);
    return f.gemm_flops() + b.gemm_flops() + f.attention_fwd + b.attention_bwd + f.crossentropy + f.elementwise;
  };
  std::vector<double> layer(static_cast<size_t>(d.L));
  for (int l = 0; l < d.L; ++l) layer[size_t(l)] = flops(l, l + 1, false, false);
  const StageAssignment a =
      assign_stages(d.L, stages, micro_batches, additive_stage_cost(layer, flops(0, 0, true, false), flops(0, 0, false, true), stages));
  return fmt::format("{}", fmt::join(a.layers, ","));
}

Enumeration enumerate_layouts(const Config& base, int gpus, int per_node, int global_batch, const LayoutFix& fix,
                              const DimsOf& dims) {
  Enumeration out;
  const int L = base.model.num_layers, E = base.model.num_experts;
  std::map<std::tuple<int, int, int>, std::string> uneven;  // by (tp, cp, pp)
  for (int tp : divisors(per_node)) {
    if (gpus % tp != 0 || !allowed(fix.tp, tp)) continue;
    for (int cp : divisors(gpus / tp)) {
      if (!allowed(fix.cp, cp)) continue;
      for (int pp : divisors(gpus / (tp * cp))) {
        const int dp = gpus / (tp * cp * pp);
        if (pp > L || !allowed(fix.pp, pp) || !allowed(fix.dp, dp)) continue;
        if (global_batch % dp != 0) {
          ++out.considered;
          const std::string why = "training.global_batch";
          if (out.rejected[why]++ == 0)
            out.example[why] = fmt::format("training.global_batch = {} is not divisible by dp = {}", global_batch, dp);
          continue;
        }
        for (int vpp : vpp_choices(pp, L)) {
          if (!allowed(fix.vpp, vpp)) continue;
          Grid g{tp, cp, pp, vpp, 1, dp, ""};
          if (L % (pp * vpp) != 0) {  // vpp is 1 here: balance the uneven stages
            auto key = std::make_tuple(tp, cp, pp);
            if (!uneven.count(key)) {
              Config c = base;
              c.parallel.tp = tp, c.parallel.cp = cp, c.parallel.pp = pp, c.training.micro_batch = 1;
              uneven[key] = balanced_pipeline_layout(c, dims(c), pp, std::max(1, global_batch / dp));
            }
            g.pipeline_layout = uneven[key];
          }
          for (int ep : E > 0 ? divisors(E) : std::vector<int>{1}) {
            if (!allowed(fix.ep, ep) || (gpus / pp) % ep != 0) continue;
            g.ep = ep;
            add_variants(out, base, gpus, global_batch, fix, g);
          }
        }
      }
    }
  }
  return out;
}

std::string layout_name(const Config& cfg, int gpus) {
  const ParallelConfig& p = cfg.parallel;
  std::string s = fmt::format("tp{}{} cp{} ", p.tp, p.sequence_parallel && p.tp > 1 ? " sp" : "", p.cp);
  if (p.ep > 1) s += fmt::format("ep{} ", p.ep);
  s += fmt::format("pp{}", p.pp);
  if (p.vpp > 1) s += fmt::format(" vpp{}", p.vpp);
  if (!p.pipeline_layout.empty()) s += fmt::format(" [{}]", p.pipeline_layout);
  s += fmt::format(" dp{} mb{} {}", cfg.dp(gpus), cfg.training.micro_batch, cfg.engine.recompute);
  if (cfg.engine.distributed_optimizer) s += " distopt";
  return s;
}

}  // namespace mpigpt
