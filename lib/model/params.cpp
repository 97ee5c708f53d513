// The GPT parameter table, its tensor-parallel shards and weight initialisation.
#include "lib/model/params.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "lib/core/error.h"
#include "lib/core/rng.h"

namespace mpigpt {

const char* param_kind_name(ParamKind k) {
  switch (k) {
    case ParamKind::Weight: return "weight";
    case ParamKind::Bias: return "bias";
    case ParamKind::Norm: return "norm";
    case ParamKind::Embedding: return "embedding";
  }
  return "?";
}

std::set<ParamKind> parse_no_decay(const std::string& list) {
  std::set<ParamKind> kinds;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty() || item == "none") continue;
    if (item == "norms") kinds.insert(ParamKind::Norm);
    else if (item == "biases") kinds.insert(ParamKind::Bias);
    else if (item == "embeddings") kinds.insert(ParamKind::Embedding);
    else if (item == "weights") kinds.insert(ParamKind::Weight);
    else fail("training.no_decay: '{}' is not a parameter kind; use a comma list of norms, biases, embeddings, weights (or none)", item);
  }
  return kinds;
}

int64_t ParamInfo::global_index(int64_t i) const {
  const int64_t c = cols(), gcols = global_cols();
  int64_t row = i / c;
  const int64_t col = col_begin + i % c;
  if (row_blocks.empty()) return row * gcols + col;
  for (const auto& [first, count] : row_blocks) {
    if (row < count) return (first + row) * gcols + col;
    row -= count;
  }
  fail("{}: local element {} lies beyond its row blocks", name, i);
}

namespace {

// Builds the table of one rank: `add` decides the local part of each global tensor.
struct TableBuilder {
  const GptDims& d;
  const ModelPlacement& pl;
  std::vector<ParamInfo> t;

  static ParamInfo make(std::string name, Shape g, ParamKind k, float std, int64_t valid_rows) {
    ParamInfo p;
    p.name = std::move(name);
    p.shape = p.global = g;
    p.kind = k;
    p.init_std = std;
    p.valid_rows = valid_rows;
    return p;
  }

