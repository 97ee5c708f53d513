// Tests of the CPU backend's blockwise masked attention, its log-sum-exp merge and the row/column moves.
#include <doctest/doctest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "lib/kernels/attention_block_testing.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

using Geo = BlockGeo;
using Inputs = BlockInputs;

bool visible(const Inputs& in, int64_t b, int64_t i, int64_t j) {
  const size_t q = size_t(b * in.g.Tq + i), k = size_t(b * in.g.Tk + j);
  return in.kseg[k] == in.qseg[q] && in.kpos[k] <= in.qpos[q];
}

// The block forward in double with an explicit mask: out (B,Tq,NH*HD) and lse (B,NH,Tq).
void reference_forward(const Inputs& in, std::vector<double>& out, std::vector<double>& lse) {
  const Geo& g = in.g;
  const int64_t G = g.NH / g.NKV;
  out.assign(size_t(g.B * g.Tq * g.C()), 0.0);
  lse.assign(size_t(g.B * g.NH * g.Tq), -kInf);
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < g.NH; ++h)
      for (int64_t i = 0; i < g.Tq; ++i) {
        const int64_t kh = h / G;
        std::vector<double> s(size_t(g.Tk), -kInf);
        double mx = -kInf;
        for (int64_t j = 0; j < g.Tk; ++j) {
          if (!visible(in, b, i, j)) continue;
          double d = 0;
          for (int64_t c = 0; c < g.HD; ++c)
            d += double(in.qkv[size_t((b * g.Tq + i) * g.R() + h * g.HD + c)]) *
                 double(in.kv[size_t((b * g.Tk + j) * g.RK() + kh * g.HD + c)]);
          s[size_t(j)] = d / std::sqrt(double(g.HD));
          mx = std::max(mx, s[size_t(j)]);
        }
        if (mx == -kInf) continue;
        double sum = 0;
        for (auto& v : s) sum += (v = std::exp(v - mx));  // exp(-inf) = 0 for masked keys
        lse[size_t((b * g.NH + h) * g.Tq + i)] = mx + std::log(sum);
        for (int64_t c = 0; c < g.HD; ++c) {
          double o = 0;
          for (int64_t j = 0; j < g.Tk; ++j)
            o += s[size_t(j)] / sum * double(in.kv[size_t((b * g.Tk + j) * g.RK() + (g.NKV + kh) * g.HD + c)]);
          out[size_t((b * g.Tq + i) * g.C() + h * g.HD + c)] = o;
        }
      }
}

// The keys [k0, k1) of every batch row as their own block (same queries).
Inputs key_block(const Inputs& in, int64_t k0, int64_t k1) {
  Geo g = in.g;
  g.Tk = k1 - k0;
  Inputs blk{g, in.qkv, {}, in.qpos, in.qseg, {}, {}};
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t j = k0; j < k1; ++j) {
      const size_t k = size_t(b * in.g.Tk + j);
      blk.kv.insert(blk.kv.end(), in.kv.begin() + long(k * size_t(g.RK())),
                    in.kv.begin() + long((k + 1) * size_t(g.RK())));
      blk.kpos.push_back(in.kpos[k]);
      blk.kseg.push_back(in.kseg[k]);
    }
  return blk;
}

// A block's key/value gradient (B, k1-k0, RK) added into the full one (B, Tk, RK).
void add_key_block(std::vector<float>& dkv, const std::vector<float>& dkv_blk, const Geo& g, int64_t k0, int64_t k1) {
  const int64_t n = k1 - k0, RK = g.RK();
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < RK; ++c)
        dkv[size_t((b * g.Tk + k0 + j) * RK + c)] += dkv_blk[size_t((b * n + j) * RK + c)];
}

struct Result {
  std::vector<float> out, lse;
};

