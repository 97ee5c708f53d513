// The GPT: embedding, L transformer blocks, final norm and output head, forward and backward
// written once against ops.h. Both families (GPT-2 and Llama) share this code; they differ in
// the norm (LayerNorm/RMSNorm), positions (learned/RoPE), MLP (GELU/SwiGLU), biases and tying.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lib/kernels/buffer.h"
#include "lib/kernels/ops.h"
#include "lib/model/gpt_dims.h"
#include "lib/model/lora.h"
#include "lib/model/moe.h"
#include "lib/model/params.h"
#include "parallel/context_parallel.h"
#include "parallel/tensor_parallel.h"

namespace mpigpt {

// How the sequence of a micro-batch is laid out: split over a context-parallel group, and/or
// packed with several documents per row. Either one switches attention to the masked
// (positions + document ids) path of parallel/context_parallel.
struct SequenceLayout {
  const Comm* cp = nullptr;  // context-parallel group (nullptr: the whole sequence on this rank)
  CpCommType cp_comm = CpCommType::P2P;
  bool packed = false;       // documents packed into rows: positions restart, attention stays inside
};

// How the mixture-of-experts layers (d.moe) reach the other tokens of a micro-batch and the
// experts. The token group of a MoE layer is the set of ranks holding other tokens of the same
// micro-batch: tp under sequence parallelism, cp, or both (tp_cp). Experts are split over the
// ep group (whole experts) and expert_tp (hidden units), as the placement's table says; null
// groups mean size 1.
struct MoeLayout {
  const Comm* tp_cp = nullptr;      // the tp x cp group (needed when both split the tokens)
  bool allgather = false;           // AllGatherDispatcher (over expert_tp x ep), else AllToAllDispatcher (over ep)
  const Comm* ep = nullptr;         // expert-parallel group
  const Comm* expert_tp = nullptr;  // expert-tensor-parallel group
  const Comm* expert_tp_ep = nullptr;
  std::vector<int> ep_of_member;    // of expert_tp_ep's members (Mesh::ep_of_member)
};

// Activation recomputation (engine.recompute), Megatron's granularities. None keeps every
// layer's saved activations per micro-batch in flight. Selective drops the attention core's
// saved state (softmax(QK^T) on the CPU backend: B*NH*T*T floats per layer) and recomputes it
// from the saved qkv before the attention backward; the blockwise path (context parallelism,
// packed sequences) saves only the log-sum-exp and keeps it, so there selective changes nothing.
// Full keeps only each layer's input (the residual stream) and runs the layer's forward again,
// into one scratch shared by all layers, just before its backward.
enum class Recompute { None, Selective, Full };
Recompute parse_recompute(const std::string& s);  // "none" | "selective" | "full"

// One micro-batch as a rank's model chunk sees it (host arrays).
struct MicroBatchInput {
  const int32_t* tokens = nullptr;   // (B*Tl) this rank's tokens (read by the embedding's chunk)
  const int32_t* targets = nullptr;  // (B*Tl) their targets, < 0 ignored (read by the head's chunk)
  // With a SequenceLayout that is split or packed: positions within the document and document
  // ids of every cp rank's tokens, (cp, B, Tl) rank-major (CpMicroBatch); else nullptr.
  const int32_t* pos = nullptr;
  const int32_t* seg = nullptr;
  // (B*Tl) the flat index b*T + t in the micro-batch of each of this rank's tokens (context
  // parallelism: CpMicroBatch::index); nullptr: the tokens are 0..B*T-1 in order. MoE capacity
  // decisions are taken by it, so they do not depend on the layout.
  const int32_t* token_index = nullptr;
};

// One GPT object is what one rank holds: its tensor-parallel shard of the layers of its model
// chunks (virtual pipeline stages), the embedding on the first stage and the head on the last.
// Each chunk runs forward and backward per micro-batch; a chunk keeps one set of activations
// per micro-batch in flight (pipeline schedules run several forwards before their backwards);
// activation recomputation (Recompute) shrinks what each set keeps.
class GPT {
 public:
  // The whole model on one rank; activations sized for micro-batches of B sequences of d.T.
  GPT(const GptDims& d, Ops& ops, int B);
  // This rank's part: `table` from build_param_table(d, pl), its offsets possibly moved by a
  // data-parallel buffer plan of `buffer_numel` elements.
  // Tokens per row on this rank: Tl = T / cp.
  GPT(const GptDims& d, Ops& ops, int B, const ModelPlacement& pl, const TensorParallel& tp,
      std::vector<ParamInfo> table, int64_t buffer_numel, const SequenceLayout& seq = {}, const MoeLayout& moe = {});
  ~GPT();

