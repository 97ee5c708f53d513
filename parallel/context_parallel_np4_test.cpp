// Four ranks: context-parallel attention over groups of 2 and 4 ranks, ring (p2p) and
// all-gather, whole rows and packed documents, forward and backward, against the attention of one
// rank over the whole sequence; and context_parallel_gather forward and backward.
#include <doctest/doctest.h>

#include <vector>

#include "lib/kernels/testing.h"
#include "parallel/context_parallel.h"

using namespace mpigpt;

namespace {

// Rows `index` of a (rows, width) matrix.
std::vector<float> take_rows(const std::vector<float>& m, int64_t width, const int32_t* index, int64_t n) {
  std::vector<float> out(size_t(n * width));
  for (int64_t i = 0; i < n; ++i)
    std::copy(m.begin() + index[i] * width, m.begin() + (index[i] + 1) * width, out.begin() + i * width);
  return out;
}

struct Group {  // the world split into groups of `size` consecutive ranks
  explicit Group(int size) {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_split(MPI_COMM_WORLD, r / size, r, &mpi);
    comm = std::make_unique<Comm>(mpi);
  }
  ~Group() { MPI_Comm_free(&mpi); }
  MPI_Comm mpi = MPI_COMM_NULL;
  std::unique_ptr<Comm> comm;
};

}  // namespace

TEST_CASE("context-parallel attention equals one rank's attention over the whole sequence") {
  auto ops = make_cpu_ops();
  const int B = 2, T = 16, NH = 4, NKV = 2, HD = 8, R = (NH + 2 * NKV) * HD, KVD = 2 * NKV * HD, D = NH * HD;
  // Row 0 packs four documents (one of a single token), row 1 is one document.
  std::vector<int32_t> packed_pos;
  for (int n : {5, 1, 3, 7})
    for (int i = 0; i < n; ++i) packed_pos.push_back(i);
  for (int i = 0; i < T; ++i) packed_pos.push_back(i);
  std::vector<int32_t> dummy(B * T, 0);

  for (int cp : {2, 4})
    for (CpCommType type : {CpCommType::P2P, CpCommType::AllGather})
      for (bool packed : {false, true}) {
        CAPTURE(cp);
        CAPTURE(int(type));
        CAPTURE(packed);
        Group g(cp);
        const Comm& c = *g.comm;
        const int rank = c.rank(), Tl = T / cp;
        const int32_t* pos = packed ? packed_pos.data() : nullptr;

        // The whole sequence, identical on every rank, and one rank's attention over it.
        auto qkv = testing::random_normal(size_t(B) * T * R, 11, packed);
        auto dout = testing::random_normal(size_t(B) * T * D, 12, packed);
        CpMicroBatch whole = cp_split(B, T, 1, 0, dummy.data(), dummy.data(), pos);
        std::vector<float> kv(size_t(B) * T * KVD), out(size_t(B) * T * D), lse(size_t(B) * NH * T);
        std::vector<float> dqkv(qkv.size(), 0.0f), dkv(kv.size(), 0.0f);
        ops->copy_cols(testing::as_tensor(kv, {B * T, KVD}), 0, testing::as_tensor(qkv, {B * T, R}), D, KVD);
        const Tensor wp = testing::as_tensor(whole.pos, {B, T}), ws = testing::as_tensor(whole.seg, {B, T});
        ops->attention_block_forward(testing::as_tensor(out, {B, T, D}), testing::as_tensor(lse, {B, NH, T}),
                                     testing::as_tensor(qkv, {B, T, R}), testing::as_tensor(kv, {B, T, KVD}), wp, ws,
                                     wp, ws, NH, NKV, HD);
        ops->attention_block_backward(testing::as_tensor(dqkv, {B, T, R}), testing::as_tensor(dkv, {B, T, KVD}),
                                      testing::as_tensor(dout, {B, T, D}), testing::as_tensor(qkv, {B, T, R}),
                                      testing::as_tensor(kv, {B, T, KVD}), testing::as_tensor(out, {B, T, D}),
                                      testing::as_tensor(lse, {B, NH, T}), wp, ws, wp, ws, NH, NKV, HD);
        ops->copy_cols(testing::as_tensor(dqkv, {B * T, R}), D, testing::as_tensor(dkv, {B * T, KVD}), 0, KVD);

        // This rank's share.
        CpMicroBatch m = cp_split(B, T, cp, rank, dummy.data(), dummy.data(), pos);
        std::vector<int32_t> index = cp_token_index(B, T, cp, pos);
        const int32_t* mine = index.data() + size_t(rank) * B * Tl;
        auto qkv_l = take_rows(qkv, R, mine, B * Tl), dout_l = take_rows(dout, D, mine, B * Tl);
        std::vector<float> out_l(size_t(B) * Tl * D), lse_l(size_t(B) * NH * Tl), dqkv_l(qkv_l.size());
        ContextParallel cpx(&c, type, *ops);
        const Tensor P = testing::as_tensor(m.pos, {cp * B * Tl}), S = testing::as_tensor(m.seg, {cp * B * Tl});
        cpx.attention_forward(testing::as_tensor(out_l, {B, Tl, D}), testing::as_tensor(lse_l, {B, NH, Tl}),
                              testing::as_tensor(qkv_l, {B, Tl, R}), P, S, NH, NKV, HD);
        cpx.attention_backward(testing::as_tensor(dqkv_l, {B, Tl, R}), testing::as_tensor(dout_l, {B, Tl, D}),
                               testing::as_tensor(qkv_l, {B, Tl, R}), testing::as_tensor(out_l, {B, Tl, D}),
                               testing::as_tensor(lse_l, {B, NH, Tl}), P, S, NH, NKV, HD);

        // Merging cp partial softmaxes vs one: fp32 rounding of a few terms (outputs ~1).
        const auto want_out = take_rows(out, D, mine, B * Tl);
        auto r1 = testing::allclose(out_l, want_out, 1e-6, 1e-5);
        CHECK_MESSAGE(r1.ok, "out: " << r1.str());
        std::vector<float> want_lse(lse_l.size());
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < NH; ++h)
            for (int t = 0; t < Tl; ++t)
              want_lse[(size_t(b) * NH + h) * Tl + t] = lse[(size_t(b) * NH + h) * T + mine[b * Tl + t] - b * T];
        auto r2 = testing::allclose(lse_l, want_lse, 1e-6, 1e-6);
        CHECK_MESSAGE(r2.ok, "lse: " << r2.str());
        // Gradients: dK/dV sum over cp ranks' queries in another order.
        const auto want_dqkv = take_rows(dqkv, R, mine, B * Tl);
        auto r3 = testing::allclose(dqkv_l, want_dqkv, 1e-5, 1e-4);
        CHECK_MESSAGE(r3.ok, "dqkv: " << r3.str());
      }
}

