// PEFT LoRA adapters <-> ours: one table of HF projections per adapted layer (a row block of our
// B, the whole A) drives both directions, so a round trip is bit-identical.
#include "io/formats/peft_format.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "io/formats/hf_resolve.h"
#include "io/formats/safetensors.h"
#include "lib/core/error.h"
#include "lib/core/new_file.h"

namespace mpigpt {

using json = nlohmann::json;

namespace {

const char* const kTargets[] = {"qkv", "proj", "fc1", "fc2"};

// One HF projection of an adapted layer: rows [row0, row0 + rows) of our B.
struct Piece {
  std::string module;  // relative to the layer: "self_attn.q_proj", "attn.c_attn"
  int64_t row0 = 0, rows = 0;
};
// One of our adapted layers ("attn.qkv") and the HF projections it covers; for a routed expert
// ("mlp.experts.fc", expert >= 0) our A and B are (E, r, in) and (E, out, r) and this group is
// expert `expert`'s slice of them.
struct Group {
  std::string target, ours;
  int64_t in = 0, out = 0;
  std::vector<Piece> pieces;
  int expert = -1;
  std::string what() const { return expert < 0 ? ours : fmt::format("{} of expert {}", ours, expert); }
};

std::vector<Group> groups(const ModelConfig& in) {
  if (in.num_experts > 0 && in.family == "gpt2")
    fail("PEFT adapters: model.num_experts = {} with model.family = gpt2: Hugging Face has no GPT-2 "
         "mixture-of-experts model, so its adapters have no PEFT form; keep the mpigpt adapter checkpoint (mpigpt "
         "convert --merge-lora merges it), or train model.family = llama (Mixtral) to export", in.num_experts);
  const ModelConfig m = in.num_experts > 0 ? hf_detail::resolved_for_hf(in) : hf_detail::resolved(in);
  const int64_t C = m.hidden, HD = C / m.num_heads, q = m.num_heads * HD, kv = m.num_kv_heads * HD;
  const int64_t F = m.ffn_hidden;
  if (m.family == "gpt2")
    return {{"qkv", "attn.qkv", C, q + 2 * kv, {{"attn.c_attn", 0, q + 2 * kv}}},
            {"proj", "attn.proj", q, C, {{"attn.c_proj", 0, C}}},
            {"fc1", "mlp.fc", C, F, {{"mlp.c_fc", 0, F}}},
            {"fc2", "mlp.proj", F, C, {{"mlp.c_proj", 0, C}}}};
  std::vector<Group> out = {
      {"qkv", "attn.qkv", C, q + 2 * kv,
       {{"self_attn.q_proj", 0, q}, {"self_attn.k_proj", q, kv}, {"self_attn.v_proj", q + kv, kv}}},
      {"proj", "attn.proj", q, C, {{"self_attn.o_proj", 0, C}}}};
  if (m.num_experts == 0) {
    out.push_back({"fc1", "mlp.fc", C, 2 * F, {{"mlp.gate_proj", 0, F}, {"mlp.up_proj", F, F}}});
    out.push_back({"fc2", "mlp.proj", F, C, {{"mlp.down_proj", 0, C}}});
    return out;
  }
  // Mixtral: expert e's w1 / w3 are the gate / up rows of our fc, w2 our proj (hf_format.cpp).
  const int64_t Fe = m.moe_ffn_hidden;
  for (int e = 0; e < m.num_experts; ++e) {
    const std::string x = "block_sparse_moe.experts." + std::to_string(e) + ".";
    out.push_back({"fc1", "mlp.experts.fc", C, 2 * Fe, {{x + "w1", 0, Fe}, {x + "w3", Fe, Fe}}, e});
  }
  for (int e = 0; e < m.num_experts; ++e)
    out.push_back(
        {"fc2", "mlp.experts.proj", Fe, C, {{"block_sparse_moe.experts." + std::to_string(e) + ".w2", 0, C}}, e});
  return out;
}

std::string layer_prefix(const ModelConfig& m, int l) {
  return (m.family == "gpt2" ? "base_model.model.transformer.h." : "base_model.model.model.layers.") +
         std::to_string(l) + ".";
}

std::set<std::string> target_set(const std::string& list) {
  std::set<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string t = list.substr(start, end - start);
    t.erase(0, t.find_first_not_of(" \t"));
    t.erase(t.find_last_not_of(" \t") + 1);
    if (std::find(std::begin(kTargets), std::end(kTargets), t) == std::end(kTargets))
      fail("lora.targets = '{}': '{}' is not one of qkv, proj, fc1, fc2", list, t);
    out.insert(t);
    start = end + 1;
  }
  return out;
}

// PEFT's name for a projection in target_modules: the module's last component, but GPT-2's
// attn.c_proj and mlp.c_proj share theirs, so they keep their parent (PEFT matches by suffix).
std::string target_module(const ModelConfig& m, const std::string& module) {
  if (m.family == "gpt2" && module.ends_with("c_proj")) return module;
  return module.substr(module.rfind('.') + 1);
}

bool absent_or_null(const json& j, const char* key) { return !j.contains(key) || j.at(key).is_null(); }
bool empty_field(const json& j, const char* key) { return absent_or_null(j, key) || j.at(key).empty(); }

}  // namespace