  const GptDims& dims() const { return d_; }
  int batch() const { return B_; }
  int64_t local_seq_len() const { return Tl_; }  // T / cp
  const std::vector<ParamInfo>& params() const { return table_; }
  Tensor params_flat() const { return params_.tensor({buffer_numel_}); }
  // The gradients of the trained parameters: every parameter's, or under LoRA the adapters' only
  // (the frozen ones, laid out last, have none: grad(i) is undefined for them).
  Tensor grads_flat() const { return grads_.tensor({grad_numel_}); }
  Tensor param(int i) const;
  Tensor grad(int i) const;
  // Parameter i as forward and backward read it: param(i) when computing in f32, else its copy in
  // the compute dtype (refreshed at its chunk's next forward after params_changed()).
  Tensor compute_param(int i) const { return at(compute_params(), table_.at(i), d_.act); }
  int64_t num_params() const { return num_params_; }  // elements this rank holds (without padding)
  size_t activation_bytes() const;                   // of every activation set allocated so far (MoE state included)
  // Before the first forward (activations are sized by it). Default Recompute::None.
  void set_recompute(Recompute r);
  Recompute recompute() const { return recompute_; }

  // Initialise every parameter from (seed, its name, global element index).
  void init_weights(uint64_t seed);
  // The fp32 masters (param(i), params_flat()) changed: with a bf16 compute dtype each chunk's bf16
  // copy is refreshed at its next forward (after the caller waited for the chunk's parameters).
  void params_changed();
  // The distributed optimizer's bf16 gather (parallel/data_parallel.h), computing in bf16 only:
  // the compute copy as one flat tensor in the masters' layout; convert_params() converts
  // elements [lo, hi) of the masters into it now, one copy per range (this rank's updated slices,
  // before the gather); after the gather compute_params_gathered() says that the whole copy is
  // current, so no chunk converts at its next forward.
  Tensor compute_params_flat() const;
  void convert_params(const std::vector<std::pair<int64_t, int64_t>>& ranges);
  void compute_params_gathered();
  // Elements [lo, hi) of the masters that forward reads in f32 even when computing in bf16 (the
  // MoE routers): a bf16 gather does not bring them, the caller must.
  std::vector<std::pair<int64_t, int64_t>> master_reads() const;
  void zero_grads();

  // ---- per chunk and micro-batch (the pipeline stage interface) -----------------------------
  int num_chunks() const { return int(chunks_.size()); }
  bool has_embedding(int c) const { return chunks_[c].embed; }
  bool has_head(int c) const { return chunks_[c].head; }
  // Parameter indices [first, end) of chunk c (its layers, plus embedding / head it holds).
  std::pair<int, int> chunk_params(int c) const { return {chunks_[c].first_param, chunks_[c].end_param}; }
  // Rows of the activations passed between chunks: (B*T, C), or (B*T/tp, C) with sequence
  // parallelism.
  int64_t boundary_rows() const { return Nl_; }
  // Where a received input activation of (c, mb) goes (for chunks without the embedding).
  Tensor chunk_input(int c, int mb);
  // Forward of chunk c on micro-batch mb. tokens/targets: host arrays of B*T ids of that
  // micro-batch (the first chunk reads tokens, the head's chunk targets; target < 0 is
  // ignored). Returns the sum of the token losses on the head's chunk, else 0. With
  // dloss != 0 the logits become their gradient scaled by dloss, ready for backward.
  double forward_chunk(int c, int mb, const MicroBatchInput& in, float dloss);
  double forward_chunk(int c, int mb, const int32_t* tokens, const int32_t* targets, float dloss) {
    return forward_chunk(c, mb, MicroBatchInput{tokens, targets}, dloss);
  }
  Tensor chunk_output(int c, int mb) const;  // the activation to pass on (not on the head's chunk)
  // Where the received gradient of chunk c's output goes; backward_chunk leaves the gradient
  // of its input there (valid until the next backward).
  Tensor chunk_grad(int c) const { (void)c; return dres_; }
  // Backward of (c, mb); frees its activations. When `final` is given it is called with the
  // parameter index ranges whose gradients this backward completed (the caller passes it on
  // the last micro-batch, so a data-parallel bucket can start reducing).
  using GradsFinal = std::function<void(int first_param, int end_param)>;
  void backward_chunk(int c, int mb, const GradsFinal& final = {});
  // Frees the activations of (c, mb) without a backward (evaluation).
  void release(int c, int mb);