TEST_CASE("context_parallel_gather: forward reassembles the sequence, backward takes this rank's rows") {
  auto ops = make_cpu_ops();
  const int B = 2, T = 16, C = 3;
  std::vector<int32_t> pos;
  for (int n : {9, 7, 16})
    for (int i = 0; i < n; ++i) pos.push_back(i);
  for (int cp : {2, 4}) {
    Group g(cp);
    const int rank = g.comm->rank(), Tl = T / cp;
    ContextParallel cpx(g.comm.get(), CpCommType::P2P, *ops);
    auto full = testing::random_normal(size_t(B) * T * C, 21);
    std::vector<int32_t> index = cp_token_index(B, T, cp, pos.data());
    auto local = take_rows(full, C, index.data() + size_t(rank) * B * Tl, B * Tl);
    std::vector<float> got(full.size(), -1.0f);
    const Tensor I = testing::as_tensor(index, {cp * B * Tl});
    cpx.gather_forward(testing::as_tensor(got, {B * T, C}), testing::as_tensor(local, {B * Tl, C}), I);
    CHECK(got == full);
    auto dfull = testing::random_normal(full.size(), 22);
    std::vector<float> dlocal(local.size());
    cpx.gather_backward(testing::as_tensor(dlocal, {B * Tl, C}), testing::as_tensor(dfull, {B * T, C}), I);
    CHECK(dlocal == take_rows(dfull, C, index.data() + size_t(rank) * B * Tl, B * Tl));
  }
}
