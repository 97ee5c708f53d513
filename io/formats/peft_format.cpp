// PEFT LoRA adapters <-> ours: one table of HF projections per adapted layer (a row block of our
// B, the whole A) drives both directions, so a round trip is bit-identical.
#include "io/formats/peft_format.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "io/formats/hf_resolve.h"
#include "io/formats/safetensors.h"
#include "lib/core/error.h"
#include "lib/core/new_file.h"

namespace mpigpt {

using json = nlohmann::json;

namespace {

// One HF projection of an adapted layer: rows [row0, row0 + rows) of our B.
struct Piece {
  std::string module;  // relative to the layer: "self_attn.q_proj", "attn.c_attn"
  int64_t row0 = 0, rows = 0;
  std::string own;  // the lora.targets name of its own adapter ("q", "gate"); "" for a layer of one projection
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
    return {{"qkv", "attn.qkv", C, q + 2 * kv, {{"attn.c_attn", 0, q + 2 * kv, ""}}},
            {"proj", "attn.proj", q, C, {{"attn.c_proj", 0, C, ""}}},
            {"fc1", "mlp.fc", C, F, {{"mlp.c_fc", 0, F, ""}}},
            {"fc2", "mlp.proj", F, C, {{"mlp.c_proj", 0, C, ""}}}};
  std::vector<Group> out = {
      {"qkv", "attn.qkv", C, q + 2 * kv,
       {{"self_attn.q_proj", 0, q, "q"}, {"self_attn.k_proj", q, kv, "k"}, {"self_attn.v_proj", q + kv, kv, "v"}}},
      {"proj", "attn.proj", q, C, {{"self_attn.o_proj", 0, C, ""}}}};
  if (m.num_experts == 0) {
    out.push_back({"fc1", "mlp.fc", C, 2 * F, {{"mlp.gate_proj", 0, F, "gate"}, {"mlp.up_proj", F, F, "up"}}});
    out.push_back({"fc2", "mlp.proj", F, C, {{"mlp.down_proj", 0, C, ""}}});
    return out;
  }
  // Mixtral: expert e's w1 / w3 are the gate / up rows of our fc, w2 our proj (hf_format.cpp).
  const int64_t Fe = m.moe_ffn_hidden;
  for (int e = 0; e < m.num_experts; ++e) {
    const std::string x = "block_sparse_moe.experts." + std::to_string(e) + ".";
    out.push_back({"fc1", "mlp.experts.fc", C, 2 * Fe, {{x + "w1", 0, Fe, "gate"}, {x + "w3", Fe, Fe, "up"}}, e});
  }
  for (int e = 0; e < m.num_experts; ++e)
    out.push_back(
        {"fc2", "mlp.experts.proj", Fe, C, {{"block_sparse_moe.experts." + std::to_string(e) + ".w2", 0, C, ""}}, e});
  return out;
}

std::string layer_prefix(const ModelConfig& m, int l) {
  return (m.family == "gpt2" ? "base_model.model.transformer.h." : "base_model.model.model.layers.") +
         std::to_string(l) + ".";
}

// The adapter block of each of g's projections under lora.targets `want` (LoraDims::part_blocks):
// all 0 when g's own target is named (one A shared by its projections); else each projection named
// by its own target ("q", "gate") a block of its own in order, -1 for the others; empty: g has no
// adapter. `list` (lora.targets) names the setting in an error.
std::vector<int> piece_blocks(const Group& g, const std::set<std::string>& want, const ModelConfig& m,
                              const std::string& list) {
  if (want.count(g.target)) return std::vector<int>(g.pieces.size(), 0);
  static const std::map<std::string, std::vector<std::string>> own = {{"qkv", {"q", "k", "v"}},
                                                                       {"fc1", {"gate", "up"}}};
  auto it = own.find(g.target);
  if (it == own.end() || std::none_of(it->second.begin(), it->second.end(), [&](const std::string& t) { return want.count(t) > 0; }))
    return {};
  if (g.pieces.size() == 1)
    fail("PEFT adapters: lora.targets = '{}' gives q, k and v adapters of their own, but a model.family = {} model "
         "computes them in one Hugging Face layer ({}), so they have no PEFT form; train with lora.targets qkv to "
         "export", list, m.family, g.pieces[0].module);
  std::vector<int> blocks;
  int next = 0;
  for (const Piece& p : g.pieces) blocks.push_back(want.count(p.own) ? next++ : -1);
  return blocks;
}

int64_t width_of(const std::vector<int>& blocks, int64_t r) {
  return r * (1 + *std::max_element(blocks.begin(), blocks.end()));
}

// PEFT's name for a projection in target_modules: the module's last component, but GPT-2's
// attn.c_proj and mlp.c_proj share theirs, so they keep their parent (PEFT matches by suffix).
std::string target_module(const ModelConfig& m, const std::string& module) {
  if (m.family == "gpt2" && module.ends_with("c_proj")) return module;
  return module.substr(module.rfind('.') + 1);
}

// lora.targets in its usual order ("q,v,proj,gate,up,fc2").
std::string target_list(const std::set<std::string>& targets) {
  std::string out;
  for (const char* t : {"qkv", "q", "k", "v", "proj", "fc1", "gate", "up", "fc2"})
    if (targets.count(t)) {
      if (!out.empty()) out += ',';
      out += t;
    }
  return out;
}

bool absent_or_null(const json& j, const char* key) { return !j.contains(key) || j.at(key).is_null(); }
bool empty_field(const json& j, const char* key) { return absent_or_null(j, key) || j.at(key).empty(); }

}  // namespace

json peft_config(const ModelConfig& m, const LoraConfig& l, const std::string& base_model) {
  json targets = json::array();
  const std::set<std::string> want = lora_target_set(l.targets);
  for (const Group& g : groups(m)) {
    const std::vector<int> blocks = piece_blocks(g, want, m, l.targets);
    for (size_t i = 0; i < blocks.size(); ++i)
      if (blocks[i] >= 0 && std::find(targets.begin(), targets.end(), target_module(m, g.pieces[i].module)) == targets.end())
        targets.push_back(target_module(m, g.pieces[i].module));  // once for every expert's w1, w2, w3
  }
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
  j["use_rslora"] = l.rslora;
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
  if (!absent_or_null(j, "lora_dropout") &&
      !(j.at("lora_dropout").is_number() && j.at("lora_dropout") >= 0 && j.at("lora_dropout") < 1))
    fail("{}: lora_dropout = {}: expected a probability in [0, 1)", where, j.at("lora_dropout").dump());
  if (!absent_or_null(j, "bias") && j.at("bias") != "none")
    fail("{}: bias = {}: mpigpt's adapters have no bias terms; only bias \"none\" is read", where, j.at("bias").dump());
  if (!absent_or_null(j, "use_dora") && j.at("use_dora") != false)
    fail("{}: use_dora = {}: mpigpt computes plain LoRA (W + s B A); DoRA adapters cannot be represented", where,
         j.at("use_dora").dump());
  if (!absent_or_null(j, "use_rslora") && !j.at("use_rslora").is_boolean())
    fail("{}: use_rslora = {}: expected true or false", where, j.at("use_rslora").dump());
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
  // PEFT adapts a module whose name (in the model: "model.layers.3.self_attn.q_proj") is an entry
  // or ends in "." and one ("q_proj", "self_attn.q_proj"; "all-linear" is saved as every full name).
  // mpigpt adapts the same projections in every layer and expert: the first layer's and expert's
  // choice must hold for all. Every named projection of a fused layer (q/k/v, gate/up) gets its own
  // adapter, as PEFT trains them; read_peft_config finds the adapters mpigpt wrote with one shared A.
  std::set<std::string> targets, used;
  std::map<std::string, std::pair<std::vector<bool>, std::string>> first;  // our layer -> its pieces' choice, where seen
  for (int layer = 0; layer < m.num_layers; ++layer)
    for (const Group& g : groups(m)) {
      std::vector<bool> chosen;
      for (const Piece& p : g.pieces) {
        const std::string full = layer_prefix(m, layer).substr(std::string("base_model.model.").size()) + p.module;
        bool match = false;
        for (const std::string& n : named)
          if (full == n || full.ends_with("." + n)) used.insert(n), match = true;
        chosen.push_back(match);
        if (match) targets.insert(p.own.empty() ? g.target : p.own);
      }
      const std::string here = fmt::format("layer {}{}", layer, g.expert >= 0 ? fmt::format(" expert {}", g.expert) : "");
      auto [it, fresh] = first.try_emplace(g.ours, chosen, here);
      if (!fresh && it->second.first != chosen)
        fail("{}: target_modules adapts other projections of {} in {} than in {}: mpigpt gives every layer (and "
             "expert) the same adapters", where, g.ours, here, it->second.second);
    }
  for (const std::string& n : named)
    if (!used.count(n))
      fail("{}: target_modules names {}, a module mpigpt has no LoRA adapter for (a {} model adapts its attention "
           "and MLP projections)", where, n, m.family);
  if (targets.empty()) fail("{}: target_modules is empty", where);
  l.targets = target_list(targets);
  l.dropout = absent_or_null(j, "lora_dropout") ? 0.0 : j.at("lora_dropout").get<double>();
  l.rslora = !absent_or_null(j, "use_rslora") && j.at("use_rslora").get<bool>();
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
  const std::set<std::string> want = lora_target_set(l.targets);
  const int64_t r = l.rank;
  const std::vector<Group> gs = groups(m);
  TensorMap out;
  size_t used = 0;
  for (int layer = 0; layer < m.num_layers; ++layer)
    for (const Group& g : gs) {
      const std::vector<int> blocks = piece_blocks(g, want, m, l.targets);
      if (blocks.empty()) continue;
      const int64_t w = width_of(blocks, r);
      const std::string stem = "layers." + std::to_string(layer) + "." + g.ours;
      auto a = ours.find(stem + ".lora_A.weight"), b = ours.find(stem + ".lora_B.weight");
      if (a == ours.end() || b == ours.end()) fail("to_peft: adapter {} (lora_A and lora_B) is missing", stem);
      const Shape sa = ours_a(g, m, w), sb = ours_b(g, m, w);
      if (!(a->second.shape == sa) || !(b->second.shape == sb))
        fail("to_peft: adapter {} has A {} and B {}, expected {} and {}", stem, a->second.shape.str(),
             b->second.shape.str(), sa.str(), sb.str());
      if (g.expert <= 0) used += 2;
      const int64_t e = std::max(g.expert, 0);
      for (size_t i = 0; i < g.pieces.size(); ++i) {
        const Piece& p = g.pieces[i];
        const float* rows = b->second.data.data() + (e * g.out + p.row0) * w;  // this projection's rows of B
        for (int64_t k = 0; k < p.rows * w; ++k)  // outside its block: zero, as training keeps it
          if (k % w / r != blocks[i] && rows[k] != 0)
            fail("to_peft: adapter {}{} has B[{}, {}] = {} outside {}'s block: lora.targets = {} gives it no such "
                 "entry; the adapters are damaged", stem, g.expert >= 0 ? fmt::format(" (expert {})", e) : "",
                 p.row0 + k / w, k % w, rows[k], p.module, l.targets);
        if (blocks[i] < 0) continue;
        const std::string key = layer_prefix(m, layer) + p.module;
        const float* A = a->second.data.data() + (e * w + blocks[i] * r) * g.in;
        out[key + ".lora_A.weight"] = HostTensor{Shape{r, g.in}, std::vector<float>(A, A + r * g.in)};
        HostTensor& B = out[key + ".lora_B.weight"] = HostTensor{Shape{p.rows, r}, std::vector<float>(size_t(p.rows * r))};
        for (int64_t row = 0; row < p.rows; ++row)
          std::copy_n(rows + row * w + blocks[i] * r, r, B.data.begin() + row * r);
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
  const std::set<std::string> want = lora_target_set(l.targets);
  const int64_t r = l.rank;
  const std::vector<Group> gs = groups(m);
  TensorMap out;
  std::set<std::string> known;
  for (int layer = 0; layer < m.num_layers; ++layer)
    for (const Group& g : gs) {
      const std::vector<int> blocks = piece_blocks(g, want, m, l.targets);
      if (blocks.empty()) continue;
      const int64_t w = width_of(blocks, r);
      const std::string stem = "layers." + std::to_string(layer) + "." + g.ours;
      HostTensor& A = out[stem + ".lora_A.weight"];
      HostTensor& B = out[stem + ".lora_B.weight"];
      if (g.expert <= 0) {  // the whole tensors, filled by every expert's groups
        A = HostTensor{ours_a(g, m, w), std::vector<float>(size_t(ours_a(g, m, w).numel()))};
        B = HostTensor{ours_b(g, m, w), std::vector<float>(size_t(ours_b(g, m, w).numel()))};
      }
      const int64_t e = std::max(g.expert, 0);
      std::string first;
      for (size_t i = 0; i < g.pieces.size(); ++i) {
        const Piece& p = g.pieces[i];
        if (blocks[i] < 0) continue;
        const std::string key = layer_prefix(m, layer) + p.module;
        const std::string ka = key + ".lora_A.weight", kb = key + ".lora_B.weight";
        known.insert(ka);
        known.insert(kb);
        auto a = peft.find(ka);
        if (a != peft.end() && a->second.shape.ndim == 2 && a->second.shape[0] != r)
          fail("{}: tensor {} has rank {}, r = {} in adapter_config.json; mpigpt gives every adapter of {} one rank",
               where, ka, a->second.shape[0], r, g.what());
        const HostTensor& Ap = peft_tensor(peft, ka, Shape{r, g.in}, where);
        const HostTensor& Bp = peft_tensor(peft, kb, Shape{p.rows, r}, where);
        if (blocks[i] > 0 || first.empty()) {
          std::copy(Ap.data.begin(), Ap.data.end(), A.data.begin() + (e * w + blocks[i] * r) * g.in);
          first = ka;
        } else if (std::memcmp(Ap.data.data(), peft.at(first).data.data(), Ap.data.size() * 4) != 0) {
          fail("{}: {} differs from {}: lora.targets = {} gives {} one adapter whose A is shared, so their lora_A must "
               "be equal; name the projections in lora.targets to give each its own", where, ka, first, l.targets,
               g.what());
        }
        for (int64_t row = 0; row < p.rows; ++row)
          std::copy_n(Bp.data.begin() + row * r, r, B.data.begin() + (e * g.out + p.row0 + row) * w + blocks[i] * r);
      }
    }
  for (const auto& [key, t] : peft)
    if (!known.count(key))
      fail("{}: tensor {} is not an adapter mpigpt can represent (a {}-layer {} model with lora.targets = {} has "
           "LoRA A and B of {})", where, key, m.num_layers, m.family, l.targets, layer_prefix(m, 0) + "...");
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

// `l` from lora_config_from_peft gives every named projection of a fused layer its own adapter.
// Where all of a fused layer's projections are named and, in every layer (and expert), their
// lora_A are bitwise equal, they were trained as one adapter with a shared A (as mpigpt writes
// qkv and fc1): its targets name that one adapter instead.
std::string shared_targets(const TensorMap& peft, const ModelConfig& m, const LoraConfig& l) {
  std::set<std::string> want = lora_target_set(l.targets);
  std::map<std::string, bool> shared;  // fused target -> every instance's A equal
  for (const Group& g : groups(m)) {
    if (g.pieces.size() < 2 || !std::all_of(g.pieces.begin(), g.pieces.end(), [&](const Piece& p) { return want.count(p.own) > 0; }))
      continue;
    bool& same = shared.try_emplace(g.target, true).first->second;
    for (int layer = 0; layer < m.num_layers && same; ++layer) {
      const HostTensor* first = nullptr;
      for (const Piece& p : g.pieces) {
        auto it = peft.find(layer_prefix(m, layer) + p.module + ".lora_A.weight");
        if (it == peft.end()) same = false;
        else if (!first) first = &it->second;
        else same = same && it->second.shape == first->shape &&
                    std::memcmp(it->second.data.data(), first->data.data(), first->data.size() * 4) == 0;
        if (!same) break;
      }
    }
  }
  for (const auto& [target, same] : shared) {
    if (!same) continue;
    for (const Group& g : groups(m))
      if (g.target == target)
        for (const Piece& p : g.pieces) want.erase(p.own);
    want.insert(target);
  }
  return target_list(want);
}

}  // namespace

LoraConfig read_peft_config(const std::string& dir, const ModelConfig& m, std::string* base_model) {
  LoraConfig l =
      lora_config_from_peft(read_json(dir), m, (std::filesystem::path(dir) / kPeftConfigFile).string(), base_model);
  l.targets = shared_targets(read_safetensors((std::filesystem::path(dir) / kPeftWeightsFile).string()), m, l);
  return l;
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