  // ---- mixture of experts -------------------------------------------------------------------
  // Backward adds aux_scale * the gradient of every MoE layer's aux and z losses (the trainer:
  // micro_batch / global_batch, the mean over the global batch's micro-batches). Default 1.
  void set_moe_aux_scale(float s) { aux_scale_ = s; }
  // Sum of the MoE aux + z losses (already times their coefficients) of every forward of this
  // rank's MoE layers since the last reset; identical on the ranks of a token group.
  double moe_loss_sum() const { return aux_sum_; }
  // Sum and count of the MoE layers' load imbalance (MoeLosses::load_imbalance) over the same
  // forwards.
  double moe_imbalance_sum() const { return imbalance_sum_; }
  int moe_forwards() const { return moe_forwards_; }
  void reset_moe_loss() { aux_sum_ = imbalance_sum_ = 0.0, moe_forwards_ = 0; }

  // ---- the whole model at once (one chunk; tests and single-stage use) ----------------------
  double forward(const int32_t* tokens, const int32_t* targets, float dloss) {
    return forward_chunk(0, 0, tokens, targets, dloss);
  }
  void backward() { backward_chunk(0, 0); }
  // The logits of the last forward of micro-batch 0 without gradient, (B*T, Vp/tp).
  Tensor logits() const;

