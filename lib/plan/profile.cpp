// Device profiles: GEMM-rate interpolation and the JSON form.
#include "lib/plan/profile.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lib/core/error.h"

namespace mpigpt {

double DeviceProfile::gemm_seconds(int64_t m, int64_t n, int64_t k) const {
  if (m <= 0 || n <= 0 || k <= 0) return 0.0;
  MPIGPT_CHECK(!gemm.empty(), "profile {} has no GEMM samples", name);
  const double flops = 2.0 * double(m) * double(n) * double(k);
  double wsum = 0, rate = 0;
  for (const GemmSample& s : gemm) {
    const double dm = std::log(double(m) / double(s.m)), dn = std::log(double(n) / double(s.n)),
                 dk = std::log(double(k) / double(s.k));
    const double d2 = dm * dm + dn * dn + dk * dk;
    const double r = s.flops() / s.seconds;
    if (d2 < 1e-12) return flops / r;
    const double w = 1.0 / (d2 * d2);  // inverse distance, power 4: the nearest shapes decide
    wsum += w;
    rate += w * r;
  }
  return flops / (rate / wsum);
}

namespace {

using json = nlohmann::ordered_json;  // fields in the order written

double number(const json& j, const char* key, const std::string& what, bool positive) {
  if (!j.contains(key) || !j[key].is_number()) fail("{}: field '{}' is missing or not a number", what, key);
  const double v = j[key].get<double>();
  if (!(v >= 0) || (positive && !(v > 0))) fail("{}: field '{}' = {} must be {}", what, key, v, positive ? "> 0" : ">= 0");
  return v;
}

Link link_of(const json& j, const char* key, const std::string& what) {
  if (!j.contains(key) || !j[key].is_object()) fail("{}: field '{}' (latency_s, bandwidth_Bps) is missing", what, key);
  const std::string w = what + " " + key;
  return Link{number(j[key], "latency_s", w, false), number(j[key], "bandwidth_Bps", w, true)};
}

}  // namespace

DeviceProfile parse_profile(const std::string& text, const std::string& what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    fail("{}: not JSON: {}", what, e.what());
  }
  DeviceProfile p;
  p.name = j.value("name", std::string());
  p.source = j.value("source", std::string());
  p.peak_flops = number(j, "peak_flops", what, false);
  p.shared_cores = int(number(j, "shared_cores", what, false));
  p.gemm_in_model = number(j, "gemm_in_model", what, true);
  if (!j.contains("gemm") || !j["gemm"].is_array() || j["gemm"].empty())
    fail("{}: field 'gemm' must be a non-empty list of {{m, n, k, seconds}}", what);
  for (const json& g : j["gemm"]) {
    const std::string w = what + " gemm entry";
    GemmSample s{int64_t(number(g, "m", w, true)), int64_t(number(g, "n", w, true)), int64_t(number(g, "k", w, true)),
                 number(g, "seconds", w, true)};
    p.gemm.push_back(s);
  }
  if (!j.contains("ops") || !j["ops"].is_object()) fail("{}: field 'ops' is missing", what);
  const json& o = j["ops"];
  const std::string w = what + " ops";
  p.ops.elementwise = number(o, "elementwise", w, false);
  p.ops.attention_fwd = number(o, "attention_fwd", w, false);
  p.ops.attention_bwd = number(o, "attention_bwd", w, false);
  p.ops.crossentropy = number(o, "crossentropy", w, false);
  p.ops.optimizer = number(o, "optimizer", w, false);
  p.ops.grad_zero = number(o, "grad_zero", w, false);
  // Optional: a fused attention keeps no score matrix.
  if (o.contains("attention_scores_fwd")) p.ops.attention_scores_fwd = number(o, "attention_scores_fwd", w, false);
  if (o.contains("attention_scores_bwd")) p.ops.attention_scores_bwd = number(o, "attention_scores_bwd", w, false);
  if (o.contains("masked_attention_fwd")) p.ops.masked_attention_fwd = number(o, "masked_attention_fwd", w, false);
  if (o.contains("masked_attention_bwd")) p.ops.masked_attention_bwd = number(o, "masked_attention_bwd", w, false);
  p.intra_node = link_of(j, "intra_node", what);
  p.inter_node = link_of(j, "inter_node", what);
  p.reduce_rate = number(j, "reduce_rate", what, false);
  if (j.contains("blocking_p2p")) {  // optional
    if (!j["blocking_p2p"].is_boolean()) fail("{}: field 'blocking_p2p' must be true or false", what);
    p.blocking_p2p = j["blocking_p2p"].get<bool>();
  }
  if (j.contains("memory_bytes")) p.memory_bytes = number(j, "memory_bytes", what, false);  // optional
  return p;
}

DeviceProfile load_profile(const std::string& name_or_path, const std::string& dir) {
  std::string path = name_or_path;
  if (!std::filesystem::exists(path)) path = dir + "/" + name_or_path + ".json";
  std::ifstream in(path);
  if (!in) fail("device profile '{}': no such file, and no {} (the shipped profiles: cpu_2core, h100, h200, a100_80g)",
                name_or_path, path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_profile(ss.str(), path);
}

std::string to_json(const DeviceProfile& p) {
  json j;
  j["name"] = p.name;
  j["source"] = p.source;
  j["peak_flops"] = p.peak_flops;
  j["shared_cores"] = p.shared_cores;
  j["gemm_in_model"] = p.gemm_in_model;
  j["gemm"] = json::array();
  for (const GemmSample& s : p.gemm) j["gemm"].push_back({{"m", s.m}, {"n", s.n}, {"k", s.k}, {"seconds", s.seconds}});
  j["ops"] = {{"elementwise", p.ops.elementwise},     {"attention_fwd", p.ops.attention_fwd},
              {"attention_bwd", p.ops.attention_bwd}, {"crossentropy", p.ops.crossentropy},
              {"optimizer", p.ops.optimizer},         {"grad_zero", p.ops.grad_zero}};
  if (p.ops.attention_scores_fwd > 0 || p.ops.attention_scores_bwd > 0) {
    j["ops"]["attention_scores_fwd"] = p.ops.attention_scores_fwd;
    j["ops"]["attention_scores_bwd"] = p.ops.attention_scores_bwd;
  }
  if (p.ops.masked_attention_fwd > 0 || p.ops.masked_attention_bwd > 0) {
    j["ops"]["masked_attention_fwd"] = p.ops.masked_attention_fwd;
    j["ops"]["masked_attention_bwd"] = p.ops.masked_attention_bwd;
  }
  j["intra_node"] = {{"latency_s", p.intra_node.latency}, {"bandwidth_Bps", p.intra_node.bandwidth}};
  j["inter_node"] = {{"latency_s", p.inter_node.latency}, {"bandwidth_Bps", p.inter_node.bandwidth}};
  j["reduce_rate"] = p.reduce_rate;
  if (p.blocking_p2p) j["blocking_p2p"] = true;
  if (p.memory_bytes > 0) j["memory_bytes"] = p.memory_bytes;
  return j.dump(2) + "\n";
}

}  // namespace mpigpt
