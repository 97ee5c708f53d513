// The parameter table of a GPT: every weight's global name, global shape, kind, the part of it
// this rank holds (tensor-parallel shard, pipeline stage) and its place in the rank's flat
// parameter buffer; and its layout-independent initialisation.
#pragma once
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "lib/core/tensor.h"
#include "lib/model/gpt_dims.h"

namespace mpigpt {

enum class ParamKind { Weight, Bias, Norm, Embedding };
const char* param_kind_name(ParamKind k);
// Parse training.no_decay, "norms,biases,embeddings" (any subset, or "none"), into parameter kinds.
std::set<ParamKind> parse_no_decay(const std::string& list);

// How a parameter is split over the tensor-parallel ranks.
// For an expert parameter (ParamInfo::expert) the split is over the expert-tensor-parallel group.
enum class TpSplit {
  None,  // replicated on every tp rank
  Rows,  // output rows split: column-parallel linears (heads, MLP up), vocab-parallel embedding/head
  Cols,  // input columns split: row-parallel linears (attention out, MLP down)
};

// Row blocks and columns refer to the tensor's matrix view: cols = its last dimension, rows = the
// product of the others (a 1-D tensor is n rows of 1 column). For 2-D tensors that is the tensor
// itself; an expert tensor (E, H, C) is (E*H, C), so expert e's hidden rows are a row block.
struct ParamInfo {
  std::string name;    // stable, layout-independent (global layer numbers), e.g. "layers.3.attn.qkv.weight"
  Shape shape;         // shape of the part this rank holds
  ParamKind kind = ParamKind::Weight;
  int64_t offset = 0;  // first element in the rank's flat buffer
  float init_std = 0;  // normal(0, init_std); 0 with kind Norm = ones, else zeros
  float init_bound = 0;  // > 0: uniform(-init_bound, init_bound) instead (LoRA's A: Kaiming-uniform)
  int64_t valid_rows = -1;  // global rows beyond this (vocabulary padding) initialise to zero; -1 = all
  Shape global;        // shape of the whole tensor
  TpSplit split = TpSplit::None;
  // The local rows are these global row blocks {first, count} one after the other (empty: all
  // rows). QKV and SwiGLU's [gate; up] have several blocks: a tp rank holds its heads of Q, K
  // and V, and its columns of gate and up.
  std::vector<std::pair<int64_t, int64_t>> row_blocks;
  int64_t col_begin = 0;  // the local columns are global columns [col_begin, col_begin + local cols)
  // A routed expert's weight: split over the expert grid (ep: whole experts; expert_tp: `split`)
  // and replicated over the expert-data-parallel group, whose ranks sum its gradient.
  bool expert = false;
  // The tied output embedding on the last pipeline stage: a copy of embedding.word.weight that
  // is kept equal to stage 0's (synchronised at init, gradient summed over the embedding
  // group). Not a parameter of its own: not counted in the gradient norm, not saved.
  bool replica = false;
  // Not trained (the base model under LoRA): no gradient, no optimizer state, no reduction. The
  // table lays frozen parameters out after every trained one, so the gradient buffer ends where
  // they begin.
  bool frozen = false;
  int64_t numel() const { return shape.numel(); }
  // Columns of the matrix view (the last dimension; 1 for a 1-D tensor), local and global.
  int64_t cols() const { return shape.ndim > 1 ? shape[shape.ndim - 1] : 1; }
  int64_t global_cols() const { return global.ndim > 1 ? global[global.ndim - 1] : 1; }
  // Global flat index of local element i.
  int64_t global_index(int64_t i) const;
};

// Which part of the model a rank holds.
struct ModelPlacement {
  int tp = 1, tp_rank = 0;
  // Routed experts: ep rank j holds experts [j*E/ep, (j+1)*E/ep); expert_tp splits each expert's
  // hidden units (fc rows, proj columns) as tp splits a dense MLP.
  int ep = 1, ep_rank = 0, etp = 1, etp_rank = 0;
  // Layer ranges [first, end) of this rank's model chunks (virtual pipeline stages) in order;
  // empty: one chunk with every layer.
  std::vector<std::pair<int, int>> chunks;
  bool first_stage = true;  // holds the embedding (in chunk 0)
  bool last_stage = true;   // holds the final norm and the output head (in the last chunk)
  int num_chunks() const { return chunks.empty() ? 1 : int(chunks.size()); }
};

// This rank's parameters in buffer order: embedding (first stage) or the tied head's replica
// (last stage), the layers of every chunk (each layer's LoRA adapters after its weights), final
// norm and head (last stage); offsets contiguous, the frozen parameters after all others (a
// data-parallel buffer plan may move them). With the default placement: the whole single-rank model.
std::vector<ParamInfo> build_param_table(const GptDims& d, const ModelPlacement& pl = {});

// A LoRA factor ("layers.3.attn.qkv.lora_A.weight", "...lora_B.weight"), as PEFT names them.
bool is_lora_param(const std::string& name);

// Write the initial values of this rank's part of `p` into `dst` (host, p.numel() floats), from
// the counter-based RNG indexed by the element's position in the global tensor (DESIGN principle
// 3), so every layout holds exactly the slices of the single-rank model.
void init_param(const ParamInfo& p, uint64_t seed, float* dst);

}  // namespace mpigpt
