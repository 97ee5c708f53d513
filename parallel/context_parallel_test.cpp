// Context-parallel token assignment: Megatron's load-balanced chunks for whole rows, the
// per-document split of packed rows (every rank exactly T/cp tokens, balanced causal work), the
// positions and document ids of cp_split, and one-rank masked attention.
#include "parallel/context_parallel.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <vector>

#include "lib/core/rng.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;

namespace {
// Document lengths -> positions within documents (one row).
std::vector<int32_t> positions_of(const std::vector<int>& lengths) {
  std::vector<int32_t> pos;
  for (int n : lengths)
    for (int i = 0; i < n; ++i) pos.push_back(i);
  return pos;
}
}  // namespace

TEST_CASE("cp_token_index: whole rows are cut into 2*cp chunks, rank r holds chunks r and 2cp-1-r") {
  // cp = 2, T = 8: chunks of 2 tokens; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  const std::vector<int32_t> idx = cp_token_index(2, 8, 2, nullptr);
  const std::vector<int32_t> want = {0, 1, 6, 7, /* row 1 */ 8, 9, 14, 15,   // rank 0
                                     2, 3, 4, 5, /* row 1 */ 10, 11, 12, 13};  // rank 1
  CHECK(idx == want);
  // cp = 4, T = 16: rank 1 holds chunks 1 and 6.
  const std::vector<int32_t> idx4 = cp_token_index(1, 16, 4, nullptr);
  CHECK(std::vector<int32_t>(idx4.begin() + 4, idx4.begin() + 8) == std::vector<int32_t>{2, 3, 12, 13});
  CHECK_THROWS_AS(cp_token_index(1, 12, 4, nullptr), Error);  // 12 is not a multiple of 2*cp = 8
}

TEST_CASE("cp_token_index: packed rows split every document, every rank holds T/cp tokens") {
  for (int cp : {2, 3, 4}) {
    const int T = 48, B = 3;
    // Random document lengths per row (including length-1 documents and one whole-row document).
    std::vector<int32_t> pos;
    for (int b = 0; b < B; ++b) {
      std::vector<int> lengths;
      int left = T, k = 0;
      while (left > 0) {
        const int n = b == 2 ? left : std::min(left, 1 + int(bits_at(7, uint64_t(cp * 100 + b), k++) % 17));
        lengths.push_back(n);
        left -= n;
      }
      const auto p = positions_of(lengths);
      pos.insert(pos.end(), p.begin(), p.end());
    }
    const std::vector<int32_t> idx = cp_token_index(B, T, cp, pos.data());
    const int Tl = T / cp;
    REQUIRE(idx.size() == size_t(cp * B * Tl));
    // A permutation of the micro-batch, and each rank's tokens of row b lie in row b, in order.
    std::vector<int32_t> sorted = idx;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int32_t> all(B * T);
    std::iota(all.begin(), all.end(), 0);
    CHECK(sorted == all);
    std::vector<double> work(cp, 0.0);
    for (int r = 0; r < cp; ++r)
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < Tl; ++t) {
          const int32_t i = idx[(size_t(r) * B + b) * Tl + t];
          CHECK(i / T == b);
          if (t > 0) CHECK(i > idx[(size_t(r) * B + b) * Tl + t - 1]);
          work[r] += pos[i] + 1;  // causal attention work of a query: the keys it sees
        }
    // Balanced: the ranks' causal work differs by far less than a naive contiguous split's.
    const double lo = *std::min_element(work.begin(), work.end()), hi = *std::max_element(work.begin(), work.end());
    CHECK(hi / lo < 1.25);
    // Every document is split: rank r's tokens of a document of length n >= 2*cp number 2*floor(n/2cp)
    // or up to two more.
    int start = 0;
    for (int t = 1; t <= T; ++t)
      if (t == T || pos[t] == 0) {
        const int n = t - start;
        for (int r = 0; r < cp; ++r) {
          int mine = 0;
          for (int k = 0; k < Tl; ++k) {
            const int32_t i = idx[size_t(r) * B * Tl + k];  // row 0
            mine += i >= start && i < t;
          }
          CHECK(mine >= 2 * (n / (2 * cp)));
          CHECK(mine <= 2 * (n / (2 * cp)) + 2);
        }
        start = t;
      }
  }
}

