// GPU tests of the CUDA blockwise attention (explicit position/document mask), its log-sum-exp
// merge and their ring-attention use, against the CPU backend and against the causal kernels.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "lib/kernels/attention_block_testing.h"
#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kNegInf = -std::numeric_limits<float>::infinity();

using Geo = BlockGeo;
using Inputs = BlockInputs;

// Unit-normal q/k/v (bf16-rounded for a bf16 run, so that the CPU sees the GPU's inputs),
// positions in [0, npos) and document ids in [0, nseg). When Tq >= 3, two queries see no key at
// all: (0, 2) is in a document no key belongs to, (B-1, 0) precedes every key.
Inputs random_inputs(Geo g, uint64_t seed, int npos, int nseg, DType dt) {
  Inputs in = random_block_inputs(g, seed, npos, nseg);
  if (dt == DType::BF16) {
    in.qkv = rounded_bf16(in.qkv);
    in.kv = rounded_bf16(in.kv);
  }
  if (g.Tq >= 3) {
    in.qseg[2] = 1000;
    in.qpos[size_t((g.B - 1) * g.Tq)] = -1;
  }
  return in;
}

// Packed documents as a data loader makes them: queries and keys are the same T tokens, split into
// consecutive documents of the given lengths, with positions counted from each document's start.
// Most 64 x 64 tiles then lie across documents, entirely masked (the kernels skip them).
Inputs packed_inputs(Geo g, const std::vector<int>& docs, uint64_t seed, DType dt) {
  Inputs in = random_inputs(g, seed, 1, 1, dt);
  in.qpos.clear();
  in.qseg.clear();
  for (int64_t b = 0; b < g.B; ++b) {
    int t = 0;
    for (size_t d = 0; d < docs.size(); ++d)
      for (int p = 0; p < docs[d] && t < g.Tq; ++p, ++t) {
        in.qpos.push_back(p);
        in.qseg.push_back(int32_t(d + 10 * b));
      }
  }
  MPIGPT_CHECK(int64_t(in.qpos.size()) == g.B * g.Tq && g.Tq == g.Tk, "packed_inputs: documents must cover Tq = Tk");
  in.kpos = in.qpos;
  in.kseg = in.qseg;
  return in;
}

// The keys [k0, k1) of every batch row as their own block (same queries).
Inputs key_block(const Inputs& in, int64_t k0, int64_t k1) {
  Geo g = in.g;
  g.Tk = k1 - k0;
  Inputs blk{g, in.qkv, {}, in.qpos, in.qseg, {}, {}};
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t j = k0; j < k1; ++j) {
      const size_t src = size_t(b * in.g.Tk + j);
      blk.kv.insert(blk.kv.end(), in.kv.begin() + long(src * size_t(g.RK())),
                    in.kv.begin() + long((src + 1) * size_t(g.RK())));
      blk.kpos.push_back(in.kpos[src]);
      blk.kseg.push_back(in.kseg[src]);
    }
  return blk;
}

struct DeviceInputs {
  DeviceTensor qkv, kv, qpos, qseg, kpos, kseg;
};
DeviceInputs upload(Ops& ops, Inputs& in, DType dt) {
  const Geo& g = in.g;
  return {to_device(ops, in.qkv, {g.B, g.Tq, g.R()}, dt), to_device(ops, in.kv, {g.B, g.Tk, g.RK()}, dt),
          to_device(ops, in.qpos, {g.B, g.Tq}),           to_device(ops, in.qseg, {g.B, g.Tq}),
          to_device(ops, in.kpos, {g.B, g.Tk}),           to_device(ops, in.kseg, {g.B, g.Tk})};
}

// out (B,Tq,C) and lse (B,NH,Tq) of one block call on the host.
struct Result {
  std::vector<float> out, lse;
};