json peft_config(const ModelConfig& m, const LoraConfig& l, const std::string& base_model) {
  json targets = json::array();
  const std::set<std::string> want = target_set(l.targets);
  for (const Group& g : groups(m))
    if (want.count(g.target))
      for (const Piece& p : g.pieces)
        if (std::find(targets.begin(), targets.end(), target_module(m, p.module)) == targets.end())
          targets.push_back(target_module(m, p.module));  // once for every expert's w1, w2, w3
  json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model.empty() ? json() : json(base_model);
  j["r"] = l.rank;
  if (l.alpha == double(int64_t(l.alpha))) j["lora_alpha"] = int64_t(l.alpha);
  else j["lora_alpha"] = l.alpha;
  j["lora_dropout"] = 0.0;
  j["bias"] = "none";
  j["target_modules"] = targets;
  j["fan_in_fan_out"] = m.family == "gpt2";  // GPT-2's Conv1D stores its weight (in, out)
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["modules_to_save"] = json();
  j["layers_to_transform"] = json();
  j["rank_pattern"] = json::object();
  j["alpha_pattern"] = json::object();
  return j;
}

namespace {

void check_unsupported(const json& j, const std::string& where) {
  if (!j.contains("peft_type") || j.at("peft_type") != "LORA")
    fail("{}: peft_type = {}: mpigpt reads LoRA adapters (peft_type \"LORA\")", where,
         j.contains("peft_type") ? j.at("peft_type").dump() : "missing");
  if (!absent_or_null(j, "lora_dropout") && !(j.at("lora_dropout").is_number() && j.at("lora_dropout") == 0))
    fail("{}: lora_dropout = {}: mpigpt trains adapters without dropout (lora.dropout = 0); set it to 0", where,
         j.at("lora_dropout").dump());
  if (!absent_or_null(j, "bias") && j.at("bias") != "none")
    fail("{}: bias = {}: mpigpt's adapters have no bias terms; only bias \"none\" is read", where, j.at("bias").dump());
  for (const char* flag : {"use_rslora", "use_dora"})
    if (!absent_or_null(j, flag) && j.at(flag) != false)
      fail("{}: {} = {}: mpigpt computes plain LoRA (W + alpha/r B A); {} adapters cannot be represented", where, flag,
           j.at(flag).dump(), flag == std::string("use_dora") ? "DoRA" : "rank-stabilised");
  for (const char* field : {"rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"})
    if (!empty_field(j, field))
      fail("{}: {} = {}: mpigpt gives every adapted layer of every block one rank and alpha and trains nothing "
           "else; this adapter cannot be represented", where, field, j.at(field).dump());
}

}  // namespace