Result forward(Ops& ops, Inputs& in) {
  const Geo& g = in.g;
  Result r{std::vector<float>(size_t(g.B * g.Tq * g.C()), kNaN), std::vector<float>(size_t(g.B * g.NH * g.Tq), kNaN)};
  ops.attention_block_forward(as_tensor(r.out, {g.B, g.Tq, g.C()}), as_tensor(r.lse, {g.B, int64_t(g.NH), g.Tq}),
                              in.tqkv(), in.tkv(), in.tqpos(), in.tqseg(), in.tkpos(), in.tkseg(), g.NH, g.NKV, g.HD);
  return r;
}

// Keys split at the given boundaries; per-block forwards merged into a running result that starts
// empty (out 0, lse -inf).
Result forward_blocks(Ops& ops, const Inputs& in, const std::vector<int64_t>& cuts) {
  const Geo& g = in.g;
  Result run{std::vector<float>(size_t(g.B * g.Tq * g.C()), 0.0f),
             std::vector<float>(size_t(g.B * g.NH * g.Tq), -float(kInf))};
  for (size_t k = 0; k + 1 < cuts.size(); ++k) {
    Inputs blk = key_block(in, cuts[k], cuts[k + 1]);
    Result r = forward(ops, blk);
    ops.attention_merge(as_tensor(run.out, {g.B, g.Tq, g.C()}), as_tensor(run.lse, {g.B, int64_t(g.NH), g.Tq}),
                        as_tensor(r.out, {g.B, g.Tq, g.C()}), as_tensor(r.lse, {g.B, int64_t(g.NH), g.Tq}));
  }
  return run;
}

// Per-block backwards with the final out/lse: dqkv and dkv (zero-initialised) accumulate.
void backward_blocks(Ops& ops, const Inputs& in, const std::vector<int64_t>& cuts, Result& fin,
                     std::vector<float>& dout, std::vector<float>& dqkv, std::vector<float>& dkv) {
  const Geo& g = in.g;
  dqkv.assign(in.qkv.size(), 0.0f);
  dkv.assign(in.kv.size(), 0.0f);
  for (size_t k = 0; k + 1 < cuts.size(); ++k) {
    Inputs blk = key_block(in, cuts[k], cuts[k + 1]);
    std::vector<float> dkv_blk(blk.kv.size(), 0.0f);
    ops.attention_block_backward(as_tensor(dqkv, {g.B, g.Tq, g.R()}), as_tensor(dkv_blk, {g.B, blk.g.Tk, g.RK()}),
                                 as_tensor(dout, {g.B, g.Tq, g.C()}), blk.tqkv(), blk.tkv(),
                                 as_tensor(fin.out, {g.B, g.Tq, g.C()}), as_tensor(fin.lse, {g.B, int64_t(g.NH), g.Tq}),
                                 blk.tqpos(), blk.tqseg(), blk.tkpos(), blk.tkseg(), g.NH, g.NKV, g.HD);
    add_key_block(dkv, dkv_blk, g, cuts[k], cuts[k + 1]);
  }
}

// Rows (b, i) whose queries see no key at all.
std::vector<std::pair<int64_t, int64_t>> empty_rows(const Inputs& in) {
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (int64_t b = 0; b < in.g.B; ++b)
    for (int64_t i = 0; i < in.g.Tq; ++i) {
      bool any = false;
      for (int64_t j = 0; j < in.g.Tk; ++j) any |= visible(in, b, i, j);
      if (!any) rows.push_back({b, i});
    }
  return rows;
}

// Rows (b, i) whose visible keys lie in two or more of the blocks: the merges that are not copies.
size_t split_rows(const Inputs& in, const std::vector<int64_t>& cuts) {
  size_t rows = 0;
  for (int64_t b = 0; b < in.g.B; ++b)
    for (int64_t i = 0; i < in.g.Tq; ++i) {
      int blocks = 0;
      for (size_t k = 0; k + 1 < cuts.size(); ++k) {
        bool any = false;
        for (int64_t j = cuts[k]; j < cuts[k + 1]; ++j) any |= visible(in, b, i, j);
        blocks += any;
      }
      rows += blocks >= 2;
    }
  return rows;
}

