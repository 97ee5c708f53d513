// The compute of a training step counted in the units a device profile prices: GEMM shapes, layer
// activation elements, attention FLOPs, logit elements and parameter elements, per rank.
#pragma once
#include <cstdint>
#include <vector>

#include "io/config/config.h"
#include "lib/model/gpt_dims.h"
#include "lib/plan/profile.h"

namespace mpigpt {

struct GemmCall {
  int64_t m = 0, n = 0, k = 0;  // c (m,n) = a (m,k) @ b (k,n)
  double count = 0;
};

struct Work {
  std::vector<GemmCall> gemms;  // distinct shapes with their call counts
  double elementwise = 0;       // activation elements of layer passes (forward 1, backward 2 per element)
  double attention_fwd = 0;     // causal-attention forward FLOPs
  double attention_bwd = 0;     // attention backward FLOPs (2 x the forward's)
  double scores_fwd = 0;        // attention score elements (T x T per head, unmasked) a forward writes
  double scores_bwd = 0;        // and a backward
  bool masked = false;          // the attention runs blockwise with an explicit mask (cp, packed documents)
  double crossentropy = 0;      // logit elements
  double optimizer = 0;         // parameter elements this rank updates
  double grad_zero = 0;         // gradient elements this rank holds

  void gemm(int64_t m, int64_t n, int64_t k, double count = 1);
  // A linear layer's backward of the forward GEMM (m,n,k): the input gradient and the weight gradient.
  void gemm_backward(int64_t m, int64_t n, int64_t k, double count = 1);
  void add(const Work& w, double times = 1);
  double gemm_flops() const;
  double gemm_seconds(const DeviceProfile& p) const;  // the plain GEMMs' time from the profile's samples
  double other_seconds(const DeviceProfile& p) const;  // everything but the GEMMs
  double attention_seconds(const DeviceProfile& p) const;  // the attention's part of that
  // One rank's compute time: GEMMs (times gemm_in_model) plus the other ops.
  double seconds(const DeviceProfile& p) const { return gemm_seconds(p) * p.gemm_in_model + other_seconds(p); }
};

// One micro-batch through layers [first, end) of a virtual stage on one rank (tp, cp, sequence
// parallelism, MoE with ep and expert_tp from cfg), with the embedding and/or the head and loss.
// The backward includes what cfg.engine.recompute repeats of the forward.
Work forward_work(const Config& cfg, const GptDims& d, int first, int end, bool embedding, bool head);
Work backward_work(const Config& cfg, const GptDims& d, int first, int end, bool embedding, bool head);

// What one pipeline rank computes in a step of `micro_batches` micro-batches: every chunk's
// forward and backward, and the optimizer over `held` parameter elements of which it owns `owned`.
Work step_work(const Config& cfg, const GptDims& d, int pp_rank, int micro_batches, double held, double owned);

}  // namespace mpigpt