TEST_CASE("cp_split: local tokens and targets, every rank's positions and document ids") {
  const int B = 1, T = 8, cp = 2;
  const std::vector<int32_t> pos = positions_of({3, 5});  // two documents
  std::vector<int32_t> tokens(T), targets(T);
  std::iota(tokens.begin(), tokens.end(), 100);
  std::iota(targets.begin(), targets.end(), 200);
  const CpMicroBatch m = cp_split(B, T, cp, 1, tokens.data(), targets.data(), pos.data());
  // Document 0 (3 tokens): chunks {1,1,1,0}, the extras dealt to chunks 0, 1, 2; document 1 (5
  // tokens): one token each and the next extra at chunk 3: {1,1,1,2}. Rank 0 holds chunks 0 and 3:
  // [0] and [3] + [6,7]; rank 1 chunks 1 and 2: [1], [2] and [4], [5].
  const std::vector<int32_t> idx = cp_token_index(B, T, cp, pos.data());
  CHECK(idx == std::vector<int32_t>{0, 3, 6, 7, 1, 2, 4, 5});
  CHECK(m.index == std::vector<int32_t>{1, 2, 4, 5});
  CHECK(m.tokens == std::vector<int32_t>{101, 102, 104, 105});
  CHECK(m.targets == std::vector<int32_t>{201, 202, 204, 205});
  CHECK(m.pos == std::vector<int32_t>{0, 0, 3, 4, 1, 2, 1, 2});
  CHECK(m.seg == std::vector<int32_t>{0, 1, 1, 1, 0, 0, 1, 1});
  // Without packing: positions 0..T-1, one document.
  const CpMicroBatch u = cp_split(B, T, cp, 0, tokens.data(), targets.data(), nullptr);
  CHECK(u.pos == std::vector<int32_t>{0, 1, 6, 7, 2, 3, 4, 5});
  CHECK(u.seg == std::vector<int32_t>(8, 0));
}

TEST_CASE("ContextParallel on one rank: packed attention is the block op over the local tokens") {
  auto ops = make_cpu_ops();
  ContextParallel cp(nullptr, CpCommType::P2P, *ops);
  const int B = 2, T = 12, NH = 4, NKV = 2, HD = 8, R = (NH + 2 * NKV) * HD;
  auto qkv = testing::random_normal(size_t(B) * T * R, 3);
  std::vector<int32_t> pos = positions_of({5, 7});
  pos.insert(pos.end(), pos.begin(), pos.end());
  const CpMicroBatch m = cp_split(B, T, 1, 0, pos.data(), pos.data(), pos.data());
  std::vector<int32_t> p = m.pos, s = m.seg;
  std::vector<float> out(size_t(B) * T * NH * HD), lse(size_t(B) * NH * T);
  cp.attention_forward(testing::as_tensor(out, {B, T, NH * HD}), testing::as_tensor(lse, {B, NH, T}),
                       testing::as_tensor(qkv, {B, T, R}), testing::as_tensor(p, {B * T}),
                       testing::as_tensor(s, {B * T}), NH, NKV, HD);
  // Against the causal op on each document alone: the first document's 5 tokens of row 0.
  std::vector<float> doc(size_t(5) * R), ref_out(size_t(5) * NH * HD), saved(size_t(NH) * 25);
  std::copy(qkv.begin(), qkv.begin() + 5 * R, doc.begin());
  ops->attention_forward(testing::as_tensor(ref_out, {1, 5, NH * HD}), testing::as_tensor(saved, {NH * 25}),
                         testing::as_tensor(doc, {1, 5, R}), NH, NKV, HD);
  // Rows of different documents never mix: the second document's first token attends to itself only.
  const auto rep = testing::allclose(out.data(), ref_out.data(), ref_out.size(), 1e-6, 1e-5);
  CHECK_MESSAGE(rep.ok, rep.str());
  for (int h = 0; h < NH; ++h)
    for (int d = 0; d < HD; ++d)  // v of its own kv head
      CHECK(out[size_t(5) * NH * HD + h * HD + d] ==
            doctest::Approx(qkv[size_t(5) * R + (NH + NKV + h / (NH / NKV)) * HD + d]).epsilon(1e-6));
}