Result cpu_forward(Ops& cpu, Inputs& in) {
  const Geo& g = in.g;
  Result r{std::vector<float>(size_t(g.B * g.Tq * g.C())), std::vector<float>(size_t(g.B * g.NH * g.Tq))};
  cpu.attention_block_forward(as_tensor(r.out, {g.B, g.Tq, g.C()}), as_tensor(r.lse, {g.B, int64_t(g.NH), g.Tq}),
                              as_tensor(in.qkv, {g.B, g.Tq, g.R()}), as_tensor(in.kv, {g.B, g.Tk, g.RK()}),
                              as_tensor(in.qpos, {g.B, g.Tq}), as_tensor(in.qseg, {g.B, g.Tq}),
                              as_tensor(in.kpos, {g.B, g.Tk}), as_tensor(in.kseg, {g.B, g.Tk}), g.NH, g.NKV, g.HD);
  return r;
}

// dqkv and dkv hold the initial values and accumulate.
void cpu_backward(Ops& cpu, Inputs& in, Result& fin, std::vector<float>& dout, std::vector<float>& dqkv,
                  std::vector<float>& dkv) {
  const Geo& g = in.g;
  cpu.attention_block_backward(as_tensor(dqkv, {g.B, g.Tq, g.R()}), as_tensor(dkv, {g.B, g.Tk, g.RK()}),
                               as_tensor(dout, {g.B, g.Tq, g.C()}), as_tensor(in.qkv, {g.B, g.Tq, g.R()}),
                               as_tensor(in.kv, {g.B, g.Tk, g.RK()}), as_tensor(fin.out, {g.B, g.Tq, g.C()}),
                               as_tensor(fin.lse, {g.B, int64_t(g.NH), g.Tq}), as_tensor(in.qpos, {g.B, g.Tq}),
                               as_tensor(in.qseg, {g.B, g.Tq}), as_tensor(in.kpos, {g.B, g.Tk}),
                               as_tensor(in.kseg, {g.B, g.Tk}), g.NH, g.NKV, g.HD);
}

// lse compared with -inf entries required to match exactly (inf - inf is NaN), the rest closely.
void check_lse(const std::vector<float>& got, const std::vector<float>& want, double atol, double rtol) {
  std::vector<float> fin_got, fin_want;
  size_t inf_mismatch = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    if (std::isinf(got[k]) || std::isinf(want[k])) {
      inf_mismatch += got[k] != want[k];
      continue;
    }
    fin_got.push_back(got[k]);
    fin_want.push_back(want[k]);
  }
  CHECK(inf_mismatch == 0);
  auto r = allclose(fin_got, fin_want, atol, rtol);
  CHECK_MESSAGE(r.ok, "lse: ", r.str());
}

// Tolerances, GPU against the CPU backend fed the same (for bf16: bf16-rounded) inputs.
//  f32: both in fp32 with different summation orders, online rescaling and exp2f (2 ulp):
//  differences ~1e-6 relative; 1e-4 abs + rel is ~100x that and far below a mask error (O(0.1)).
//  bf16: the GPU rounds out, dqkv and dkv to bf16 once (2^-9 relative, also on the accumulated
//  initial values) and its backward takes D from the rounded out: 1e-2 for out, 2e-2 for the
//  gradients. lse is f32 from identical inputs in both dtypes: 1e-4 abs + 1e-5 rel.
double out_tol(DType dt) { return dt == DType::F32 ? 1e-4 : 1e-2; }
double grad_tol(DType dt) { return dt == DType::F32 ? 1e-4 : 2e-2; }