// The inputs of tests 1, 4 and 5: GQA, random positions in [0,8) and 3 documents, and two queries
// forced to see nothing: b=0,i=2 is in a document no key belongs to, b=1,i=0 precedes every key.
Inputs masked_inputs(Geo g, uint64_t seed) {
  Inputs in = random_block_inputs(g, seed, 8, 3);
  in.qseg[2] = 9;
  in.qpos[size_t(g.Tq)] = -1;
  return in;
}
}  // namespace

TEST_CASE("cpu attention_block_forward matches a double reference with an explicit mask (GQA, documents)") {
  auto ops = make_cpu_ops();
  for (Geo g : {Geo{2, 5, 7, 4, 2, 8}, Geo{2, 3, 4, 2, 2, 4}, Geo{2, 70, 130, 4, 2, 16}}) {
    CAPTURE(g.Tq);
    CAPTURE(g.Tk);
    Inputs in = masked_inputs(g, 200 + uint64_t(g.Tk));
    const auto empty = empty_rows(in);
    CHECK(empty.size() >= 2);
    size_t vis = 0;  // the mask is neither trivial nor empty
    for (int64_t b = 0; b < g.B; ++b)
      for (int64_t i = 0; i < g.Tq; ++i)
        for (int64_t j = 0; j < g.Tk; ++j) vis += visible(in, b, i, j);
    CHECK(vis > 0);
    CHECK(vis < size_t(g.B * g.Tq * g.Tk));
    Result r = forward(*ops, in);
    std::vector<double> want_out, want_lse;
    reference_forward(in, want_out, want_lse);
    // out: convex combinations of unit normals, fp32 sums of <= 130 terms: 1e-6 abs is ~10 ulp.
    auto c = allclose(r.out, want_out, 1e-6, 1e-5);
    CHECK_MESSAGE(c.ok, "out: ", c.str());
    // lse = max + log(sum) of O(1) scores, rounded to fp32 once (~1e-7 of values up to ~5); -inf
    // entries must match exactly (inf - inf is NaN, which allclose counts as a failure).
    std::vector<double> got_lse(r.lse.begin(), r.lse.end()), fin_got, fin_want;
    size_t inf_mismatch = 0;
    for (size_t k = 0; k < got_lse.size(); ++k) {
      if (std::isinf(want_lse[k]) || std::isinf(got_lse[k])) {
        inf_mismatch += got_lse[k] != want_lse[k];
        continue;
      }
      fin_got.push_back(got_lse[k]);
      fin_want.push_back(want_lse[k]);
    }
    CHECK(inf_mismatch == 0);
    c = allclose(fin_got, fin_want, 1e-6, 1e-6);
    CHECK_MESSAGE(c.ok, "lse: ", c.str());
    for (auto [b, i] : empty) {  // no visible key: exactly 0 and -inf (out was NaN-filled)
      for (int64_t k = 0; k < g.C(); ++k) CHECK(r.out[size_t((b * g.Tq + i) * g.C() + k)] == 0.0f);
      for (int64_t h = 0; h < g.NH; ++h) CHECK(r.lse[size_t((b * g.NH + h) * g.Tq + i)] == -float(kInf));
    }
  }
}

