// AdamW over a model's flat parameter buffer, or over the ranges of it this rank owns (the
// distributed optimizer): fp32 moments, decoupled weight decay per parameter, bias correction,
// and clipping by the global gradient norm.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "lib/kernels/buffer.h"
#include "lib/kernels/ops.h"
#include "parallel/data_parallel.h"

namespace mpigpt {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

// A parameter as the optimizer sees it: elements [offset, offset + numel) of the flat buffers,
// and whether weight decay applies to it (the caller decides by the parameter's kind).
struct OptimParam {
  std::string name;  // for errors
  int64_t offset = 0, numel = 0;
  bool decay = true;
};

class AdamW {
 public:
  // The optimizer updates `params` (flat) from `grads` (flat) on the elements of `owned` (empty:
  // the whole buffer) that belong to one of `table`'s parameters. m and v are held only for those
  // elements, packed in buffer order. An owned range may cut through a parameter; elements
  // outside every parameter (padding) are never touched.
  AdamW(Ops& ops, const std::vector<OptimParam>& table, Tensor params, Tensor grads, const AdamWConfig& cfg,
        const std::vector<Range>& owned = {});
  // One step at learning rate lr; gradients are multiplied by grad_scale first (clipping).
  void step(float lr, float grad_scale);
  int64_t steps() const { return step_; }
  void set_steps(int64_t s) { step_ = s; }  // resuming from a checkpoint
  // The moments of the updated elements, packed (state_numel() elements).
  Tensor m() const { return m_.tensor({state_numel_}); }
  Tensor v() const { return v_.tensor({state_numel_}); }
  int64_t state_numel() const { return state_numel_; }
  int64_t state_bytes() const { return 2 * state_numel_ * 4; }

  // Which elements of which parameter the state holds (for checkpoints: a rank writes exactly
  // these hyperslabs): elements [begin, begin + count) of the buffer, parameter `param` of the
  // table given to the constructor, state elements [state, state + count).
  struct Piece {
    int param;
    int64_t begin, count, state;
  };
  const std::vector<Piece>& pieces() const { return pieces_; }

 private:
  Ops& ops_;
  Tensor params_, grads_;
  AdamWConfig cfg_;
  std::vector<Piece> pieces_;
  // Consecutive pieces with the same weight decay, merged: the step updates them all in one call.
  std::vector<AdamWRun> runs_;
  int64_t state_numel_ = 0;
  Buffer m_, v_;
  int64_t step_ = 0;
};

// sqrt of the sum of squares of the gradients, and the factor that clips them to max_norm
// (1 when max_norm is 0 or the norm is below it).
double grad_norm(Ops& ops, Tensor grads);
// The sum of squares of grads over `ranges` (in their order): this rank's part of the squared
// global norm when it owns only some ranges; the caller sums it over the groups that split the
// parameters and their ownership.
double sum_squares_of(Ops& ops, Tensor grads, const std::vector<Range>& ranges);
float clip_scale(double norm, double max_norm);

}  // namespace mpigpt
