// The parameter shards of routed experts (split over ep and expert_tp) and the checkpoint boxes
// they map to.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "lib/model/gpt_testing.h"
#include "lib/model/params.h"
#include "lib/train/checkpointing.h"

using namespace mpigpt;

namespace {

GptDims moe_dims(Family f, int lora_rank = 0) {
  GptDims d = testing::tiny_gpt_dims(f);
  d.lora.rank = lora_rank;  // > 0: the routed experts' LoRA adapters are expert tensors too
  d.moe.E = 4;
  d.moe.K = 2;
  d.moe.F = 12;
  d.moe.layers = {true, true};
  return d;
}

// The global flat index of every element of local range [begin, end) as the boxes place it.
std::vector<int64_t> box_indices(const ParamInfo& p, int64_t begin, int64_t end) {
  const int64_t inner = p.global.ndim > 1 ? p.global.numel() / p.global[0] : 1;
  std::vector<int64_t> at(static_cast<size_t>(end - begin), -1);
  for (const LocalBox& lb : global_boxes(p, begin, end)) {
    int64_t local = lb.local;
    for (int64_t r = 0; r < lb.box.rows; ++r)
      for (int64_t c = 0; c < lb.box.cols; ++c, ++local) {
        REQUIRE(local >= begin);
        REQUIRE(local < end);
        CHECK(at[local - begin] == -1);  // no element twice
        at[local - begin] = (lb.box.row0 + r) * inner + lb.box.col0 + c;
      }
  }
  return at;
}

}  // namespace

// Every element of every expert tensor is held where global_index says, the boxes of any local flat
// range (a distributed-optimizer slice) put each element at that same global place, and together
// the ranks of the expert grid cover each tensor exactly once per replica.
TEST_CASE("expert shards over ep x expert_tp: global_index, checkpoint boxes and coverage agree") {
  for (Family f : {Family::GPT2, Family::Llama})
    for (int ep : {1, 2, 4})
      for (int etp : {1, 2})
        for (int lora : {0, 2}) {
          CAPTURE(int(f));
          CAPTURE(ep);
          CAPTURE(etp);
          CAPTURE(lora);
          const GptDims d = moe_dims(f, lora);
          std::map<std::string, std::vector<int>> cover;  // expert tensor -> holders per global element
          std::map<std::string, int> replicas;
          for (int e = 0; e < ep; ++e)
            for (int t = 0; t < etp; ++t) {
              ModelPlacement pl;
              pl.ep = ep, pl.ep_rank = e, pl.etp = etp, pl.etp_rank = t;
              for (const ParamInfo& p : build_param_table(d, pl)) {
                if (!p.expert) continue;
                CAPTURE(p.name);
                CHECK(p.shape[0] == d.moe.E / ep);
                auto& cv = cover[p.name];
                cv.resize(static_cast<size_t>(p.global.numel()), 0);
                replicas[p.name] = p.split == TpSplit::None ? etp : 1;
                std::vector<int64_t> want(static_cast<size_t>(p.numel()));
                for (int64_t k = 0; k < p.numel(); ++k) ++cv[want[k] = p.global_index(k)];
                // The whole tensor, and flat ranges cutting through rows and experts.
                CHECK(box_indices(p, 0, p.numel()) == want);
                const int64_t n = p.numel();
                for (auto [b, end] : {std::pair<int64_t, int64_t>{1, n - 1}, {n / 3, 2 * n / 3 + 1}, {n / 2, n}})
                  CHECK(box_indices(p, b, end) == std::vector<int64_t>(want.begin() + b, want.begin() + end));
              }
            }
          CHECK(!cover.empty());
          for (const auto& [name, cv] : cover) {
            CAPTURE(name);
            for (int c : cv) REQUIRE(c == replicas[name]);  // every element, once per expert_tp replica
          }
        }
}

TEST_CASE("expert_tp splits fc rows per expert ([gate; up] halves) and proj columns") {
  const GptDims d = moe_dims(Family::Llama);
  ModelPlacement pl;
  pl.ep = 2, pl.ep_rank = 1, pl.etp = 2, pl.etp_rank = 1;
  for (const ParamInfo& p : build_param_table(d, pl)) {
    if (p.name == "layers.0.mlp.experts.fc.weight") {  // (E, 2F, C): experts 2, 3; rows F/2.. of gate and of up
      CHECK(p.shape == Shape{2, 12, d.C});
      const int64_t H = 24;
      CHECK(p.row_blocks == std::vector<std::pair<int64_t, int64_t>>{{2 * H + 6, 6}, {2 * H + 18, 6}, {3 * H + 6, 6},
                                                                       {3 * H + 18, 6}});
    }
    if (p.name == "layers.0.mlp.experts.proj.weight") {  // (E, C, F): columns F/2..F of experts 2, 3
      CHECK(p.shape == Shape{2, d.C, 6});
      CHECK(p.col_begin == 6);
      CHECK(p.row_blocks == std::vector<std::pair<int64_t, int64_t>>{{2 * d.C, 2 * d.C}});
    }
    if (p.name == "layers.0.mlp.router.weight") CHECK(!p.expert);
  }
}

TEST_CASE("the routed experts' LoRA adapters split as their weights: fc A and proj B whole over expert_tp") {
  const GptDims d = moe_dims(Family::Llama, 2);  // E 4, F 12, r 2
  ModelPlacement pl;
  pl.ep = 2, pl.ep_rank = 1, pl.etp = 2, pl.etp_rank = 1;
  using blocks = std::vector<std::pair<int64_t, int64_t>>;
  int seen = 0;
  for (const ParamInfo& p : build_param_table(d, pl)) {
    CAPTURE(p.name);
    if (p.name.find("lora") == std::string::npos) continue;
    ++seen;
    CHECK(!p.frozen);
    if (p.name.find(".mlp.") == std::string::npos) continue;
    REQUIRE(p.name.find(".mlp.experts.") != std::string::npos);  // every layer MoE: no dense MLP adapter
    CHECK(p.expert);
    if (p.name.ends_with("fc.lora_A.weight")) {  // (E, r, C): experts 2, 3 whole
      CHECK(p.shape == Shape{2, 2, d.C});
      CHECK(p.split == TpSplit::None);
      CHECK(p.row_blocks == blocks{{4, 4}});
      CHECK(p.init_bound == doctest::Approx(1.0 / std::sqrt(double(d.C))));
    } else if (p.name.ends_with("fc.lora_B.weight")) {  // (E, 2F, r): as fc's rows
      CHECK(p.shape == Shape{2, 12, 2});
      CHECK(p.split == TpSplit::Rows);
      CHECK(p.row_blocks == blocks{{2 * 24 + 6, 6}, {2 * 24 + 18, 6}, {3 * 24 + 6, 6}, {3 * 24 + 18, 6}});
    } else if (p.name.ends_with("proj.lora_A.weight")) {  // (E, r, F): columns F/2..F
      CHECK(p.shape == Shape{2, 2, 6});
      CHECK(p.split == TpSplit::Cols);
      CHECK(p.col_begin == 6);
      CHECK(p.row_blocks == blocks{{4, 4}});
      CHECK(p.init_bound == doctest::Approx(1.0 / std::sqrt(12.0)));  // the global fan-in
    } else {  // proj B (E, C, r) whole
      CHECK(p.shape == Shape{2, d.C, 2});
      CHECK(p.split == TpSplit::None);
      CHECK(p.row_blocks == blocks{{2 * d.C, 2 * d.C}});
    }
  }
  CHECK(seen == d.L * 4 * 2);  // qkv, proj, the experts' fc and proj, A and B each
}