TEST_CASE("cpu attention_block with causal positions and one document equals attention_forward/backward") {
  auto ops = make_cpu_ops();
  for (Geo g : {Geo{2, 7, 7, 4, 2, 6}, Geo{1, 70, 70, 2, 1, 8}}) {
    CAPTURE(g.Tq);
    const int64_t B = g.B, T = g.Tq, R = g.R(), RK = g.RK(), C = g.C();
    Inputs in{g,
              random_normal(size_t(B * T * R), 210, uint64_t(T)),
              std::vector<float>(size_t(B * T * RK)),
              {},
              std::vector<int32_t>(size_t(B * T), 0),
              {},
              std::vector<int32_t>(size_t(B * T), 0)};
    for (int64_t n = 0; n < B * T; ++n) in.qpos.push_back(int32_t(n % T));
    in.kpos = in.qpos;
    // kv = the key and value columns of qkv (the layout a context-parallel ring sends).
    ops->copy_cols(as_tensor(in.kv, {B * T, RK}), 0, as_tensor(in.qkv, {B * T, R}), C, RK);
    Result r = forward(*ops, in);
    std::vector<float> out(size_t(B * T * C)), saved(size_t(ops->attention_saved_numel(B, T, g.NH)));
    const Tensor tsaved = as_tensor(saved, {int64_t(saved.size())});
    ops->attention_forward(as_tensor(out, {B, T, C}), tsaved, in.tqkv(), g.NH, g.NKV, g.HD);
    // Both fp32 with the same exp and different summation orders: a few ulp of O(1) outputs.
    auto c = allclose(r.out, out, 1e-6, 1e-5);
    CHECK_MESSAGE(c.ok, "out: ", c.str());

    auto dout = random_normal(size_t(B * T * C), 211, uint64_t(T));
    std::vector<float> want(in.qkv.size(), kNaN);
    ops->attention_backward(as_tensor(want, {B, T, R}), as_tensor(dout, {B, T, C}), in.tqkv(),
                            as_tensor(out, {B, T, C}), tsaved, g.NH, g.NKV, g.HD);
    std::vector<float> dqkv(in.qkv.size(), 0.0f), dkv(in.kv.size(), 0.0f);
    ops->attention_block_backward(as_tensor(dqkv, {B, T, R}), as_tensor(dkv, {B, T, RK}), as_tensor(dout, {B, T, C}),
                                  in.tqkv(), in.tkv(), as_tensor(r.out, {B, T, C}),
                                  as_tensor(r.lse, {B, int64_t(g.NH), T}), in.tqpos(), in.tqseg(), in.tkpos(),
                                  in.tkseg(), g.NH, g.NKV, g.HD);
    ops->copy_cols(as_tensor(dqkv, {B * T, R}), C, as_tensor(dkv, {B * T, RK}), 0, RK);
    // Gradients of O(1..10) summed over <= 70 keys and 2 heads in different orders, the block
    // version recomputing P from lse: fp32 rounding ~1e-6 relative; 1e-5 abs + 1e-4 rel is ~10x.
    c = allclose(dqkv, want, 1e-5, 1e-4);
    CHECK_MESSAGE(c.ok, "dqkv: ", c.str());
  }
}

