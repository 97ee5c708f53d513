// The GPT: embedding, L transformer blocks, final norm and output head, forward and backward
// written once against ops.h. Both families (GPT-2 and Llama) share this code; they differ in
// the norm (LayerNorm/RMSNorm), positions (learned/RoPE), MLP (GELU/SwiGLU), biases and tying.
#pragma once
#include <cstdint>
#include <vector>

#include "lib/kernels/buffer.h"
#include "lib/kernels/ops.h"
#include "lib/model/gpt_dims.h"
#include "lib/model/params.h"

namespace mpigpt {

class GPT {
 public:
  // Activations are sized for micro-batches of B sequences of d.T tokens.
  GPT(const GptDims& d, Ops& ops, int B);

  const GptDims& dims() const { return d_; }
  int batch() const { return B_; }
  const std::vector<ParamInfo>& params() const { return table_; }
  Tensor params_flat() const { return params_.tensor({num_params_}); }
  Tensor grads_flat() const { return grads_.tensor({num_params_}); }
  Tensor param(int i) const;
  Tensor grad(int i) const;
  int64_t num_params() const { return num_params_; }
  size_t activation_bytes() const { return arena_.bytes(); }

  // Initialise every parameter from (seed, its name, element index).
  void init_weights(uint64_t seed);
  void zero_grads();

  // Forward over one micro-batch. tokens and targets: host arrays of B*T ids (target < 0 is
  // ignored). Returns the sum of the token losses. With dloss != 0 the logits are replaced by
  // their gradient scaled by dloss (the loss's weight per token), ready for backward().
  double forward(const int32_t* tokens, const int32_t* targets, float dloss);
  // Accumulates the gradients of the last forward (which must have had dloss != 0).
  void backward();
  // The logits of the last forward without gradient, (B*T, Vp).
  Tensor logits() const { return logits_; }

 private:
  struct Block {  // one layer's weights (views into the flat buffers) ...
    Tensor n1w, n1b, qkvw, qkvb, projw, projb, n2w, n2b, fcw, fcb, fpw, fpb;
  };
  struct BlockActs {  // ... and the activations its backward needs
    Tensor n1, n1_mean, n1_rstd, qkv, att_saved, att, mid, n2, n2_mean, n2_rstd, fc, act;
  };
  Block weights(const Buffer& buf, int l) const;
  Tensor view_of(const Buffer& buf, const std::string& name) const;
  void norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor w, Tensor b);
  void norm_backward(Tensor dinp, Tensor dw, Tensor db, Tensor dout, Tensor inp, Tensor mean, Tensor rstd,
                     Tensor w);
  void block_forward(int l, Tensor x_in, Tensor x_out);
  void block_backward(int l, Tensor x_in, Tensor dres);

  GptDims d_;
  Ops& ops_;
  int B_;
  std::vector<ParamInfo> table_;
  int64_t num_params_ = 0;
  Buffer params_, grads_;
  std::vector<Block> w_, g_;  // weights and their gradients per layer
  Tensor wte_, wpe_, nfw_, nfb_, head_, dwte_, dwpe_, dnfw_, dnfb_, dhead_;

  Arena arena_;
  Tensor tokens_, targets_, positions_, losses_;
  std::vector<Tensor> resid_;  // resid_[l]: input of layer l; resid_[L]: output of the last
  std::vector<BlockActs> a_;
  Tensor xf_, xf_mean_, xf_rstd_, logits_;
  // Backward scratch, shared by all layers.
  Tensor dres_, dn_, dqkv_, datt_, dfc_, dact_;
  bool have_grad_logits_ = false;
};

}  // namespace mpigpt