 private:
  struct Lora {  // a linear layer's LoRA factors (undefined: not adapted; gradients: not wanted)
    Tensor A, B;
    bool on() const { return A.defined(); }
  };
  struct Block {  // one layer's weights (views into the flat buffers) ...
    Tensor n1w, n1b, qkvw, qkvb, projw, projb, n2w, n2b, fcw, fcb, fpw, fpb;
    bool is_moe = false;
    MoeWeights moe;  // the MoE layer's weights in place of fc/fp
    Lora lqkv, lproj, lfc, lfp;
  };
  struct BlockActs {  // ... and the activations its backward needs
    Tensor n1, n1_mean, n1_rstd, qkv, att_saved, att, mid, n2, n2_mean, n2_rstd, fc, act;
    Tensor uqkv, uproj, ufc, ufp;  // LoRA: s x A^T of each adapted layer (N, r)
  };
  struct Slot {  // the activations of one micro-batch in one chunk
    explicit Slot(Ops& ops) : arena(ops) {}
    int chunk = -1, mb = -1;
    bool busy = false;
    Arena arena;
    Tensor tokens, targets, losses;  // (N): tokens on the embedding's chunk, targets on the head's
    Tensor positions, pos_all, seg_all;  // masked attention: (N) own positions, (cp*N) every rank's
    std::vector<Tensor> resid;       // resid[i]: input of the chunk's i-th layer; resid.back(): output
    std::vector<BlockActs> a;        // per layer of the chunk (empty under full recomputation)
    std::vector<std::unique_ptr<MoeActs>> moe;  // per layer of the chunk; null for dense layers (and under full)
    std::vector<int32_t> moe_index;             // (Nl) token index of each local row in the micro-batch
    Tensor xf, xf_mean, xf_rstd, xf_full, logits;  // head
    bool have_grad_logits = false;
  };
  struct Chunk {
    int first_layer = 0, end_layer = 0, first_param = 0, end_param = 0;
    bool embed = false, head = false;
    // Element ranges [lo, hi) of the parameter buffer converted into the compute dtype for it.
    std::vector<std::pair<int64_t, int64_t>> convert;
    int pool = 0;  // its slots' pool in pools_ (shared by the chunks of one slot_kind)
  };
  // Construction: the chunks and their parameter ranges, the embedding's and head's views, each
  // chunk's conversion ranges, and the buffers every micro-batch shares.
  void setup(const ModelPlacement& pl);
  void setup_chunks(const ModelPlacement& pl);
  void setup_views(const ModelPlacement& pl);
  void setup_convert_ranges();
  void setup_arena();
  int index_of_prefix(const std::string& prefix) const;
  Slot& acquire(int c, int mb);
  Slot* find(int c, int mb) const;
  Block weights(const Buffer& buf, int l, DType dt) const;
  // The weights forward and backward compute with: the fp32 masters, or their copy in d.act.
  const Buffer& compute_params() const { return d_.act == DType::F32 ? params_ : cparams_; }
  void refresh_compute_params(int c);
  Tensor positions(const Slot& s) const;
  // Parameter p's place in a flat buffer of dtype dt (masters, gradients or the compute copy).
  // The tensor of `shape` at element `offset` of a parameter-shaped buffer holding dt elements.
  Tensor at(const Buffer& buf, int64_t offset, Shape shape, DType dt) const;
  Tensor at(const Buffer& buf, const ParamInfo& p, DType dt) const;
  Tensor view_of(const Buffer& buf, const std::string& name, DType dt = DType::F32) const;
  void norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor w, Tensor b);
  // sum = a + b, then norm_forward of sum (the residual add fused into the norm).
  void residual_norm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b, Tensor w,
                             Tensor bias);
  void norm_backward(Tensor dinp, Tensor dw, Tensor db, Tensor dout, Tensor inp, Tensor mean, Tensor rstd,
                     Tensor w);
  // The saved activations of layer i of a slot's chunk (global layer l): the slot's own, or
  // under full recomputation the shared scratch.
  BlockActs& acts(Slot& s, int i);
  MoeActs* moe_acts(Slot& s, int l, int i);
  int64_t att_saved_numel() const;
  bool recomputes_attention() const { return recompute_ == Recompute::Selective && !masked_; }
  void plan_block(Arena& A, BlockActs& a, bool dense, bool att_saved) const;
  // Returns the MoE layer's losses (default ones for a dense layer); the caller counts them.
  MoeLosses block_forward(int l, const Slot& s, BlockActs& a, MoeActs* m, Tensor x_in, Tensor x_out);
  void attention_core(const Slot& s, BlockActs& a);
  void block_backward(int l, const Slot& s, BlockActs& a, MoeActs* m, Tensor x_in, Tensor dres);
  void mlp_backward(const Block& w, const Block& g, BlockActs& a, Tensor dres);
  // A layer's LoRA update (lib/model/lora.h) when it is adapted; nothing otherwise.
  void lora_forward(const Lora& w, Tensor out, Tensor u, Tensor x);
  void lora_backward(const Lora& w, const Lora& g, Tensor dx, Tensor dout, Tensor x, Tensor u,
                     const LoraParts& parts = LoraParts{});
  // lora_mask_grad for each routed expert's fc B gradient (El, [gate; up] rows, width).
  void expert_lora_mask(Tensor dB);
  double head_forward(Slot& s, float dloss);
  void head_backward(Slot& s);

  GptDims d_;
  Ops& ops_;
  int B_;
  TensorParallel tp_;
  ContextParallel cp_;
  bool masked_ = false;     // attention by positions and document ids (cp > 1 or packed)
  int64_t Tl_ = 0;          // tokens per row on this rank (T / cp)
  int64_t N_ = 0, Nl_ = 0;  // rows of a micro-batch on this rank (B*Tl), and of its tp sequence shard
  int nh_ = 0, nkv_ = 0;    // heads this tp rank computes
  std::unique_ptr<TokenDispatcher> dispatcher_;  // MoE (when d.moe.E > 0)
  std::unique_ptr<MoeLayer> moe_;                // one layer object for every MoE layer (weights per call)
  float aux_scale_ = 1.0f;
  double aux_sum_ = 0.0, imbalance_sum_ = 0.0;
  int moe_forwards_ = 0;
  std::vector<ParamInfo> table_;
  int64_t num_params_ = 0, buffer_numel_ = 0;
  int64_t grad_numel_ = 0;  // the gradient buffer: up to the first frozen parameter
  Buffer params_, grads_;
  Buffer cparams_;           // the compute copy of params_ when d.act is not f32
  std::vector<char> stale_;  // per chunk: cparams_ lags params_
  std::vector<Chunk> chunks_;
  std::vector<std::vector<std::unique_ptr<Slot>>> pools_;
  std::vector<int> local_of_layer_;                // global layer -> index into w_, g_, layer_params_
  std::vector<Block> w_, g_;                       // weights and their gradients per local layer
  std::vector<std::pair<int, int>> layer_params_;  // parameter index range per local layer
  std::pair<int, int> embed_params_{0, 0}, head_params_{0, 0};
  int head_param_ = -1;  // the head's (or its tied replica's) index in the table
  Tensor wte_, wpe_, nfw_, nfb_, head_, dwte_, dwpe_, dnfw_, dnfb_, dhead_;

  Recompute recompute_ = Recompute::None;
  // Recomputation's scratch, one layer's worth shared by all layers and micro-batches: full: a
  // whole BlockActs (+ MoeActs) and the recomputed output; selective: the attention state only.
  std::unique_ptr<Arena> rc_arena_;
  BlockActs rc_acts_;
  MoeActs rc_moe_;
  Tensor rc_out_;

  Arena arena_;  // shared by every chunk: positions and backward scratch
  Tensor positions_;
  Tensor dres_, dn_, full_, dqkv_, datt_, dfc_, dact_, dlora_, ce_max_, ce_sum_, ce_target_;
  // Adapters per projection (lib/model/lora.h): this rank's row parts of qkv's and fc's B, and
  // zeros to clear their gradients outside the blocks.
  LoraParts lqkv_parts_, lfc_parts_;
  Tensor lora_zeros_;
  // Sequence parallelism: a norm output gathered over tp for a column-parallel layer, shared by all
  // layers. The forward gathers into it and the backward gathers again (as Megatron-LM does), so a
  // layer keeps only its (Nl, C) shards.
  Tensor gathered_;
};

}  // namespace mpigpt