void compare(Inputs& in, DType dt, Ops& gpu, Ops& cpu) {
  const Geo& g = in.g;
  const Shape sout{g.B, g.Tq, g.C()}, slse{g.B, int64_t(g.NH), g.Tq}, sqkv{g.B, g.Tq, g.R()}, skv{g.B, g.Tk, g.RK()};
  Result want = cpu_forward(cpu, in);
  DeviceInputs d = upload(gpu, in, dt);
  auto d_out = to_device(gpu, std::vector<float>(want.out.size(), kNaN), sout, dt);  // every element written
  auto d_lse = to_device(gpu, std::vector<float>(want.lse.size(), kNaN), slse);
  gpu.attention_block_forward(d_out.t, d_lse.t, d.qkv.t, d.kv.t, d.qpos.t, d.qseg.t, d.kpos.t, d.kseg.t, g.NH, g.NKV,
                              g.HD);
  const Result got{to_host(gpu, d_out.t), to_host(gpu, d_lse.t)};
  auto r = allclose(got.out, want.out, out_tol(dt), out_tol(dt));
  CHECK_MESSAGE(r.ok, "out: ", r.str());
  check_lse(got.lse, want.lse, 1e-4, 1e-5);
  size_t empty = 0, nonzero = 0;  // queries without a visible key: out exactly 0, lse -inf
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t i = 0; i < g.Tq; ++i)
      for (int64_t h = 0; h < g.NH; ++h) {
        if (want.lse[size_t((b * g.NH + h) * g.Tq + i)] != kNegInf) continue;
        ++empty;
        for (int64_t e = 0; e < g.HD; ++e) nonzero += got.out[size_t((b * g.Tq + i) * g.C() + h * g.HD + e)] != 0.0f;
      }
  if (g.Tq >= 3) CHECK(empty > 0);  // random_inputs made some
  CHECK(nonzero == 0);

  // Backward with each backend's own final out/lse; dqkv and dkv start from random values and
  // accumulate; dqkv's key/value columns stay bitwise as they were.
  auto dout = random_normal(want.out.size(), 411, uint64_t(g.Tk));
  auto dqkv0 = random_normal(in.qkv.size(), 412, uint64_t(g.Tk)), dkv0 = random_normal(in.kv.size(), 413, 0);
  if (dt == DType::BF16) {
    dout = rounded_bf16(dout);
    dqkv0 = rounded_bf16(dqkv0);
    dkv0 = rounded_bf16(dkv0);
  }
  auto dqkv_want = dqkv0, dkv_want = dkv0;
  cpu_backward(cpu, in, want, dout, dqkv_want, dkv_want);
  auto d_dout = to_device(gpu, dout, sout, dt);
  auto d_dqkv = to_device(gpu, dqkv0, sqkv, dt);
  auto d_dkv = to_device(gpu, dkv0, skv, dt);
  gpu.attention_block_backward(d_dqkv.t, d_dkv.t, d_dout.t, d.qkv.t, d.kv.t, d_out.t, d_lse.t, d.qpos.t, d.qseg.t,
                               d.kpos.t, d.kseg.t, g.NH, g.NKV, g.HD);
  const auto dqkv = to_host(gpu, d_dqkv.t);
  r = allclose(dqkv, dqkv_want, grad_tol(dt), grad_tol(dt));
  CHECK_MESSAGE(r.ok, "dqkv: ", r.str());
  r = allclose(to_host(gpu, d_dkv.t), dkv_want, grad_tol(dt), grad_tol(dt));
  CHECK_MESSAGE(r.ok, "dkv: ", r.str());
  size_t touched = 0;
  for (int64_t n = 0; n < g.B * g.Tq; ++n)
    for (int64_t k = g.C(); k < g.R(); ++k) touched += dqkv[size_t(n * g.R() + k)] != dqkv0[size_t(n * g.R() + k)];
  CHECK(touched == 0);
}

std::string describe(const Geo& g, DType dt) {
  return fmt::format("{} B={} Tq={} Tk={} NH={} NKV={} HD={}", dtype_name(dt), g.B, g.Tq, g.Tk, g.NH, g.NKV, g.HD);
}
}  // namespace