TEST_CASE("cpu attention_merge of key blocks equals one block; per-block backwards sum to its backward") {
  auto ops = make_cpu_ops();
  const Geo g{2, 5, 12, 4, 2, 8};
  // Batch row 1: random positions in [0,8) and 2 documents, its query 0 before every key (sees
  // nothing). Batch row 0 by hand, keys 0..8 in document 0 and 9..11 in document 1 at positions j:
  // query 0 (doc 0, pos 8) sees keys 0..8 across every split; 1 (doc 1, pos 11) sees 9..11 only, so
  // earlier blocks are all masked for it; 2 is in no key's document; 3 (doc 0, pos 4) sees 0..4, none
  // of the second half; 4 (doc 0, pos 7) sees 0..7.
  Inputs in = random_block_inputs(g, 220, 8, 2);
  in.qpos[size_t(g.Tq)] = -1;
  for (int64_t j = 0; j < g.Tk; ++j) {
    in.kseg[size_t(j)] = j < 9 ? 0 : 1;
    in.kpos[size_t(j)] = int32_t(j);
  }
  const std::vector<int32_t> seg0 = {0, 1, 9, 0, 0}, pos0 = {8, 11, 0, 4, 7};
  std::copy(seg0.begin(), seg0.end(), in.qseg.begin());
  std::copy(pos0.begin(), pos0.end(), in.qpos.begin());
  Result one = forward(*ops, in);
  auto dout = random_normal(size_t(g.B * g.Tq * g.C()), 221, 0);
  std::vector<float> dqkv1, dkv1;
  backward_blocks(*ops, in, {0, 12}, one, dout, dqkv1, dkv1);
  CHECK(max_abs(std::vector<double>(dkv1.begin(), dkv1.end())) > 0.1);

  for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{0, 6, 12}, std::vector<int64_t>{0, 3, 7, 12}}) {
    CAPTURE(cuts.size());
    CHECK(split_rows(in, cuts) >= 4);
    Result m = forward_blocks(*ops, in, cuts);
    // Merge weights in double, block results rounded to fp32: a few ulp of O(1) values.
    auto c = allclose(m.out, one.out, 1e-6, 1e-5);
    CHECK_MESSAGE(c.ok, "out: ", c.str());
    size_t inf_mismatch = 0;
    auto want_lse = one.lse;
    for (size_t k = 0; k < m.lse.size(); ++k) {
      inf_mismatch += m.lse[k] != want_lse[k] && (std::isinf(m.lse[k]) || std::isinf(want_lse[k]));
      if (std::isinf(want_lse[k])) m.lse[k] = want_lse[k] = 0.0f;  // compared above; -inf - -inf is NaN
    }
    CHECK(inf_mismatch == 0);
    c = allclose(m.lse, want_lse, 2e-6, 1e-6);  // each block lse rounded once, merged, rounded again
    CHECK_MESSAGE(c.ok, "lse: ", c.str());
    for (int64_t k = 0; k < g.C(); ++k) CHECK(m.out[size_t(2 * g.C() + k)] == 0.0f);  // b=0,i=2 sees nothing

    Result fin = forward_blocks(*ops, in, cuts);  // the final out/lse, as ring attention has them
    std::vector<float> dqkv, dkv;
    backward_blocks(*ops, in, cuts, fin, dout, dqkv, dkv);
    // Sums of 2-3 block contributions instead of one product over all keys: fp32 rounding of
    // O(1) gradients, ~1e-6; 1e-5 abs + 1e-4 rel.
    c = allclose(dqkv, dqkv1, 1e-5, 1e-4);
    CHECK_MESSAGE(c.ok, "dqkv: ", c.str());
    c = allclose(dkv, dkv1, 1e-5, 1e-4);
    CHECK_MESSAGE(c.ok, "dkv: ", c.str());
  }
}

TEST_CASE("cpu attention_block_backward matches finite differences, one block and two merged blocks") {
  auto ops = make_cpu_ops();
  const Geo g{2, 5, 7, 4, 2, 8};
  Inputs in = masked_inputs(g, 230);
  const auto w = random_normal(size_t(g.B * g.Tq * g.C()), 231, 0);
  for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{0, 7}, std::vector<int64_t>{0, 3, 7}}) {
    CAPTURE(cuts.size());
    if (cuts.size() > 2) CHECK(split_rows(in, cuts) >= 2);
    auto loss = [&] { return dot(forward_blocks(*ops, in, cuts).out, w); };
    // Softmax attention on unit normals (scores O(1)): with eps = 1e-2 the truncation eps^2 |f'''|/6
    // is ~1e-5 and fp32 rounding of the loss (~1e-6) over 2 eps adds ~1e-4 at worst; 2e-4 abs +
    // 1e-3 rel. A wrong term (scale, GQA head, mask leak, local instead of final lse) is O(0.1) off.
    const auto num_q = numerical_gradient(loss, in.qkv, 1e-2);
    const auto num_kv = numerical_gradient(loss, in.kv, 1e-2);
    Result fin = forward_blocks(*ops, in, cuts);
    auto dout = w;
    std::vector<float> dqkv, dkv;
    backward_blocks(*ops, in, cuts, fin, dout, dqkv, dkv);
    // The whole of dqkv: its key/value columns are numerically 0 and must stay 0 (untouched).
    auto c = allclose(dqkv, num_q, 2e-4, 1e-3);
    CHECK_MESSAGE(c.ok, "dq: ", c.str());
    c = allclose(dkv, num_kv, 2e-4, 1e-3);
    CHECK_MESSAGE(c.ok, "dk, dv: ", c.str());
    CHECK(max_abs(num_q) > 0.1);  // the checks are not vacuous
    CHECK(max_abs(num_kv) > 0.1);
  }
}

