// Shared helpers of the activation-recomputation tests: one training pass of a GPT, the bit-for-bit
// comparison of two such passes, and the activation sizes expected of each engine.recompute mode.
#pragma once
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "lib/model/gpt.h"

namespace mpigpt::testing {

// What one training pass (run_recompute) produced.
struct RecomputeRun {
  double loss = 0, moe_loss = 0, moe_imbalance = 0;
  int moe_forwards = 0;
  std::vector<float> grads;
  size_t activation_bytes = 0;
};

// One training pass with several micro-batches in flight through every chunk, as a pipeline's
// warm-up holds them: forwards of every micro-batch through every chunk (chunk c's output handed to
// chunk c + 1), then their backwards in reverse; chunk_grad is one buffer for all chunks, so a
// chunk's input gradient is already where the chunk below it reads its output gradient.
inline RecomputeRun run_recompute(GPT& m, const std::vector<MicroBatchInput>& mbs, float dloss) {
  RecomputeRun r;
  m.zero_grads();
  m.reset_moe_loss();
  const int nc = m.num_chunks(), nm = int(mbs.size());
  for (int mb = 0; mb < nm; ++mb)
    for (int c = 0; c < nc; ++c) {
      if (c > 0) {
        const Tensor out = m.chunk_output(c - 1, mb), in = m.chunk_input(c, mb);
        std::memcpy(in.ptr, out.ptr, size_t(out.numel()) * sizeof(float));
      }
      r.loss += m.forward_chunk(c, mb, mbs[mb], dloss);
    }
  for (int mb = nm - 1; mb >= 0; --mb)
    for (int c = nc - 1; c >= 0; --c) m.backward_chunk(c, mb);
  r.moe_loss = m.moe_loss_sum();
  r.moe_imbalance = m.moe_imbalance_sum();
  r.moe_forwards = m.moe_forwards();
  const float* g = m.grads_flat().f32();
  r.grads.assign(g, g + m.grads_flat().numel());
  r.activation_bytes = m.activation_bytes();
  return r;
}

// Recomputation repeats the same ops on the same inputs: everything must agree to the bit.
inline void check_bit_identical(const RecomputeRun& a, const RecomputeRun& b) {
  CHECK(a.loss == b.loss);
  CHECK(a.moe_loss == b.moe_loss);  // the recomputed forwards are not counted again
  CHECK(a.moe_imbalance == b.moe_imbalance);
  CHECK(a.moe_forwards == b.moe_forwards);
  REQUIRE(a.grads.size() == b.grads.size());
  CHECK(std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * sizeof(float)) == 0);
}

// Bytes of an arena tensor of n f32 elements (offsets rounded to 64 bytes).
inline size_t arena_bytes(int64_t n) { return (size_t(n) * sizeof(float) + 63) / 64 * 64; }

// What one dense layer saves per micro-batch on a rank of a tp group (sp: sequence parallel),
// Tl tokens per row, att_saved elements of attention state.
inline size_t dense_layer_bytes(const GptDims& d, int B, int64_t Tl, int tp, bool sp, int64_t att_saved) {
  const int64_t N = B * Tl, Nl = sp ? N / tp : N, C = d.C, HD = d.HD(), Fl = d.F / tp;
  const int64_t nh = d.NH / tp, nkv = d.NKV / tp, stats = d.gpt2() ? 2 : 1;  // mean + rstd, or rstd
  size_t n = 2 * (arena_bytes(Nl * C) + stats * arena_bytes(Nl));          // n1, n2 and their statistics
  n += arena_bytes(N * (nh + 2 * nkv) * HD) + arena_bytes(att_saved);        // qkv, attention state
  n += arena_bytes(N * nh * HD) + arena_bytes(Nl * C);                       // att, mid
  n += arena_bytes(N * (d.gpt2() ? Fl : 2 * Fl)) + arena_bytes(N * Fl);      // fc, act
  return n;
}

// The activation bytes of `none` less those of selective and of full for a dense model with
// `slots` micro-batches in flight over `layers` layers: selective keeps one attention state for
// all, full one layer's worth and its output instead of every layer's.
inline void check_dense_savings(const RecomputeRun& none, const RecomputeRun& sel, const RecomputeRun& full,
                                const GptDims& d, int B, int64_t Tl, int tp, bool sp, int64_t att_saved, int slots,
                                int layers) {
  const size_t layer = dense_layer_bytes(d, B, Tl, tp, sp, att_saved), held = size_t(slots) * layers;
  const int64_t Nl = sp ? B * Tl / tp : B * Tl;
  CHECK(full.activation_bytes < sel.activation_bytes);
  CHECK(sel.activation_bytes < none.activation_bytes);
  CHECK(none.activation_bytes - sel.activation_bytes == (held - 1) * arena_bytes(att_saved));
  CHECK(none.activation_bytes - full.activation_bytes == (held - 1) * layer - arena_bytes(Nl * d.C));
}

}  // namespace mpigpt::testing