TEST_CASE("cuda attention_block_forward/backward match the CPU backend (f32 and bf16, random masks, Tq != Tk)") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  // Tq != Tk both ways, lengths off the 64/32 tiles, GQA and NH == NKV, B > 1, T = 1, every kernel
  // head dim and padded ones (8: vector loads in the 16 kernel; 5, odd: element loads and stores).
  const std::vector<Geo> shapes = {{2, 5, 7, 4, 2, 8},     {2, 37, 200, 8, 2, 64}, {1, 70, 130, 4, 4, 128},
                                   {2, 200, 37, 4, 2, 80}, {2, 1, 1, 2, 1, 32},    {2, 64, 64, 2, 2, 96},
                                   {1, 50, 90, 3, 3, 5},   {2, 33, 40, 4, 1, 16}};
  for (DType dt : {DType::F32, DType::BF16})
    for (const Geo& g : shapes) {
      const std::string shape = describe(g, dt);
      CAPTURE(shape);
      // Positions over about half the keys and 3 documents: every row sees a random subset (with
      // one key: position 0 and one document, so that it is visible).
      const int npos = g.Tk > 1 ? int(std::max<int64_t>(2, g.Tk / 2)) : 1, nseg = g.Tk > 1 ? 3 : 1;
      Inputs in = random_inputs(g, 400 + uint64_t(g.Tk), npos, nseg, dt);
      compare(in, dt, *ops, *cpu);
    }
  // Packed documents (the cu_seqlens case): tiles across documents are fully masked and skipped.
  for (DType dt : {DType::F32, DType::BF16}) {
    const Geo g{2, 230, 230, 4, 2, 64};
    const std::string shape = describe(g, dt);
    CAPTURE(shape);
    Inputs in = packed_inputs(g, {40, 100, 3, 87}, 420, dt);
    in.qseg[2] = 1000;  // a query outside every document, as random_inputs makes
    in.qpos[size_t((g.B - 1) * g.Tq)] = -1;
    compare(in, dt, *ops, *cpu);
  }
}

TEST_CASE("cuda attention_merge matches the CPU merge, -inf on either side included") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  for (DType dt : {DType::F32, DType::BF16})
    for (int HD : {80, 16}) {  // lanes looping over HD > 32, and fewer columns than lanes
      const int64_t B = 2, Tq = 37, NH = 4, C = NH * HD;
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      CAPTURE(HD);
      auto out = random_normal(size_t(B * Tq * C), 430, 0), blk = random_normal(size_t(B * Tq * C), 430, 1);
      auto lse = random_normal(size_t(B * NH * Tq), 431, 0, 2.0f), blk_lse = random_normal(lse.size(), 431, 1, 2.0f);
      if (dt == DType::BF16) {
        out = rounded_bf16(out);
        blk = rounded_bf16(blk);
      }
      // Pattern per (b, h, i): 0 both finite, 1 running -inf, 2 block -inf, 3 both -inf. A side at
      // -inf carries NaN in its out, which must not be read.
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < NH; ++h)
          for (int64_t i = 0; i < Tq; ++i) {
            const size_t l = size_t((b * NH + h) * Tq + i), o = size_t((b * Tq + i) * C + h * HD);
            const int64_t kind = (i + h) % 4;
            if (kind == 1 || kind == 3) {
              lse[l] = kNegInf;
              std::fill(out.begin() + long(o), out.begin() + long(o) + HD, kNaN);
            }
            if (kind == 2 || kind == 3) {
              blk_lse[l] = kNegInf;
              std::fill(blk.begin() + long(o), blk.begin() + long(o) + HD, kNaN);
            }
          }
      const Shape so{B, Tq, C}, sl{B, NH, Tq};
      auto d_out = to_device(*ops, out, so, dt), d_blk = to_device(*ops, blk, so, dt);
      auto d_lse = to_device(*ops, lse, sl), d_blk_lse = to_device(*ops, blk_lse, sl);
      ops->attention_merge(d_out.t, d_lse.t, d_blk.t, d_blk_lse.t);
      cpu->attention_merge(as_tensor(out, so), as_tensor(lse, sl), as_tensor(blk, so), as_tensor(blk_lse, sl));
      // f32: weights in float instead of double, ~1e-7 relative on O(1) values; bf16: one rounding.
      const double tol = dt == DType::F32 ? 1e-5 : 1e-2;
      auto r = allclose(to_host(*ops, d_out.t), out, tol, tol);
      CHECK_MESSAGE(r.ok, "out: ", r.str());
      check_lse(to_host(*ops, d_lse.t), lse, 1e-5, 1e-6);
    }
}

