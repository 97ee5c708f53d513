// The sizes of a GPT, resolved once (from io's ModelConfig by lib/train, or directly in tests):
// everything lib/model needs to know about the network's shape, nothing about files or ranks.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "lib/core/tensor.h"

namespace mpigpt {

enum class Family { GPT2, Llama };

// The mixture-of-experts shape: which layers replace their dense MLP by a MoE layer (lib/model/moe.h).
struct MoeDims {
  int E = 0;                     // experts per MoE layer (0: every layer dense)
  int K = 2;                     // experts per token
  bool sigmoid = false;          // router scores: sigmoid (else softmax)
  bool norm_topk = false;        // softmax: renormalise the K gates
  float aux_coeff = 0.0f;        // load-balancing loss coefficient
  float z_coeff = 0.0f;          // router z-loss coefficient
  float capacity_factor = 0.0f;  // <= 0: dropless
  bool drop_position = false;    // over capacity drop the latest tokens (else the lowest gates)
  int F = 0;                     // hidden units per expert
  int shared_F = 0;              // hidden units of the shared expert (0: none)
  std::vector<bool> layers;      // per layer: a MoE layer
};

// LoRA adapters (lib/model/lora.h): which linear layers of every block carry them, their rank and
// scale. rank 0: none, every parameter is trained; else only the adapters are, the rest is frozen.
// kLoraQkv / kLoraFc1 adapt the fused qkv / SwiGLU [gate; up] layer with one A; kLoraQ, K, V, Gate,
// Up give each of those projections an adapter of its own (r rows of A and r columns of B each).
enum LoraTarget : unsigned {
  kLoraQkv = 1, kLoraProj = 2, kLoraFc1 = 4, kLoraFc2 = 8, kLoraQ = 16, kLoraK = 32, kLoraV = 64, kLoraGate = 128,
  kLoraUp = 256
};
struct LoraDims {
  int rank = 0;                                                    // r
  float alpha = 16.0f;                                             // the update is scaled by alpha / r
  bool rslora = false;                                             // rank-stabilised: alpha / sqrt(r)
  unsigned targets = kLoraQkv | kLoraProj | kLoraFc1 | kLoraFc2;  // LoraTarget bits
  bool on() const { return rank > 0; }
  // Whether layer `t` (kLoraQkv, kLoraProj, kLoraFc1, kLoraFc2) has an adapter, shared or per projection.
  bool adapts(LoraTarget t) const;
  // The adapters' scale, rounded to float from double as PEFT's (lora_alpha / r or / math.sqrt(r)).
  float scale() const { return float(double(alpha) / (rslora ? std::sqrt(double(rank)) : double(rank))); }
  // The adapter block of each of layer t's `nparts` row parts (qkv: q, k, v; fc1: gate, up, or
  // GPT-2's one): 0 for all under one shared adapter; else the adapted projections' blocks in
  // order and -1 for a projection without one. The layer's A has width(t) = rank x blocks rows,
  // B as many columns, part p's rows of B non-zero only in block p's r columns.
  std::vector<int> part_blocks(LoraTarget t, int nparts) const;
  int64_t width(LoraTarget t, int nparts = 1) const;
};

struct GptDims {
  Family family = Family::GPT2;
  int L = 4;          // layers
  int C = 256;        // channels
  int NH = 4;         // query heads
  int NKV = 4;        // key/value heads (grouped-query attention when < NH)
  int F = 1024;       // MLP hidden size
  int T = 256;        // sequence length the activations are sized for
  int maxT = 256;     // rows of the learned position table (GPT-2)
  int V = 257;        // real vocabulary
  int Vp = 384;       // padded vocabulary (rows of the embedding / logits columns)
  bool tied = true;   // output projection = input embedding
  bool qkv_bias = false;  // llama: the q/k/v projections carry a bias (Qwen2); GPT-2's always do
  float eps = 1e-5f;  // norm epsilon
  // Activations and the compute copies of the weights (bf16 mixed precision: masters, gradients
  // and optimizer state stay fp32).
  DType act = DType::F32;
  float rope_theta = 10000.f;
  float init_std = 0.02f;
  MoeDims moe;
  LoraDims lora;

  bool is_moe(int l) const { return moe.E > 0 && l >= 0 && size_t(l) < moe.layers.size() && moe.layers[l]; }

  int HD() const { return C / NH; }
  // Rows of layer t's LoRA A (0: not adapted): LoraDims::width over its row parts (qkv: q, k, v;
  // fc1: SwiGLU's gate and up, GPT-2's one).
  int64_t lora_width(LoraTarget t) const;
  int qkv_dim() const { return (NH + 2 * NKV) * HD(); }
  bool gpt2() const { return family == Family::GPT2; }
  bool has_qkv_bias() const { return gpt2() || qkv_bias; }
  // Model FLOPs of one training step (forward + backward = 3x forward) per token, counted as
  // Megatron does: every GEMM, causal attention halved, the logits GEMM over Vp. Under LoRA the
  // frozen weights' GEMMs count 2x (no weight gradient), the adapters' 3x.
  double train_flops_per_token() const;
  int64_t num_params() const;
};

// The kind of activation slot a model chunk of layers [first, end) needs: chunks of one kind share
// a pool of slots (a micro-batch's saved activations), so a rank holds at once only what its
// schedule has in flight over all of them. Equal vectors, equal slots.
std::vector<int> slot_kind(const GptDims& d, int first, int end, bool embed, bool head);

// Vocabulary padded up to a multiple of `multiple` (Megatron: 128 * tp).
inline int pad_vocab(int V, int multiple) { return (V + multiple - 1) / multiple * multiple; }

}  // namespace mpigpt
