// The pipeline executor's test double: a fake stage (a chain of affine maps) that records every
// way the executor could misuse it, and the serial single-process reference it must reproduce.
// Shared by the two- and four-rank executor tests.
#pragma once
#include "parallel/pipeline_parallel.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "lib/core/error.h"

using namespace mpigpt;

namespace {

// Virtual stage s maps x to y = a_s * x + b_s elementwise; the loss of micro-batch mb is
// sum(y * w_mb) at the last stage. Parameters and data are fixed functions of their indices.
float stage_a(int s) { return 1.0f + 0.25f * float(s); }
float stage_b(int s) { return 0.5f - 0.125f * float(s); }
float input_of(int mb, int i) { return 0.1f * float(mb + 1) + 0.01f * float(i % 97); }
float weight_of(int mb, int i) { return 1.0f + 0.5f * float(i % 7) - 0.25f * float(mb); }

// The arithmetic, shared by the serial reference and the fake stage so that both round alike.
void affine_forward(std::vector<float>& y, const std::vector<float>& x, int s) {
  y.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = stage_a(s) * x[i] + stage_b(s);
}
// dx = a_s * dy (when dx is given); da_s += sum(dy * x), db_s += sum(dy).
void affine_backward(std::vector<float>* dx, float& da, float& db, const std::vector<float>& dy,
                     const std::vector<float>& x, int s) {
  float sa = 0, sb = 0;
  for (size_t i = 0; i < dy.size(); ++i) sa += dy[i] * x[i], sb += dy[i];
  da += sa;
  db += sb;
  if (dx) {
    dx->resize(dy.size());
    for (size_t i = 0; i < dy.size(); ++i) (*dx)[i] = stage_a(s) * dy[i];
  }
}
std::vector<float> input_vector(int mb, int width) {
  std::vector<float> x(width);
  for (int i = 0; i < width; ++i) x[i] = input_of(mb, i);
  return x;
}
std::vector<float> loss_gradient(int mb, int width) {  // d loss / d y at the last stage = w_mb
  std::vector<float> w(width);
  for (int i = 0; i < width; ++i) w[i] = weight_of(mb, i);
  return w;
}
float loss_of(const std::vector<float>& y, int mb) {
  float l = 0;
  for (size_t i = 0; i < y.size(); ++i) l += y[i] * weight_of(mb, i);
  return l;
}
bool has_nan(const std::vector<float>& v) {
  for (float f : v)
    if (std::isnan(f)) return true;
  return false;
}

// The whole model in one process: losses per micro-batch, gradients per virtual stage,
// accumulated over the micro-batches in increasing order (as every pipeline chunk does).
struct Reference {
  std::vector<float> loss, da, db;
};
Reference serial(int stages, int m, int width) {
  Reference ref{std::vector<float>(m), std::vector<float>(stages, 0.0f), std::vector<float>(stages, 0.0f)};
  for (int mb = 0; mb < m; ++mb) {
    std::vector<std::vector<float>> xs(stages);
    std::vector<float> x = input_vector(mb, width), y;
    for (int s = 0; s < stages; ++s) {
      xs[s] = x;
      affine_forward(y, x, s);
      x = y;
    }
    ref.loss[mb] = loss_of(x, mb);
    std::vector<float> dy = loss_gradient(mb, width), dx;
    for (int s = stages - 1; s >= 0; --s) {
      affine_backward(&dx, ref.da[s], ref.db[s], dy, xs[s], s);
      dy = dx;
    }
  }
  return ref;
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One pipeline rank's chunks of the affine chain, written to catch a misbehaving executor:
// received buffers start as NaN (so data that never arrived shows), the output buffers are one
// per rank and poisoned at every compute (so an output not copied in time is lost, and asking
// for one that is no longer there is reported), and every call checks that it comes in a
// legal order. Violations go to `misuse` instead of throwing, so no peer is left waiting.
class AffineStage final : public PipelineStage {
 public:
  AffineStage(int pp, int vpp, int rank, int m, int width = 5)
      : loss(m, kNaN), da(vpp, 0.0f), db(vpp, 0.0f), pp_(pp), vpp_(vpp), rank_(rank), m_(m), width_(width),
        slots_(size_t(m) * vpp) {}

  Tensor forward_input(int mb, int chunk) override {
    Slot& sl = slot("forward_input", mb, chunk);
    if (stage(chunk) == 0) wrong("forward_input({}, {}) on virtual stage 0, which reads its own input", mb, chunk);
    if (sl.forwarded) wrong("forward_input({}, {}) after its forward", mb, chunk);
    if (sl.input_given) wrong("forward_input({}, {}) twice", mb, chunk);
    sl.input_given = true;
    sl.x.assign(width_, kNaN);
    return Tensor(sl.x.data(), {width_});
  }

  void forward(int mb, int chunk) override {
    Slot& sl = slot("forward", mb, chunk);
    poison_outputs();
    const int s = stage(chunk);
    if (sl.forwarded) wrong("forward({}, {}) twice", mb, chunk);
    sl.forwarded = true;
    if (s == 0) {
      sl.x = input_vector(mb, width_);
    } else if (!sl.input_given || has_nan(sl.x)) {
      wrong("forward({}, {}) before its input arrived", mb, chunk);
      sl.x.assign(width_, kNaN);
    }
    std::vector<float> y;
    affine_forward(y, sl.x, s);
    if (s == last()) {
      loss[mb] = loss_of(y, mb);
    } else {
      out_ = y;
      out_holds_ = {mb, chunk};
    }
  }

  Tensor forward_output(int mb, int chunk) override {
    slot("forward_output", mb, chunk);
    if (stage(chunk) == last()) wrong("forward_output({}, {}) on the last virtual stage", mb, chunk);
    if (out_holds_ != std::pair{mb, chunk})
      wrong("forward_output({}, {}): the buffer holds ({}, {}); asked before the forward, or after the next compute "
            "reused it",
            mb, chunk, out_holds_.first, out_holds_.second);
    return Tensor(out_.data(), {width_});
  }

  Tensor backward_input(int mb, int chunk) override {
    Slot& sl = slot("backward_input", mb, chunk);
    if (stage(chunk) == last()) wrong("backward_input({}, {}) on the last virtual stage", mb, chunk);
    if (!sl.forwarded || sl.backwarded) wrong("backward_input({}, {}) outside forward..backward", mb, chunk);
    if (sl.grad_given) wrong("backward_input({}, {}) twice", mb, chunk);
    sl.grad_given = true;
    sl.dy.assign(width_, kNaN);
    return Tensor(sl.dy.data(), {width_});
  }

  void backward(int mb, int chunk) override {
    Slot& sl = slot("backward", mb, chunk);
    poison_outputs();
    const int s = stage(chunk);
    if (!sl.forwarded) wrong("backward({}, {}) before its forward", mb, chunk);
    if (sl.backwarded) wrong("backward({}, {}) twice", mb, chunk);
    sl.backwarded = true;
    if (s == last()) {
      sl.dy = loss_gradient(mb, width_);
    } else if (!sl.grad_given || has_nan(sl.dy)) {
      wrong("backward({}, {}) before its output gradient arrived", mb, chunk);
      sl.dy.assign(width_, kNaN);
    }
    if (sl.x.size() != size_t(width_)) sl.x.assign(width_, kNaN);
    std::vector<float> dx;
    affine_backward(s > 0 ? &dx : nullptr, da[chunk], db[chunk], sl.dy, sl.x, s);
    sl.x.assign(width_, kNaN);  // the input is no longer needed: a late use shows as NaN
    if (s > 0) {
      gout_ = dx;
      gout_holds_ = {mb, chunk};
    }
  }

  Tensor backward_output(int mb, int chunk) override {
    slot("backward_output", mb, chunk);
    if (stage(chunk) == 0) wrong("backward_output({}, {}) on virtual stage 0", mb, chunk);
    if (gout_holds_ != std::pair{mb, chunk})
      wrong("backward_output({}, {}): the buffer holds ({}, {}); asked before the backward, or after the next "
            "compute reused it",
            mb, chunk, gout_holds_.first, gout_holds_.second);
    return Tensor(gout_.data(), {width_});
  }

  // After the step: every micro-batch went forward and backward through every chunk.
  void finish() {
    for (int c = 0; c < vpp_; ++c)
      for (int mb = 0; mb < m_; ++mb) {
        const Slot& sl = slots_[size_t(mb) * vpp_ + c];
        if (!sl.forwarded || !sl.backwarded) wrong("({}, {}) never ran forward and backward", mb, c);
      }
  }

  int stage(int chunk) const { return virtual_stage(pp_, rank_, chunk); }
  int last() const { return pp_ * vpp_ - 1; }

  std::vector<std::string> misuse;
  std::vector<float> loss;  // per micro-batch, on the rank of the last virtual stage
  std::vector<float> da, db;  // per chunk

 private:
  struct Slot {
    std::vector<float> x, dy;
    bool input_given = false, forwarded = false, grad_given = false, backwarded = false;
  };
  template <class... Args>
  void wrong(fmt::format_string<Args...> f, Args&&... args) {
    misuse.push_back(fmt::format("rank {}: ", rank_) + fmt::format(f, std::forward<Args>(args)...));
  }
  Slot& slot(const char* call, int mb, int chunk) {
    if (mb < 0 || mb >= m_ || chunk < 0 || chunk >= vpp_) {
      wrong("{}({}, {}) out of range", call, mb, chunk);
      return spare_;
    }
    return slots_[size_t(mb) * vpp_ + chunk];
  }
  void poison_outputs() {
    out_.assign(width_, kNaN);
    gout_.assign(width_, kNaN);
    out_holds_ = gout_holds_ = {-1, -1};
  }

  int pp_, vpp_, rank_, m_, width_;
  std::vector<Slot> slots_;
  Slot spare_;
  std::vector<float> out_ = std::vector<float>(width_, kNaN), gout_ = std::vector<float>(width_, kNaN);
  std::pair<int, int> out_holds_{-1, -1}, gout_holds_{-1, -1};
};

// A failure inside the executor must not leave the other ranks waiting in a receive.
template <class F>
void or_abort(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected error: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

// make_schedule(pp = world, vpp, m) through the executor on every rank, against the serial
// reference: the losses on the last stage's rank and each chunk's gradients, bit for bit (both
// sides do the same float operations in the same order).
void check_against_serial(const Comm& comm, int vpp, int m, int width = 5) {
  const int pp = comm.size(), rank = comm.rank();
  CAPTURE(pp);
  CAPTURE(vpp);
  CAPTURE(m);
  CAPTURE(rank);
  const Schedule schedule = make_schedule(pp, vpp, m);
  AffineStage stage(pp, vpp, rank, m, width);
  or_abort([&] { run_schedule(schedule[rank], stage, comm); });
  stage.finish();
  CHECK_MESSAGE(stage.misuse.empty(), (stage.misuse.empty() ? std::string() : stage.misuse.front()));
  const Reference ref = serial(pp * vpp, m, width);
  for (int c = 0; c < vpp; ++c) {
    CHECK(stage.da[c] == ref.da[stage.stage(c)]);
    CHECK(stage.db[c] == ref.db[stage.stage(c)]);
  }
  if (rank == pp - 1)
    for (int mb = 0; mb < m; ++mb) CHECK(stage.loss[mb] == ref.loss[mb]);
}

}  // namespace