TEST_CASE("cuda ring use: merged key blocks and accumulated block backwards equal one block; causal blocks equal "
          "attention_forward/backward") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const DType dt = DType::F32;
  {
    const Geo g{2, 90, 150, 4, 2, 64};
    Inputs in = random_inputs(g, 440, 60, 2, dt);
    Result want = cpu_forward(*cpu, in);
    auto dout = random_normal(want.out.size(), 441, 0);
    std::vector<float> dqkv_want(in.qkv.size(), 0.0f), dkv_want(in.kv.size(), 0.0f);
    cpu_backward(*cpu, in, want, dout, dqkv_want, dkv_want);

    const std::vector<int64_t> cuts = {0, 64, 100, 150};  // blocks off the tile sizes
    const Shape sout{g.B, g.Tq, g.C()}, slse{g.B, int64_t(g.NH), g.Tq};
    auto d_out = to_device(*ops, std::vector<float>(want.out.size(), kNaN), sout);  // any out under lse = -inf
    auto d_lse = zeros(*ops, slse);
    ops->fill(d_lse.t, kNegInf);
    std::vector<Inputs> blocks;
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      blocks.push_back(key_block(in, cuts[k], cuts[k + 1]));
      DeviceInputs d = upload(*ops, blocks.back(), dt);
      auto blk_out = zeros(*ops, sout), blk_lse = zeros(*ops, slse);
      ops->attention_block_forward(blk_out.t, blk_lse.t, d.qkv.t, d.kv.t, d.qpos.t, d.qseg.t, d.kpos.t, d.kseg.t, g.NH,
                                   g.NKV, g.HD);
      ops->attention_merge(d_out.t, d_lse.t, blk_out.t, blk_lse.t);
    }
    auto r = allclose(to_host(*ops, d_out.t), want.out, 1e-4, 1e-4);
    CHECK_MESSAGE(r.ok, "merged out: ", r.str());
    check_lse(to_host(*ops, d_lse.t), want.lse, 1e-4, 1e-5);

    auto d_dout = to_device(*ops, dout, sout);
    auto d_dqkv = zeros(*ops, {g.B, g.Tq, g.R()});
    std::vector<float> dkv(in.kv.size());
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      Inputs& blk = blocks[k];
      DeviceInputs d = upload(*ops, blk, dt);
      auto d_dkv = zeros(*ops, {g.B, blk.g.Tk, g.RK()});
      ops->attention_block_backward(d_dqkv.t, d_dkv.t, d_dout.t, d.qkv.t, d.kv.t, d_out.t, d_lse.t, d.qpos.t, d.qseg.t,
                                    d.kpos.t, d.kseg.t, g.NH, g.NKV, g.HD);
      const auto part = to_host(*ops, d_dkv.t);
      for (int64_t b = 0; b < g.B; ++b)
        std::copy(part.begin() + long(b * blk.g.Tk * g.RK()), part.begin() + long((b + 1) * blk.g.Tk * g.RK()),
                  dkv.begin() + long((b * g.Tk + cuts[k]) * g.RK()));
    }
    r = allclose(to_host(*ops, d_dqkv.t), dqkv_want, 1e-4, 1e-4);
    CHECK_MESSAGE(r.ok, "dqkv: ", r.str());
    r = allclose(dkv, dkv_want, 1e-4, 1e-4);
    CHECK_MESSAGE(r.ok, "dkv: ", r.str());
  }
  {
    // One document with causal positions: the blockwise kernels equal the causal ones.
    const Geo g{2, 150, 150, 4, 2, 80};
    Inputs in = packed_inputs(g, {150}, 450, dt);
    std::vector<float> kv_cols;
    for (int64_t n = 0; n < g.B * g.Tq; ++n)  // kv = the key and value columns of qkv
      kv_cols.insert(kv_cols.end(), in.qkv.begin() + long(n * g.R() + g.C()), in.qkv.begin() + long((n + 1) * g.R()));
    in.kv = kv_cols;
    DeviceInputs d = upload(*ops, in, dt);
    const Shape sout{g.B, g.Tq, g.C()}, sqkv{g.B, g.Tq, g.R()};
    auto out_b = zeros(*ops, sout), lse_b = zeros(*ops, {g.B, int64_t(g.NH), g.Tq});
    auto out_c = zeros(*ops, sout), saved = zeros(*ops, {ops->attention_saved_numel(g.B, g.Tq, g.NH)});
    ops->attention_block_forward(out_b.t, lse_b.t, d.qkv.t, d.kv.t, d.qpos.t, d.qseg.t, d.kpos.t, d.kseg.t, g.NH,
                                 g.NKV, g.HD);
    ops->attention_forward(out_c.t, saved.t, d.qkv.t, g.NH, g.NKV, g.HD);
    // The same tiles in the same order (the mask skips what the causal bound skips): a few ulp at most.
    auto r = allclose(to_host(*ops, out_b.t), to_host(*ops, out_c.t), 1e-6, 1e-6);
    CHECK_MESSAGE(r.ok, "out: ", r.str());
    r = allclose(to_host(*ops, lse_b.t), to_host(*ops, saved.t), 1e-6, 1e-6);
    CHECK_MESSAGE(r.ok, "lse: ", r.str());

    auto d_dout = to_device(*ops, random_normal(size_t(g.B * g.Tq * g.C()), 451, 0), sout);
    auto dqkv_c = zeros(*ops, sqkv), dqkv_b = zeros(*ops, sqkv), dkv_b = zeros(*ops, {g.B, g.Tk, g.RK()});
    ops->attention_backward(dqkv_c.t, d_dout.t, d.qkv.t, out_c.t, saved.t, g.NH, g.NKV, g.HD);
    ops->attention_block_backward(dqkv_b.t, dkv_b.t, d_dout.t, d.qkv.t, d.kv.t, out_b.t, lse_b.t, d.qpos.t, d.qseg.t,
                                  d.kpos.t, d.kseg.t, g.NH, g.NKV, g.HD);
    ops->copy_cols(dqkv_b.t.view({g.B * g.Tq, g.R()}), g.C(), dkv_b.t.view({g.B * g.Tk, g.RK()}), 0, g.RK());
    r = allclose(to_host(*ops, dqkv_b.t), to_host(*ops, dqkv_c.t), 1e-6, 1e-6);
    CHECK_MESSAGE(r.ok, "dqkv: ", r.str());
  }
  {
    // A block without keys: out 0, lse -inf; its backward adds nothing.
    const Geo g{2, 5, 0, 4, 2, 32};
    Inputs in = random_inputs(g, 460, 4, 2, dt);
    // (no host data to copy for the empty key side: zeros() gives defined, empty device tensors)
    DeviceInputs d{to_device(*ops, in.qkv, {g.B, g.Tq, g.R()}), zeros(*ops, {g.B, 0, g.RK()}),
                   to_device(*ops, in.qpos, {g.B, g.Tq}),      to_device(*ops, in.qseg, {g.B, g.Tq}),
                   zeros(*ops, {g.B, 0}, DType::I32),          zeros(*ops, {g.B, 0}, DType::I32)};
    auto out = to_device(*ops, std::vector<float>(size_t(g.B * g.Tq * g.C()), kNaN), {g.B, g.Tq, g.C()});
    auto lse = to_device(*ops, std::vector<float>(size_t(g.B * g.NH * g.Tq), kNaN), {g.B, int64_t(g.NH), g.Tq});
    ops->attention_block_forward(out.t, lse.t, d.qkv.t, d.kv.t, d.qpos.t, d.qseg.t, d.kpos.t, d.kseg.t, g.NH, g.NKV,
                                 g.HD);
    CHECK(to_host(*ops, out.t) == std::vector<float>(size_t(g.B * g.Tq * g.C()), 0.0f));
    CHECK(to_host(*ops, lse.t) == std::vector<float>(size_t(g.B * g.NH * g.Tq), kNegInf));
    const auto dqkv0 = random_normal(in.qkv.size(), 461, 0);
    auto dqkv = to_device(*ops, dqkv0, {g.B, g.Tq, g.R()});
    auto dkv = zeros(*ops, {g.B, g.Tk, g.RK()});
    ops->attention_block_backward(dqkv.t, dkv.t, out.t, d.qkv.t, d.kv.t, out.t, lse.t, d.qpos.t, d.qseg.t, d.kpos.t,
                                  d.kseg.t, g.NH, g.NKV, g.HD);
    CHECK(to_host(*ops, dqkv.t) == dqkv0);
  }
}