TEST_CASE("cu_seqlens: packed rows as THD offsets; masking by them is the explicit block-diagonal mask") {
  const int B = 2, T = 8;
  std::vector<int32_t> pos = positions_of({3, 1, 4});
  const auto row1 = positions_of({8});
  pos.insert(pos.end(), row1.begin(), row1.end());
  const std::vector<int32_t> cu = cu_seqlens_of(B, T, pos.data());
  CHECK(cu == std::vector<int32_t>{0, 3, 4, 8, 16});
  CHECK(cu_seqlens_of(B, T, nullptr) == std::vector<int32_t>{0, 8, 16});
  // Attention over the documents of cu_seqlens against a softmax in double with an explicit
  // block-diagonal causal mask: query i sees key j iff cu puts them in one document and j <= i.
  auto ops = make_cpu_ops();
  const int NH = 2, NKV = 1, HD = 4, R = (NH + 2 * NKV) * HD, KVD = 2 * NKV * HD;
  auto qkv = testing::random_normal(size_t(B) * T * R, 5);
  std::vector<float> kv(size_t(B) * T * KVD);
  ops->copy_cols(testing::as_tensor(kv, {B * T, KVD}), 0, testing::as_tensor(qkv, {B * T, R}), NH * HD, KVD);
  CpMicroBatch m = cp_split(B, T, 1, 0, pos.data(), pos.data(), pos.data());
  CHECK(m.seg == std::vector<int32_t>{0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3});
  std::vector<float> out(size_t(B) * T * NH * HD), lse(size_t(B) * NH * T);
  const Tensor P = testing::as_tensor(m.pos, {B, T}), S = testing::as_tensor(m.seg, {B, T});
  ops->attention_block_forward(testing::as_tensor(out, {B, T, NH * HD}), testing::as_tensor(lse, {B, NH, T}),
                               testing::as_tensor(qkv, {B, T, R}), testing::as_tensor(kv, {B, T, KVD}), P, S, P, S,
                               NH, NKV, HD);
  auto doc_of = [&](int i) { return std::upper_bound(cu.begin(), cu.end(), i) - cu.begin(); };
  auto at = [&](int token, int col) { return double(qkv[size_t(token) * R + col]); };
  double worst = 0;
  for (int g = 0; g < B * T; ++g)
    for (int h = 0; h < NH; ++h) {
      std::vector<double> w(B * T, 0.0);
      double mx = -1e300, sum = 0;
      for (int j = 0; j <= g; ++j)
        if (doc_of(j) == doc_of(g)) {
          for (int k = 0; k < HD; ++k) w[j] += at(g, h * HD + k) * at(j, NH * HD + k);
          w[j] /= std::sqrt(double(HD));
          mx = std::max(mx, w[j]);
        }
      for (int j = 0; j <= g; ++j) w[j] = doc_of(j) == doc_of(g) ? std::exp(w[j] - mx) : 0.0, sum += w[j];
      for (int k = 0; k < HD; ++k) {
        double o = 0;
        for (int j = 0; j <= g; ++j) o += w[j] / sum * at(j, (NH + NKV) * HD + k);
        worst = std::max(worst, std::abs(o - out[size_t(g) * NH * HD + h * HD + k]));
      }
    }
  CHECK(worst < 1e-5);  // fp32 softmax over at most 8 keys of scores ~1
}