  // Local rows: block r of every one of `parts` equal parts of the global rows.
  ParamInfo& add_rows(std::string name, Shape g, ParamKind k, float std, std::vector<int64_t> parts,
                      int64_t valid_rows = -1) {
    ParamInfo p = make(std::move(name), g, k, std, valid_rows);
    if (pl.tp > 1) {
      int64_t first = 0, rows = 0;
      for (int64_t part : parts) {
        MPIGPT_CHECK(part % pl.tp == 0, "{}: {} rows do not split over tp {}", p.name, part, pl.tp);
        p.row_blocks.push_back({first + pl.tp_rank * (part / pl.tp), part / pl.tp});
        first += part;
        rows += part / pl.tp;
      }
      p.shape = g.ndim > 1 ? Shape{rows, g[1]} : Shape{rows};
      p.split = TpSplit::Rows;
    }
    t.push_back(std::move(p));
    return t.back();
  }
  ParamInfo& add_cols(std::string name, Shape g, ParamKind k, float std) {
    ParamInfo p = make(std::move(name), g, k, std, -1);
    if (pl.tp > 1) {
      MPIGPT_CHECK(g[1] % pl.tp == 0, "{}: {} columns do not split over tp {}", p.name, g[1], pl.tp);
      p.col_begin = pl.tp_rank * (g[1] / pl.tp);
      p.shape = Shape{g[0], g[1] / pl.tp};
      p.split = TpSplit::Cols;
    }
    t.push_back(std::move(p));
    return t.back();
  }
  ParamInfo& add_full(std::string name, Shape g, ParamKind k, float std = 0) {
    t.push_back(make(std::move(name), g, k, std, -1));
    return t.back();
  }
  // The LoRA factors of the linear layer `base` ("layers.3.attn.qkv"), in -> out features, split
  // over tp so that the adapted layer equals the single-rank one: a column-parallel base
  // (`parts`: its row blocks) has A replicated and B split as its rows; a row-parallel base
  // (empty `parts`) has A split on the input columns as its own, B replicated. A is
  // Kaiming-uniform with a = sqrt(5) (as PEFT's), bound 1/sqrt(in) from the GLOBAL fan-in; B zero.
  // r: A's rows, the layer's LoraDims::width.
  void add_lora(const std::string& base, int64_t in, int64_t out, const std::vector<int64_t>& parts, int64_t r) {
    const float bound = 1.0f / std::sqrt(float(in));
    if (!parts.empty()) {
      add_full(base + ".lora_A.weight", {r, in}, ParamKind::Weight).init_bound = bound;
      add_rows(base + ".lora_B.weight", {out, r}, ParamKind::Weight, 0, parts);
    } else {
      add_cols(base + ".lora_A.weight", {r, in}, ParamKind::Weight, 0).init_bound = bound;
      add_full(base + ".lora_B.weight", {out, r}, ParamKind::Weight);
    }
  }
  // A routed-expert tensor of global shape (E, ...): this ep rank's El = E/ep experts, and of
  // each the expert_tp share of its hidden units. hidden_parts > 0: the hidden units are the
  // last-but-one dimension (fc: (E, H, C); the bias (E, H), whose matrix view has them as
  // columns) in that many equal parts ([gate; up]); -1: they are the columns (proj (E, C, F));
  // 0: no hidden dimension, replicated over expert_tp (proj bias).
  ParamInfo& add_expert(std::string name, Shape g, ParamKind k, float std, int hidden_parts) {
    ParamInfo p = make(std::move(name), g, k, std, -1);
    p.expert = true;
    const int64_t E = g[0], El = E / pl.ep, gcols = p.global_cols(), per_expert = g.numel() / E / gcols;
    MPIGPT_CHECK(E % pl.ep == 0, "{}: {} experts do not split over ep {}", p.name, E, pl.ep);
    const int64_t e0 = pl.ep_rank * El;
    p.shape.d[0] = El;
    if (pl.etp > 1 && hidden_parts > 0 && g.ndim == 3) {  // rows of every local expert: `hidden_parts` blocks each
      const int64_t part = per_expert / hidden_parts;
      MPIGPT_CHECK(part % pl.etp == 0, "{}: {} rows do not split over expert_tp {}", p.name, part, pl.etp);
      for (int64_t e = e0; e < e0 + El; ++e)
        for (int h = 0; h < hidden_parts; ++h)
          p.row_blocks.push_back({e * per_expert + h * part + pl.etp_rank * (part / pl.etp), part / pl.etp});
      p.shape.d[1] = per_expert / pl.etp;
      p.split = TpSplit::Rows;
    } else if (pl.etp > 1 && hidden_parts != 0) {  // the hidden units are the columns (proj; fc bias)
      MPIGPT_CHECK(hidden_parts <= 1, "{}: a bias with [gate; up] halves cannot split over expert_tp", p.name);
      MPIGPT_CHECK(gcols % pl.etp == 0, "{}: {} columns do not split over expert_tp {}", p.name, gcols, pl.etp);
      p.col_begin = pl.etp_rank * (gcols / pl.etp);
      p.shape.d[g.ndim - 1] = gcols / pl.etp;
      p.split = TpSplit::Cols;
    }
    if (p.row_blocks.empty() && pl.ep > 1) p.row_blocks.push_back({e0 * per_expert, El * per_expert});
    t.push_back(std::move(p));
    return t.back();
  }
  // The LoRA factors of every routed expert of `base` ("layers.3.mlp.experts.fc"), in -> out
  // features each, split as the base: fc (`hidden_parts` > 0 blocks of rows) has A replicated over
  // expert_tp and B split as its rows; proj (-1) has A split on its input columns (the hidden
  // units) and B replicated. ep splits whole experts. A's bound is from the GLOBAL fan-in.
  void add_expert_lora(const std::string& base, int64_t E, int64_t in, int64_t out, int hidden_parts, int64_t r) {
    const float bound = 1.0f / std::sqrt(float(in));
    const bool fc = hidden_parts > 0;
    add_expert(base + ".lora_A.weight", {E, r, in}, ParamKind::Weight, 0, fc ? 0 : -1).init_bound = bound;
    add_expert(base + ".lora_B.weight", {E, out, r}, ParamKind::Weight, 0, fc ? hidden_parts : 0);
  }
};

}  // namespace