LoraConfig lora_config_from_peft(const json& j, const ModelConfig& m, const std::string& where,
                                 std::string* base_model) {
  check_unsupported(j, where);
  if (!j.contains("r") || !j.at("r").is_number_integer() || j.at("r").get<int64_t>() <= 0)
    fail("{}: r = {}: the rank must be a positive integer", where, j.contains("r") ? j.at("r").dump() : "missing");
  if (!j.contains("lora_alpha") || !j.at("lora_alpha").is_number())
    fail("{}: lora_alpha = {}: expected a number", where, j.contains("lora_alpha") ? j.at("lora_alpha").dump() : "missing");
  if (!j.contains("target_modules") || !j.at("target_modules").is_array())
    fail("{}: target_modules = {}: mpigpt reads a list of module names (not a regular expression or all-linear)",
         where, j.contains("target_modules") ? j.at("target_modules").dump() : "missing");
  LoraConfig l;
  l.rank = j.at("r").get<int>();
  l.alpha = j.at("lora_alpha").get<double>();
  std::set<std::string> named;
  for (const json& t : j.at("target_modules")) {
    if (!t.is_string()) fail("{}: target_modules holds {}, not a module name", where, t.dump());
    named.insert(t.get<std::string>());
  }
  std::string targets;
  std::set<std::string> used;
  for (const Group& g : groups(m)) {
    int have = 0;
    for (const Piece& p : g.pieces) {
      const std::string short_name = p.module.substr(p.module.rfind('.') + 1);
      for (const std::string& n : {p.module, short_name})
        if (named.count(n)) {
          used.insert(n);
          ++have;
          break;
        }
    }
    if (have == 0) continue;
    if (have != int(g.pieces.size()))
      fail("{}: target_modules = {} adapts only some of the projections that mpigpt fuses into {} ({}): adapt all "
           "of them or none", where, j.at("target_modules").dump(), g.ours, g.pieces.size());
    if (("," + targets + ",").find("," + g.target + ",") == std::string::npos)  // once for all experts
      targets += (targets.empty() ? "" : ",") + g.target;
  }
  for (const std::string& n : named)
    if (!used.count(n))
      fail("{}: target_modules names {}, a module mpigpt has no LoRA adapter for (a {} model adapts its attention "
           "and MLP projections)", where, n, m.family);
  if (targets.empty()) fail("{}: target_modules is empty", where);
  l.targets = targets;
  if (base_model) *base_model = absent_or_null(j, "base_model_name_or_path") ? "" : j.at("base_model_name_or_path").get<std::string>();
  return l;
}

namespace {

// Our adapter's global shapes: (r, in), (out, r); a routed expert's (E, r, in), (E, out, r).
Shape ours_a(const Group& g, const ModelConfig& m, int64_t r) {
  return g.expert < 0 ? Shape{r, g.in} : Shape{int64_t(m.num_experts), r, g.in};
}
Shape ours_b(const Group& g, const ModelConfig& m, int64_t r) {
  return g.expert < 0 ? Shape{g.out, r} : Shape{int64_t(m.num_experts), g.out, r};
}

}  // namespace

TensorMap to_peft(const TensorMap& ours, const ModelConfig& m, const LoraConfig& l) {
  const std::set<std::string> want = target_set(l.targets);
  const int64_t r = l.rank;
  const std::vector<Group> gs = groups(m);
  TensorMap out;
  size_t used = 0;
  for (int layer = 0; layer < m.num_layers; ++layer)
    for (const Group& g : gs) {
      if (!want.count(g.target)) continue;
      const std::string stem = "layers." + std::to_string(layer) + "." + g.ours;
      auto a = ours.find(stem + ".lora_A.weight"), b = ours.find(stem + ".lora_B.weight");
      if (a == ours.end() || b == ours.end()) fail("to_peft: adapter {} (lora_A and lora_B) is missing", stem);
      const Shape sa = ours_a(g, m, r), sb = ours_b(g, m, r);
      if (!(a->second.shape == sa) || !(b->second.shape == sb))
        fail("to_peft: adapter {} has A {} and B {}, expected {} and {}", stem, a->second.shape.str(),
             b->second.shape.str(), sa.str(), sb.str());
      if (g.expert <= 0) used += 2;
      const int64_t e = std::max(g.expert, 0);
      const float* A = a->second.data.data() + e * r * g.in;
      for (const Piece& p : g.pieces) {
        const std::string key = layer_prefix(m, layer) + p.module;
        out[key + ".lora_A.weight"] = HostTensor{Shape{r, g.in}, std::vector<float>(A, A + r * g.in)};
        const float* from = b->second.data.data() + e * g.out * r + p.row0 * r;
        out[key + ".lora_B.weight"] = HostTensor{Shape{p.rows, r}, std::vector<float>(from, from + p.rows * r)};
      }
    }
  if (used != ours.size()) fail("to_peft: {} tensors are not adapters of lora.targets = {}", ours.size() - used, l.targets);
  return out;
}

namespace {

const HostTensor& peft_tensor(const TensorMap& peft, const std::string& key, const Shape& want,
                              const std::string& where) {
  auto it = peft.find(key);
  if (it == peft.end()) fail("{}: tensor {} (shape {}) is missing; adapter_config.json says it is adapted", where, key, want.str());
  if (!(it->second.shape == want))
    fail("{}: tensor {} has shape {}, expected {} from r and the model's shape", where, key, it->second.shape.str(),
         want.str());
  return it->second;
}

}  // namespace