TEST_CASE("cpu attention_block_backward accumulates and leaves the key/value columns of dqkv alone") {
  auto ops = make_cpu_ops();
  const Geo g{2, 5, 7, 4, 2, 8};
  Inputs in = masked_inputs(g, 240);
  Result fin = forward(*ops, in);
  auto dout = random_normal(size_t(g.B * g.Tq * g.C()), 241, 0);
  const auto dqkv0 = random_normal(in.qkv.size(), 242, 0), dkv0 = random_normal(in.kv.size(), 242, 1);
  auto dqkv = dqkv0, dkv = dkv0;
  auto backward = [&] {
    ops->attention_block_backward(
        as_tensor(dqkv, {g.B, g.Tq, g.R()}), as_tensor(dkv, {g.B, g.Tk, g.RK()}), as_tensor(dout, {g.B, g.Tq, g.C()}),
        in.tqkv(), in.tkv(), as_tensor(fin.out, {g.B, g.Tq, g.C()}), as_tensor(fin.lse, {g.B, int64_t(g.NH), g.Tq}),
        in.tqpos(), in.tqseg(), in.tkpos(), in.tkseg(), g.NH, g.NKV, g.HD);
  };
  std::vector<float> gq, gkv;
  backward_blocks(*ops, in, {0, g.Tk}, fin, dout, gq, gkv);  // the gradient alone (from zeros)
  std::vector<double> once_q, once_kv, twice_q, twice_kv;
  for (size_t k = 0; k < gq.size(); ++k) {
    once_q.push_back(double(dqkv0[k]) + gq[k]);
    twice_q.push_back(double(dqkv0[k]) + 2.0 * gq[k]);
  }
  for (size_t k = 0; k < gkv.size(); ++k) {
    once_kv.push_back(double(dkv0[k]) + gkv[k]);
    twice_kv.push_back(double(dkv0[k]) + 2.0 * gkv[k]);
  }
  // Adding O(1) gradients to O(1) values in fp32: one or two roundings of ~1e-7 each per term
  // (dK/dV add several per-head products), so 1e-6 abs + rel.
  backward();
  auto c = allclose(dqkv, once_q, 1e-6, 1e-6);
  CHECK_MESSAGE(c.ok, "dqkv once: ", c.str());
  c = allclose(dkv, once_kv, 1e-6, 1e-6);
  CHECK_MESSAGE(c.ok, "dkv once: ", c.str());
  backward();
  c = allclose(dqkv, twice_q, 2e-6, 1e-6);
  CHECK_MESSAGE(c.ok, "dqkv twice: ", c.str());
  c = allclose(dkv, twice_kv, 2e-6, 1e-6);
  CHECK_MESSAGE(c.ok, "dkv twice: ", c.str());
  size_t touched = 0;  // key/value columns of dqkv: bitwise the initial values
  for (int64_t n = 0; n < g.B * g.Tq; ++n)
    for (int64_t k = g.C(); k < g.R(); ++k) touched += dqkv[size_t(n * g.R() + k)] != dqkv0[size_t(n * g.R() + k)];
  CHECK(touched == 0);
}

TEST_CASE("cpu attention_block on a threaded size: bitwise the same with one and two threads") {
  auto ops = make_cpu_ops();
  const Geo g{2, 70, 130, 4, 2, 16};  // B*NH*Tq*Tk*HD > 2^20: the (b, h) tasks are threaded
  Inputs in = masked_inputs(g, 250);
  auto dout = random_normal(size_t(g.B * g.Tq * g.C()), 251, 0);
  auto run = [&](int threads) {
    const int saved_threads = omp_get_max_threads();
    omp_set_num_threads(threads);
    Result r = forward(*ops, in);
    std::vector<float> dqkv, dkv;
    backward_blocks(*ops, in, {0, g.Tk}, r, dout, dqkv, dkv);
    omp_set_num_threads(saved_threads);
    r.out.insert(r.out.end(), r.lse.begin(), r.lse.end());
    r.out.insert(r.out.end(), dqkv.begin(), dqkv.end());
    r.out.insert(r.out.end(), dkv.begin(), dkv.end());
    return r.out;
  };
  const auto a = run(2), b = run(1);
  CHECK(a.size() == b.size());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);  // -inf == -inf bitwise
}