std::vector<ParamInfo> build_param_table(const GptDims& d, const ModelPlacement& pl) {
  TableBuilder b{d, pl, {}};
  const bool g = d.gpt2();
  // Residual-branch output projections are scaled by 1/sqrt(2L) (GPT-2 paper, Megatron).
  const float out_std = d.init_std / std::sqrt(2.0f * d.L);
  const int64_t HD = d.HD(), q = int64_t(d.NH) * HD, kv = int64_t(d.NKV) * HD, F = d.F;
  using parts_t = std::vector<int64_t>;
  if (pl.first_stage) {
    b.add_rows("embedding.word.weight", {d.Vp, d.C}, ParamKind::Embedding, d.init_std, {d.Vp}, d.V);
    if (g) b.add_full("embedding.position.weight", {d.maxT, d.C}, ParamKind::Embedding, d.init_std);
  }
  std::vector<std::pair<int, int>> chunks = pl.chunks;
  if (chunks.empty()) chunks.push_back({0, d.L});
  for (const auto& [first, end] : chunks)
    for (int l = first; l < end; ++l) {
      std::string p = "layers." + std::to_string(l) + ".";
      b.add_full(p + "attn_norm.weight", {d.C}, ParamKind::Norm);
      if (g) b.add_full(p + "attn_norm.bias", {d.C}, ParamKind::Bias);
      // A tp rank holds its query heads and the key/value heads they read: three row blocks.
      b.add_rows(p + "attn.qkv.weight", {q + 2 * kv, d.C}, ParamKind::Weight, d.init_std, {q, kv, kv});
      if (d.has_qkv_bias()) b.add_rows(p + "attn.qkv.bias", {q + 2 * kv}, ParamKind::Bias, 0, {q, kv, kv});
      b.add_cols(p + "attn.proj.weight", {d.C, q}, ParamKind::Weight, out_std);
      if (g) b.add_full(p + "attn.proj.bias", {d.C}, ParamKind::Bias);
      b.add_full(p + "mlp_norm.weight", {d.C}, ParamKind::Norm);
      if (g) b.add_full(p + "mlp_norm.bias", {d.C}, ParamKind::Bias);
      const bool moe = d.is_moe(l);
      if (moe) {
        // Routed experts as one (E, ...) tensor per projection: ep rank j holds experts
        // [j*El, (j+1)*El), expert_tp splits each one's hidden units. SwiGLU experts hold
        // [gate; up] rows per expert, as the dense MLP does.
        const int64_t E = d.moe.E, Fe = d.moe.F, Fs = d.moe.shared_F, H = g ? Fe : 2 * Fe, Hs = g ? Fs : 2 * Fs;
        b.add_full(p + "mlp.router.weight", {E, d.C}, ParamKind::Weight, d.init_std);
        b.add_expert(p + "mlp.experts.fc.weight", {E, H, d.C}, ParamKind::Weight, d.init_std, g ? 1 : 2);
        if (g) b.add_expert(p + "mlp.experts.fc.bias", {E, H}, ParamKind::Bias, 0, 1);
        b.add_expert(p + "mlp.experts.proj.weight", {E, d.C, Fe}, ParamKind::Weight, out_std, -1);
        if (g) b.add_expert(p + "mlp.experts.proj.bias", {E, d.C}, ParamKind::Bias, 0, 0);
        if (Fs > 0) {
          b.add_full(p + "mlp.shared.fc.weight", {Hs, d.C}, ParamKind::Weight, d.init_std);
          if (g) b.add_full(p + "mlp.shared.fc.bias", {Hs}, ParamKind::Bias);
          b.add_full(p + "mlp.shared.proj.weight", {d.C, Fs}, ParamKind::Weight, out_std);
          if (g) b.add_full(p + "mlp.shared.proj.bias", {d.C}, ParamKind::Bias);
        }
      } else {
        // SwiGLU's gate and up projections are one [gate; up] matrix, split as two blocks.
        if (g)
          b.add_rows(p + "mlp.fc.weight", {F, d.C}, ParamKind::Weight, d.init_std, {F});
        else
          b.add_rows(p + "mlp.fc.weight", {2 * F, d.C}, ParamKind::Weight, d.init_std, {F, F});
        if (g) b.add_rows(p + "mlp.fc.bias", {F}, ParamKind::Bias, 0, {F});
        b.add_cols(p + "mlp.proj.weight", {d.C, F}, ParamKind::Weight, out_std);
        if (g) b.add_full(p + "mlp.proj.bias", {d.C}, ParamKind::Bias);
      }
      const LoraDims& lo = d.lora;
      const int64_t r = lo.rank, rqkv = d.lora_width(kLoraQkv), rfc = d.lora_width(kLoraFc1);
      if (lo.adapts(kLoraQkv)) b.add_lora(p + "attn.qkv", d.C, q + 2 * kv, {q, kv, kv}, rqkv);
      if (lo.adapts(kLoraProj)) b.add_lora(p + "attn.proj", q, d.C, {}, r);
      // A MoE layer's fc1/fc2 adapters are one per routed expert; the shared expert is not adapted.
      const int64_t E = d.moe.E, Fe = d.moe.F;
      if (lo.adapts(kLoraFc1) && moe) b.add_expert_lora(p + "mlp.experts.fc", E, d.C, g ? Fe : 2 * Fe, g ? 1 : 2, rfc);
      if (lo.adapts(kLoraFc1) && !moe) b.add_lora(p + "mlp.fc", d.C, g ? F : 2 * F, g ? parts_t{F} : parts_t{F, F}, rfc);
      if (lo.adapts(kLoraFc2) && moe) b.add_expert_lora(p + "mlp.experts.proj", E, Fe, d.C, -1, r);
      if (lo.adapts(kLoraFc2) && !moe) b.add_lora(p + "mlp.proj", F, d.C, {}, r);
    }
  if (pl.last_stage) {
    b.add_full("final_norm.weight", {d.C}, ParamKind::Norm);
    if (g) b.add_full("final_norm.bias", {d.C}, ParamKind::Bias);
    if (!d.tied) b.add_rows("lm_head.weight", {d.Vp, d.C}, ParamKind::Weight, d.init_std, {d.Vp}, d.V);
  }
  if (pl.last_stage && d.tied && !pl.first_stage) {
    // First in the buffer: its gradient is complete only after the sum with stage 0's, at the
    // end of the step, and the data-parallel bucket holding the first parameters reduces last.
    b.add_rows("embedding.word.weight", {d.Vp, d.C}, ParamKind::Embedding, d.init_std, {d.Vp}, d.V).replica = true;
    std::rotate(b.t.begin(), b.t.end() - 1, b.t.end());
  }
  // Under LoRA everything but the adapters is frozen, and laid out after them.
  for (auto& p : b.t) p.frozen = d.lora.on() && !is_lora_param(p.name);
  int64_t off = 0;
  for (bool frozen : {false, true})
    for (auto& p : b.t)
      if (p.frozen == frozen) {
        p.offset = off;
        off += p.numel();
      }
  return b.t;
}

bool is_lora_param(const std::string& name) {
  return name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight");
}

void init_param(const ParamInfo& p, uint64_t seed, float* dst) {
  const int64_t n = p.numel();
  if (p.init_bound > 0) {
    const uint64_t stream = stream_of(p.name);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      dst[i] = float((2.0 * uniform_at(seed, stream, uint64_t(p.global_index(i))) - 1.0) * p.init_bound);
    return;
  }
  if (p.init_std == 0) {
    const float v = p.kind == ParamKind::Norm ? 1.0f : 0.0f;
    for (int64_t i = 0; i < n; ++i) dst[i] = v;
    return;
  }
  const uint64_t stream = stream_of(p.name);
  const int64_t gcols = p.global_cols();
  const int64_t limit = p.valid_rows < 0 ? p.global.numel() : p.valid_rows * gcols;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t gi = p.global_index(i);
    dst[i] = gi < limit ? p.init_std * normal_at(seed, stream, uint64_t(gi)) : 0.0f;
  }
}

}  // namespace mpigpt