TensorMap from_peft(const TensorMap& peft, const ModelConfig& m, const LoraConfig& l, const std::string& where) {
  const std::set<std::string> want = target_set(l.targets);
  const int64_t r = l.rank;
  const std::vector<Group> gs = groups(m);
  TensorMap out;
  size_t used = 0;
  for (int layer = 0; layer < m.num_layers; ++layer)
    for (const Group& g : gs) {
      if (!want.count(g.target)) continue;
      const std::string stem = "layers." + std::to_string(layer) + "." + g.ours;
      HostTensor& A = out[stem + ".lora_A.weight"];
      HostTensor& B = out[stem + ".lora_B.weight"];
      if (g.expert <= 0) {  // the whole tensors, filled by every expert's groups
        A = HostTensor{ours_a(g, m, r), std::vector<float>(size_t(ours_a(g, m, r).numel()))};
        B = HostTensor{ours_b(g, m, r), std::vector<float>(size_t(ours_b(g, m, r).numel()))};
      }
      const int64_t e = std::max(g.expert, 0);
      std::string first;
      for (const Piece& p : g.pieces) {
        const std::string key = layer_prefix(m, layer) + p.module;
        const std::string ka = key + ".lora_A.weight", kb = key + ".lora_B.weight";
        auto a = peft.find(ka);
        if (a != peft.end() && a->second.shape.ndim == 2 && a->second.shape[0] != r)
          fail("{}: tensor {} has rank {}, r = {} in adapter_config.json; mpigpt fuses {} into one adapter of one "
               "rank", where, ka, a->second.shape[0], r, g.what());
        const HostTensor& Ap = peft_tensor(peft, ka, Shape{r, g.in}, where);
        const HostTensor& Bp = peft_tensor(peft, kb, Shape{p.rows, r}, where);
        if (first.empty()) {
          std::copy(Ap.data.begin(), Ap.data.end(), A.data.begin() + e * r * g.in);
          first = ka;
        } else if (std::memcmp(Ap.data.data(), peft.at(first).data.data(), Ap.data.size() * 4) != 0) {
          fail("{}: {} differs from {}: mpigpt fuses these projections into one adapter ({}) whose A is shared, so "
               "their lora_A must be equal", where, ka, first, g.what());
        }
        std::copy(Bp.data.begin(), Bp.data.end(), B.data.begin() + e * g.out * r + p.row0 * r);
        used += 2;
      }
    }
  if (used != peft.size()) {
    std::set<std::string> known;
    for (int layer = 0; layer < m.num_layers; ++layer)
      for (const Group& g : gs)
        if (want.count(g.target))
          for (const Piece& p : g.pieces)
            for (const char* f : {".lora_A.weight", ".lora_B.weight"}) known.insert(layer_prefix(m, layer) + p.module + f);
    for (const auto& [key, t] : peft)
      if (!known.count(key))
        fail("{}: tensor {} is not an adapter mpigpt can represent (a {}-layer {} model with lora.targets = {} has "
             "LoRA A and B of {})", where, key, m.num_layers, m.family, l.targets, layer_prefix(m, 0) + "...");
  }
  return out;
}

void save_peft_adapter(const std::string& dir, const TensorMap& ours, const ModelConfig& m, const LoraConfig& l,
                       const std::string& base_model) {
  const TensorMap peft = to_peft(ours, m, l);
  std::filesystem::create_directories(dir);
  write_safetensors((std::filesystem::path(dir) / kPeftWeightsFile).string(), peft);
  NewFile out((std::filesystem::path(dir) / kPeftConfigFile).string());
  out.write(peft_config(m, l, base_model).dump(2) + "\n");
  out.commit();
}

namespace {

json read_json(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / kPeftConfigFile).string();
  std::ifstream in(path);
  if (!in) fail("cannot open {}: {}; a PEFT adapter directory holds {} beside {}", path, std::strerror(errno),
                kPeftConfigFile, kPeftWeightsFile);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("{} is not valid JSON: {}", path, e.what());
  }
}

}  // namespace

LoraConfig read_peft_config(const std::string& dir, const ModelConfig& m, std::string* base_model) {
  return lora_config_from_peft(read_json(dir), m, (std::filesystem::path(dir) / kPeftConfigFile).string(), base_model);
}

std::string peft_base_model(const std::string& dir) {
  const json j = read_json(dir);
  const bool has = j.contains("base_model_name_or_path") && j.at("base_model_name_or_path").is_string();
  return has ? j.at("base_model_name_or_path").get<std::string>() : "";
}

TensorMap load_peft_adapter(const std::string& dir, const ModelConfig& m, const LoraConfig& l) {
  const std::string path = (std::filesystem::path(dir) / kPeftWeightsFile).string();
  return from_peft(read_safetensors(path), m, l, path);
}

}  // namespace mpigpt
