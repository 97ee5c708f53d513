// Test inputs of the blockwise attention ops (attention_block_forward/backward), shared by the
// CPU tests and the GPU tests that hold the CUDA kernels to the CPU: sizes, host data with views,
// and random queries/keys with random positions and document ids. Header only, plain C++.
#pragma once
#include <cstdint>
#include <vector>

#include "lib/core/rng.h"
#include "lib/kernels/testing.h"

namespace mpigpt::testing {

// One block call's sizes: queries (B,Tq) from qkv (B,Tq,R), keys/values (B,Tk) from kv (B,Tk,RK).
struct BlockGeo {
  int64_t B, Tq, Tk;
  int NH, NKV, HD;
  int64_t R() const { return int64_t(NH + 2 * NKV) * HD; }
  int64_t RK() const { return int64_t(2 * NKV) * HD; }
  int64_t C() const { return int64_t(NH) * HD; }
};

// Everything one block call reads, over host vectors; the tensors are views of them.
struct BlockInputs {
  BlockGeo g;
  std::vector<float> qkv, kv;
  std::vector<int32_t> qpos, qseg, kpos, kseg;
  Tensor tqkv() { return as_tensor(qkv, {g.B, g.Tq, g.R()}); }
  Tensor tkv() { return as_tensor(kv, {g.B, g.Tk, g.RK()}); }
  Tensor tqpos() { return as_tensor(qpos, {g.B, g.Tq}); }
  Tensor tqseg() { return as_tensor(qseg, {g.B, g.Tq}); }
  Tensor tkpos() { return as_tensor(kpos, {g.B, g.Tk}); }
  Tensor tkseg() { return as_tensor(kseg, {g.B, g.Tk}); }
};

inline int32_t rand_int(uint64_t seed, uint64_t i, int n) { return int32_t(bits_at(seed, 7, i) % uint64_t(n)); }

// Random unit-normal q/k/v, positions in [0, npos) and document ids in [0, nseg).
inline BlockInputs random_block_inputs(BlockGeo g, uint64_t seed, int npos, int nseg) {
  BlockInputs in{g, random_normal(size_t(g.B * g.Tq * g.R()), seed, 0),
                 random_normal(size_t(g.B * g.Tk * g.RK()), seed, 1), {}, {}, {}, {}};
  for (int64_t i = 0; i < g.B * g.Tq; ++i) {
    in.qpos.push_back(rand_int(seed, uint64_t(i), npos));
    in.qseg.push_back(rand_int(seed + 1, uint64_t(i), nseg));
  }
  for (int64_t j = 0; j < g.B * g.Tk; ++j) {
    in.kpos.push_back(rand_int(seed + 2, uint64_t(j), npos));
    in.kseg.push_back(rand_int(seed + 3, uint64_t(j), nseg));
  }
  return in;
}

}  // namespace mpigpt::testing
