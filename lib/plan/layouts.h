// The layouts `mpigpt plan` considers: every tp/sp/cp/ep/pp/vpp/dp, micro-batch, recompute and
// distributed-optimizer choice that divides the GPUs, filtered by Config::validate with reasons counted.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "io/config/config.h"
#include "lib/model/gpt_dims.h"

namespace mpigpt {

// Layout fields pinned by `--fix k=v,...` (unset: free).
struct LayoutFix {
  std::optional<int> tp, pp, vpp, cp, ep, dp, mb;
  std::optional<std::string> recompute;  // none | selective | full
  std::optional<bool> sp, distopt;
  std::optional<bool> overlap;  // the gradient reduction and parameter gather overlapped (default: on)
};

// Parses "tp=8,pp=8,recompute=full,sp=on"; throws mpigpt::Error naming --fix, the key or value and the fields.
LayoutFix parse_layout_fix(const std::string& text);

// The model's shape for a configuration (lib/train's make_dims; the padded vocabulary follows tp).
using DimsOf = std::function<GptDims(const Config&)>;

struct Enumeration {
  std::vector<Config> layouts;            // valid for the world size, in enumeration order
  int64_t considered = 0;                 // combinations built (valid or not)
  std::map<std::string, int64_t> rejected;  // why the others were dropped (the field named), with counts
  std::map<std::string, std::string> example;  // per reason: the first such message
};

// Every layout of `base` (its model, precision, backend) on `gpus` ranks, `per_node` to a node, with
// `global_batch` sequences per step: tp divides per_node (sequence parallel on with tp > 1 unless
// fixed), cp, ep (MoE models), pp up to the layers (uneven pipeline_layout from assign_stages when
// pp does not divide them), vpp where pp * vpp divides them, dp = gpus / (tp cp pp), micro-batch
// dividing global_batch / dp, recompute none/selective/full, the distributed optimizer with dp > 1.
// Layouts Config::validate rejects are counted in `rejected` under the field its message names.
Enumeration enumerate_layouts(const Config& base, int gpus, int per_node, int global_batch, const LayoutFix& fix,
                              const DimsOf& dims);

// The layout fields of a configuration, as `tp8 sp cp1 pp8 vpp3 dp4 mb1 full distopt`.
std::string layout_name(const Config& cfg, int gpus);

// A balanced pipeline_layout for `stages` virtual stages of the model (assign_stages on the time
// model's per-layer work, the embedding on the first stage and the head on the last), as text.
std::string balanced_pipeline_layout(const Config& cfg, const GptDims& d, int stages, int micro_batches);

}  // namespace mpigpt