TEST_CASE("cpu copy_cols, gather_rows, scatter_add_rows match loops; bad shapes throw") {
  auto ops = make_cpu_ops();
  const int64_t N = 6, Dd = 9, Ds = 5, M = 8, Cc = 7;
  auto src = random_normal(size_t(N * Ds), 260, 0), dst = random_normal(size_t(N * Dd), 260, 1);
  auto want = dst;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < 3; ++k) want[size_t(n * Dd + 4 + k)] = src[size_t(n * Ds + 1 + k)];
  ops->copy_cols(as_tensor(dst, {N, Dd}), 4, as_tensor(src, {N, Ds}), 1, 3);
  CHECK(dst == want);  // a copy: bitwise

  auto inp = random_normal(size_t(N * Cc), 261, 0);
  std::vector<int32_t> index = {3, 0, 5, 3, 3, 1, 0, 2};  // repeats, and row 4 never picked
  std::vector<float> out(size_t(M * Cc), kNaN);
  ops->gather_rows(as_tensor(out, {M, Cc}), as_tensor(inp, {N, Cc}), as_tensor(index, {M}));
  std::vector<float> gwant(size_t(M * Cc));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < Cc; ++k) gwant[size_t(i * Cc + k)] = inp[size_t(index[size_t(i)] * Cc + k)];
  CHECK(out == gwant);

  auto dout = random_normal(size_t(M * Cc), 262, 0), dinp = random_normal(size_t(N * Cc), 262, 1);
  auto swant = dinp;  // the same additions in the same (row) order: bitwise
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < Cc; ++k) swant[size_t(index[size_t(i)] * Cc + k)] += dout[size_t(i * Cc + k)];
  ops->scatter_add_rows(as_tensor(dinp, {N, Cc}), as_tensor(dout, {M, Cc}), as_tensor(index, {M}));
  CHECK(dinp == swant);

  // A threaded size (M*C >= 2^14) with heavy repetition: still the row-order sums.
  const int64_t M2 = 512, N2 = 16, C2 = 64;
  std::vector<int32_t> idx2;
  for (int64_t i = 0; i < M2; ++i) idx2.push_back(int32_t(bits_at(263, 0, uint64_t(i)) % uint64_t(N2)));
  auto dout2 = random_normal(size_t(M2 * C2), 263, 1);
  std::vector<float> dinp2(size_t(N2 * C2), 0.0f), swant2(dinp2.size(), 0.0f), g2(size_t(M2 * C2)), gwant2(g2.size());
  for (int64_t i = 0; i < M2; ++i)
    for (int64_t k = 0; k < C2; ++k) swant2[size_t(idx2[size_t(i)] * C2 + k)] += dout2[size_t(i * C2 + k)];
  ops->scatter_add_rows(as_tensor(dinp2, {N2, C2}), as_tensor(dout2, {M2, C2}), as_tensor(idx2, {M2}));
  CHECK(dinp2 == swant2);
  for (int64_t i = 0; i < M2; ++i)
    for (int64_t k = 0; k < C2; ++k) gwant2[size_t(i * C2 + k)] = dinp2[size_t(idx2[size_t(i)] * C2 + k)];
  ops->gather_rows(as_tensor(g2, {M2, C2}), as_tensor(dinp2, {N2, C2}), as_tensor(idx2, {M2}));
  CHECK(g2 == gwant2);

  // Argument errors name the op.
  CHECK_THROWS_WITH_AS(ops->copy_cols(as_tensor(dst, {N, Dd}), 7, as_tensor(src, {N, Ds}), 1, 3),
                       doctest::Contains("copy_cols"), Error);  // past dst's columns
  CHECK_THROWS_AS(ops->copy_cols(as_tensor(dst, {N, Dd}), 0, as_tensor(inp, {N + 1, Cc}), 0, 3), Error);  // rows
  CHECK_THROWS_WITH_AS(
      ops->gather_rows(as_tensor(out, {M / 2, 2 * Cc}), as_tensor(inp, {N, Cc}), as_tensor(index, {M})),
      doctest::Contains("gather_rows"), Error);
  std::vector<int32_t> bad = index;
  bad[5] = int32_t(N);
  CHECK_THROWS_WITH_AS(ops->gather_rows(as_tensor(out, {M, Cc}), as_tensor(inp, {N, Cc}), as_tensor(bad, {M})),
                       doctest::Contains("index[5]"), Error);
  CHECK_THROWS_AS(ops->scatter_add_rows(as_tensor(dinp, {N, Cc}), as_tensor(dout, {M, Cc}), as_tensor(bad, {M})),
                  Error);
  CHECK_THROWS_AS(
      ops->scatter_add_rows(as_tensor(dinp, {N, Cc}), as_tensor(dout, {M, Cc}), as_tensor(index, {M}).flat_slice(0, 7)),
      Error);

  const Geo g{2, 5, 7, 4, 2, 8};
  Inputs in = masked_inputs(g, 270);
  Result r = forward(*ops, in);
  const Tensor tout = as_tensor(r.out, {g.B, g.Tq, g.C()}), tlse = as_tensor(r.lse, {g.B, int64_t(g.NH), g.Tq});
  CHECK_THROWS_WITH_AS(ops->attention_block_forward(tout, tlse, in.tqkv(), in.tkv(), in.tqpos(), in.tqseg(), in.tkpos(),
                                                    in.tkseg(), g.NH, 3, g.HD),  // NH % NKV != 0
                       doctest::Contains("attention_block_forward"), Error);
  CHECK_THROWS_WITH_AS(
      ops->attention_block_forward(tout, tlse, in.tqkv(), as_tensor(in.kv, {g.B, g.Tk * 2, g.RK() / 2}), in.tqpos(),
                                   in.tqseg(), in.tkpos(), in.tkseg(), g.NH, g.NKV, g.HD),
      doctest::Contains("kv"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_block_forward(tout, tlse.flat_slice(0, 30), in.tqkv(), in.tkv(), in.tqpos(),
                                                    in.tqseg(), in.tkpos(), in.tkseg(), g.NH, g.NKV, g.HD),
                       doctest::Contains("lse"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_block_forward(tout, tlse, in.tqkv(), in.tkv(), in.tqpos(), in.tqseg(),
                                                    in.tkpos().flat_slice(0, 13), in.tkseg(), g.NH, g.NKV, g.HD),
                       doctest::Contains("kpos"), Error);
  CHECK_THROWS_AS(ops->attention_block_forward(tout, tlse, in.tqkv(), in.tkv(), in.tqpos(), in.tqseg(), in.tkv(),
                                               in.tkseg(), g.NH, g.NKV, g.HD),  // positions must be i32
                  Error);
  std::vector<float> dqkv(in.qkv.size()), dkv(in.kv.size());
  CHECK_THROWS_WITH_AS(
      ops->attention_block_backward(as_tensor(dqkv, {g.B, g.Tq, g.R()}),
                                    as_tensor(dkv, {g.B, g.Tk, g.RK()}).flat_slice(0, 10), tout, in.tqkv(), in.tkv(),
                                    tout, tlse, in.tqpos(), in.tqseg(), in.tkpos(), in.tkseg(), g.NH, g.NKV, g.HD),
      doctest::Contains("dkv"), Error);
  std::vector<float> small(size_t(g.B * g.NH * (g.Tq - 1)));
  CHECK_THROWS_WITH_AS(ops->attention_merge(tout, tlse, tout, as_tensor(small, {g.B, int64_t(g.NH), g.Tq - 1})),
                       doctest::Contains("attention_merge"), Error);
}