TEST_CASE("cuda attention_block and attention_merge reject bad arguments") {
  auto ops = cuda_ops_or_skip();
  const Geo g{2, 5, 7, 4, 2, 8};
  Inputs in = random_inputs(g, 470, 8, 3, DType::F32);
  DeviceInputs d = upload(*ops, in, DType::F32);
  auto out = zeros(*ops, {g.B, g.Tq, g.C()}), lse = zeros(*ops, {g.B, int64_t(g.NH), g.Tq});
  CHECK_THROWS_WITH_AS(ops->attention_block_forward(out.t, lse.t, d.qkv.t, d.kv.t, d.qpos.t, d.qseg.t, d.kpos.t,
                                                    d.kseg.t, g.NH, 3, g.HD),  // NH % NKV != 0
                       doctest::Contains("attention_block_forward"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_block_forward(out.t, lse.t, d.qkv.t, d.kv.t.view({g.B, g.Tk * 2, g.RK() / 2}),
                                                    d.qpos.t, d.qseg.t, d.kpos.t, d.kseg.t, g.NH, g.NKV, g.HD),
                       doctest::Contains("kv"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_block_forward(out.t, lse.t.flat_slice(0, 30), d.qkv.t, d.kv.t, d.qpos.t,
                                                    d.qseg.t, d.kpos.t, d.kseg.t, g.NH, g.NKV, g.HD),
                       doctest::Contains("lse"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_block_forward(out.t, lse.t, d.qkv.t, d.kv.t, d.qpos.t, d.qseg.t,
                                                    d.kpos.t.flat_slice(0, 13), d.kseg.t, g.NH, g.NKV, g.HD),
                       doctest::Contains("kpos"), Error);
  CHECK_THROWS_AS(ops->attention_block_forward(out.t, lse.t, d.qkv.t, d.kv.t, d.qpos.t, d.qseg.t, d.kv.t, d.kseg.t,
                                               g.NH, g.NKV, g.HD),  // positions must be i32
                  Error);
  auto dqkv = zeros(*ops, {g.B, g.Tq, g.R()}), dkv = zeros(*ops, {g.B, g.Tk, g.RK()});
  CHECK_THROWS_WITH_AS(ops->attention_block_backward(dqkv.t, dkv.t.flat_slice(0, 10), out.t, d.qkv.t, d.kv.t, out.t,
                                                     lse.t, d.qpos.t, d.qseg.t, d.kpos.t, d.kseg.t, g.NH, g.NKV, g.HD),
                       doctest::Contains("dkv"), Error);
  auto small = zeros(*ops, {g.B, int64_t(g.NH), g.Tq - 1});
  CHECK_THROWS_WITH_AS(ops->attention_merge(out.t, lse.t, out.t, small.t), doctest::Contains("attention_merge"), Error);
  // Head dims above the largest kernel are refused with the value in the message.
  const Geo big{1, 3, 3, 1, 1, 256};
  auto qkv_big = zeros(*ops, {big.B, big.Tq, big.R()}), kv_big = zeros(*ops, {big.B, big.Tk, big.RK()});
  auto out_big = zeros(*ops, {big.B, big.Tq, big.C()}), lse_big = zeros(*ops, {big.B, 1, big.Tq});
  auto pos = zeros(*ops, {big.B, big.Tq}, DType::I32);
  CHECK_THROWS_WITH_AS(ops->attention_block_forward(out_big.t, lse_big.t, qkv_big.t, kv_big.t, pos.t, pos.t, pos.t,
                                                    pos.t, big.NH, big.NKV, big.HD),
                       doctest::Contains("HD = 256"), Error);
}
