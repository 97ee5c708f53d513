// Four ranks: the all-to-all and all-gather token dispatchers round-trip rows, and an MoE layer
// with experts split over ep = 2 or 4 ranks (tokens of one micro-batch spread over token_group)
// gives the single-rank layer's outputs, losses and gradients, capacity dropping included.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "lib/kernels/testing.h"
#include "lib/model/moe.h"
#include "lib/model/moe_testing.h"
#include "parallel/expert_parallel.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// A communicator split of WORLD, freed with the object.
struct Split {
  MPI_Comm mpi = MPI_COMM_NULL;
  std::unique_ptr<Comm> comm;
  Split(int color, int key) {
    MPI_Comm_split(MPI_COMM_WORLD, color, key, &mpi);
    comm = std::make_unique<Comm>(mpi);
  }
  ~Split() { MPI_Comm_free(&mpi); }
};

enum class Kind { AllToAll, AllGather };

std::unique_ptr<TokenDispatcher> make_dispatcher(Kind k, Ops& ops, const Comm* ep, int E) {
  if (k == Kind::AllToAll) return std::make_unique<AllToAllDispatcher>(ops, ep, E);
  return std::make_unique<AllGatherDispatcher>(ops, ep, E);
}

}  // namespace

TEST_CASE("dispatchers round-trip: dispatch, identity experts, combine gives x times the kept gate sum") {
  Comm world(MPI_COMM_WORLD);
  REQUIRE(world.size() == 4);
  const int r = world.rank();
  auto ops = make_cpu_ops();
  const int64_t N = 5, C = 3, E = 8;
  const int K = 2;
  for (int ep : {1, 2, 4}) {
    for (Kind kind : {Kind::AllToAll, Kind::AllGather}) {
      CAPTURE(ep);
      CAPTURE(int(kind));
      Split grp(r / ep, r % ep);  // consecutive ranks form an ep group
      auto disp = make_dispatcher(kind, *ops, grp.comm.get(), int(E));
      CHECK(disp->num_local_experts() == E / ep);
      // Each rank routes its tokens to distinct experts (rank- and token-dependent); every 3rd dropped.
      std::vector<int32_t> expert(static_cast<size_t>(N * K));
      for (int64_t a = 0; a < N * K; ++a) expert[a] = a % 3 == 2 ? -1 : int32_t((a / K * 3 + r + (a % K) * 5) % E);
      for (int64_t t = 0; t < N; ++t)
        if (expert[t * K] == expert[t * K + 1]) expert[t * K + 1] = -1;
      auto x = random_normal(static_cast<size_t>(N * C), 81, uint64_t(r));
      auto gates = random_normal(static_cast<size_t>(N * K), 82, uint64_t(r));
      auto dy = random_normal(static_cast<size_t>(N * C), 83, uint64_t(r));
      DispatchState s;
      disp->plan(s, expert, N, K, as_tensor(gates, {N, K}));
      std::vector<float> xe(static_cast<size_t>(std::max<int64_t>(1, s.expert_rows * C)));
      Tensor xe_t(xe.data(), {s.expert_rows, C});
      disp->dispatch_forward(xe_t, as_tensor(x, {N, C}), s);
      std::vector<float> y(static_cast<size_t>(N * C), 0.5f);  // combine accumulates
      disp->combine_forward(as_tensor(y, {N, C}), xe_t, s);
      std::vector<double> want(y.size()), want_dx(y.size(), 0.25), want_dg(gates.size(), 0.0);
      for (int64_t t = 0; t < N; ++t) {
        double gs = 0.0;
        for (int k = 0; k < K; ++k) {
          if (expert[t * K + k] < 0) continue;
          gs += gates[t * K + k];
          for (int64_t c = 0; c < C; ++c) want_dg[t * K + k] += double(dy[t * C + c]) * x[t * C + c];
        }
        for (int64_t c = 0; c < C; ++c)
          want[t * C + c] = 0.5 + gs * x[t * C + c], want_dx[t * C + c] += gs * dy[t * C + c];
      }
      auto rep = allclose(y, want, 1e-6, 1e-6);
      CHECK_MESSAGE(rep.ok, rep.str());
      // Backward of the same chain: dgates = dy . x on kept slots, dx = dy times the gate sum.
      std::vector<float> dye(xe.size()), dg(gates.size(), 9.0f), dx(y.size(), 0.25f);
      Tensor dye_t(dye.data(), {s.expert_rows, C});
      disp->combine_backward(dye_t, as_tensor(dg, {N, K}), as_tensor(dy, {N, C}), xe_t, s);
      disp->dispatch_backward(as_tensor(dx, {N, C}), dye_t, s);
      rep = allclose(dg, want_dg, 1e-6, 1e-6);
      CHECK_MESSAGE(rep.ok, "dgates: ", rep.str());
      rep = allclose(dx, want_dx, 1e-6, 1e-6);
      CHECK_MESSAGE(rep.ok, "dx: ", rep.str());
      // Every expert row arrived: the rows over all ranks equal the kept assignments over all ranks.
      int64_t kept = 0, rows = s.expert_rows;
      for (int32_t e : expert) kept += e >= 0;
      world.allreduce_sum(&kept, 1);
      world.allreduce_sum(&rows, 1);
      CHECK(rows == kept);
    }
  }
}

namespace {

// This rank's rows [pos*n, (pos+1)*n) of the reference outputs and input gradients, and the
// losses, against the layer's (fp32 sums of a handful of terms in another order: a few ulp of
// unit-scale values).
void check_rows(const std::vector<float>& y, const std::vector<float>& dx, const MoeLosses& loss,
                const std::vector<float>& ys, const std::vector<float>& dxs, const MoeLosses& ref, int pos) {
  const std::ptrdiff_t n = std::ptrdiff_t(y.size());
  std::vector<float> yw(ys.begin() + pos * n, ys.begin() + (pos + 1) * n);
  std::vector<float> dxw(dxs.begin() + pos * n, dxs.begin() + (pos + 1) * n);
  auto rep = allclose(y, yw, 1e-5, 1e-5);
  CHECK_MESSAGE(rep.ok, "y: ", rep.str());
  rep = allclose(dx, dxw, 1e-5, 1e-5);
  CHECK_MESSAGE(rep.ok, "dx: ", rep.str());
  CHECK(loss.aux == doctest::Approx(ref.aux).epsilon(1e-6));
  CHECK(loss.z == doctest::Approx(ref.z).epsilon(1e-6));
}

// Every weight gradient (already summed over the ranks) against the reference's.
void check_grads(MoeHostWeights& got, MoeHostWeights& ref) {
  auto all_ref = ref.all();
  auto all_got = got.all();
  for (size_t i = 0; i < all_got.size(); ++i) {
    const std::string name = all_got[i].first;
    CAPTURE(name);
    auto rep = allclose(*all_got[i].second, *all_ref[i].second, 1e-5, 1e-5);
    CHECK_MESSAGE(rep.ok, rep.str());
  }
}

struct Layout {
  const char* name;
  Kind kind;
  int ep;               // consecutive (ep_of) or strided groups, see below
  bool ep_consecutive;  // ep group = {r / ep * ep ...} (true) or ranks r, r + 4/ep, ... (false)
  int per_mb;           // ranks per micro-batch (token_group size)
  bool mb_consecutive;  // token_group = consecutive ranks (true) or strided (false)
};

// The layer with experts split over ep against the single-rank layer on each micro-batch.
void check_layout(const Layout& L, const MoeConfig& cfg) {
  Comm world(MPI_COMM_WORLD);
  const int r = world.rank();
  auto ops = make_cpu_ops();
  const int64_t N = 6, C = 6;
  const int E = cfg.num_experts;
  // Groups: a "consecutive" group of size s is {r / s * s + i}, a strided one {r % (4/s) + i * 4/s}.
  auto color_key = [&](int s, bool consecutive) {
    return consecutive ? std::pair{r / s, r % s} : std::pair{r % (4 / s), r / (4 / s)};
  };
  auto [ec, ek] = color_key(L.ep, L.ep_consecutive);
  auto [tc, tk] = color_key(L.per_mb, L.mb_consecutive);
  Split ep(ec, ek), tg(tc, tk);
  const int mb = tc, pos = tk;  // this rank's micro-batch and its place in it

  MoeHostWeights w(cfg, C, 91), g(cfg, C, 0), gref(cfg, C, 0);
  auto tokens = [&](int rank, uint64_t seed) {
    return random_normal(static_cast<size_t>(N * C), seed, uint64_t(rank));
  };
  auto disp = make_dispatcher(L.kind, *ops, ep.comm.get(), E);
  MoeLayer layer(cfg, *ops, C, disp.get(), tg.comm.get());
  const int El = disp->num_local_experts(), first = disp->first_expert();
  auto x = tokens(r, 92), dy = tokens(r, 93);
  std::vector<int32_t> index(static_cast<size_t>(N));
  for (int64_t t = 0; t < N; ++t) index[t] = int32_t(pos * N + t);
  std::vector<float> y(static_cast<size_t>(N * C)), dx(y.size());
  MoeActs acts;
  const MoeLosses loss =
      layer.forward(acts, as_tensor(y, {N, C}), as_tensor(x, {N, C}), index.data(), w.views(first, El));
  MoeWeights gv = g.views(first, El);
  layer.backward(as_tensor(dx, {N, C}), acts, as_tensor(dy, {N, C}), w.views(first, El), gv, 0.5f);
  for (auto [name, v] : g.all())  // every rank's contributions to every weight, summed
    if (!v->empty()) world.allreduce_sum(Tensor(v->data(), {int64_t(v->size())}));

  // Reference: every micro-batch on one rank (its ranks' tokens in token_group order), all experts.
  MoeLayer ref(cfg, *ops, C);
  for (int m = 0; m < 4 / L.per_mb; ++m) {
    const int64_t T = N * L.per_mb;
    std::vector<float> xs(static_cast<size_t>(T * C)), dys(xs.size()), ys(xs.size()), dxs(xs.size());
    for (int p = 0; p < L.per_mb; ++p) {
      const int rank = L.mb_consecutive ? m * L.per_mb + p : m + p * (4 / L.per_mb);
      auto xr = tokens(rank, 92), dyr = tokens(rank, 93);
      std::copy(xr.begin(), xr.end(), xs.begin() + p * N * C);
      std::copy(dyr.begin(), dyr.end(), dys.begin() + p * N * C);
    }
    MoeActs ra;
    const MoeLosses rl = ref.forward(ra, as_tensor(ys, {T, C}), as_tensor(xs, {T, C}), nullptr, w.views());
    MoeWeights rg = gref.views();
    ref.backward(as_tensor(dxs, {T, C}), ra, as_tensor(dys, {T, C}), w.views(), rg, 0.5f);
    if (m == mb) check_rows(y, dx, loss, ys, dxs, rl, pos);
  }
  check_grads(g, gref);
}

}  // namespace

TEST_CASE("moe layer with experts over ep ranks equals the single-rank layer") {
  REQUIRE(Comm(MPI_COMM_WORLD).size() == 4);
  MoeConfig c;
  c.num_experts = 4, c.top_k = 2, c.hidden = 5;
  c.aux_loss_coeff = 0.1f, c.z_loss_coeff = 0.05f, c.capacity_factor = 1.0f;
  MoeConfig c2 = c;
  c2.router = MoeConfig::Router::Sigmoid, c2.drop_policy = MoeConfig::DropPolicy::Position;
  c2.activation = MoeConfig::Activation::Swiglu, c2.bias = false;
  MoeConfig c3 = c;
  c3.capacity_factor = 0.0f, c3.shared_hidden = 3, c3.norm_topk_prob = true;
  const std::vector<Layout> layouts = {
      {"alltoall ep4, one micro-batch over 4 ranks", Kind::AllToAll, 4, true, 4, true},
      {"allgather ep4, one micro-batch over 4 ranks", Kind::AllGather, 4, true, 4, true},
      {"alltoall ep2 {0,1},{2,3}; micro-batches over {0,2},{1,3}", Kind::AllToAll, 2, true, 2, false},
      {"alltoall ep2 {0,2},{1,3}; micro-batches over {0,1},{2,3}", Kind::AllToAll, 2, false, 2, true},
      {"allgather ep2 {0,1},{2,3}; micro-batches over {0,1},{2,3}", Kind::AllGather, 2, true, 2, true},
      {"alltoall ep4; a micro-batch per rank", Kind::AllToAll, 4, true, 1, true},
  };
  for (const auto& L : layouts) {
    for (const MoeConfig* cfg : {&c, &c2, &c3}) {
      const std::string layout = L.name;
      const std::string config = cfg == &c    ? "softmax capacity probs"
                                 : cfg == &c2 ? "sigmoid swiglu capacity position"
                                              : "dropless shared";
      CAPTURE(layout);
      CAPTURE(config);
      check_layout(L, *cfg);
    }
  }
}

TEST_CASE("moe layer with expert tensor parallelism (etp 2 x ep 2) equals the single-rank layer") {
  Comm world(MPI_COMM_WORLD);
  const int r = world.rank();
  auto ops = make_cpu_ops();
  const int64_t N = 6, C = 6;
  // Every rank holds its own N tokens of one micro-batch of 4N (token_group = world), as under
  // sequence parallelism. etp pairs {0,1}, {2,3}; ep groups {0,2}, {1,3}: experts split in two
  // (ep rank r / 2), each expert's F in two (etp rank r % 2). alltoall: over ep, the layer
  // gathers over etp; allgather: over the whole etp x ep group.
  Split etp(r / 2, r % 2), ep(r % 2, r / 2);
  const int er = r % 2;
  for (Kind kind : {Kind::AllToAll, Kind::AllGather})
  for (auto act : {MoeConfig::Activation::Gelu, MoeConfig::Activation::Swiglu}) {
    MoeConfig cfg;
    cfg.num_experts = 4, cfg.top_k = 2, cfg.hidden = 6, cfg.activation = act;
    cfg.bias = act == MoeConfig::Activation::Gelu, cfg.capacity_factor = 1.0f;
    cfg.aux_loss_coeff = 0.1f, cfg.z_loss_coeff = 0.05f, cfg.shared_hidden = 3;
    CAPTURE(int(act));
    CAPTURE(int(kind));
    std::unique_ptr<TokenDispatcher> disp;
    if (kind == Kind::AllToAll)
      disp = std::make_unique<AllToAllDispatcher>(*ops, ep.comm.get(), cfg.num_experts);
    else
      disp = std::make_unique<AllGatherDispatcher>(*ops, &world, cfg.num_experts, std::vector<int>{0, 0, 1, 1});
    CHECK(disp->spans_expert_tp() == (kind == Kind::AllGather));
    MoeLayer layer(cfg, *ops, C, disp.get(), &world, etp.comm.get());
    const bool glu = act == MoeConfig::Activation::Swiglu;
    MoeHostWeights w(cfg, C, 101), g(cfg, C, 0), gref(cfg, C, 0);
    const int64_t El = disp->num_local_experts(), first = disp->first_expert(), F = cfg.hidden, Fl = layer.local_hidden();
    REQUIRE(first == (r / 2) * El);
    const int64_t H = w.H, Hl = glu ? 2 * Fl : Fl;
    REQUIRE(Fl == F / 2);
    // fc row j of the shard = global row rowmap(j); proj column j = global column er * Fl + j.
    auto fc_row = [&](int64_t j) { return j < Fl ? er * Fl + j : F + er * Fl + (j - Fl); };
    std::vector<float> fc(static_cast<size_t>(El * Hl * C)), fcb(static_cast<size_t>(El * Hl)),
        proj(static_cast<size_t>(El * C * Fl));
    for (int64_t e = 0; e < El; ++e) {
      for (int64_t j = 0; j < Hl; ++j) {
        for (int64_t c = 0; c < C; ++c) fc[(e * Hl + j) * C + c] = w.fc[((first + e) * H + fc_row(j)) * C + c];
        if (cfg.bias) fcb[e * Hl + j] = w.fcb[(first + e) * H + fc_row(j)];
      }
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < Fl; ++j) proj[(e * C + c) * Fl + j] = w.proj[((first + e) * C + c) * F + er * Fl + j];
    }
    MoeWeights lw = w.views(int(first), int(El));
    lw.fc = as_tensor(fc, {El, Hl, C}), lw.proj = as_tensor(proj, {El, C, Fl});
    lw.fc_bias = cfg.bias ? as_tensor(fcb, {El, Hl}) : Tensor();
    std::vector<float> dfc(fc.size(), 0.0f), dfcb(fcb.size(), 0.0f), dproj(proj.size(), 0.0f);
    MoeWeights lg = g.views(int(first), int(El));
    lg.fc = as_tensor(dfc, {El, Hl, C}), lg.proj = as_tensor(dproj, {El, C, Fl});
    lg.fc_bias = cfg.bias ? as_tensor(dfcb, {El, Hl}) : Tensor();

    auto tokens = [&](int v, uint64_t seed) { return random_normal(static_cast<size_t>(N * C), seed, uint64_t(v)); };
    auto x = tokens(r, 102), dy = tokens(r, 103);
    std::vector<float> y(x.size()), dx(x.size());
    MoeActs acts;
    const MoeLosses loss = layer.forward(acts, as_tensor(y, {N, C}), as_tensor(x, {N, C}), nullptr, lw);
    layer.backward(as_tensor(dx, {N, C}), acts, as_tensor(dy, {N, C}), lw, lg, 1.0f);
    // Back into global layout. Expert slices are each on one rank; the proj bias gradient is the
    // same on both etp ranks (counted once); router and shared expert saw only this rank's tokens.
    for (int64_t e = 0; e < El; ++e) {
      for (int64_t j = 0; j < Hl; ++j) {
        for (int64_t c = 0; c < C; ++c) g.fc[((first + e) * H + fc_row(j)) * C + c] = dfc[(e * Hl + j) * C + c];
        if (cfg.bias) g.fcb[(first + e) * H + fc_row(j)] = dfcb[e * Hl + j];
      }
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < Fl; ++j) g.proj[((first + e) * C + c) * F + er * Fl + j] = dproj[(e * C + c) * Fl + j];
    }
    if (er != 0) std::fill(g.projb.begin(), g.projb.end(), 0.0f);
    for (auto [name, v] : g.all())
      if (!v->empty()) world.allreduce_sum(Tensor(v->data(), {int64_t(v->size())}));

    const int64_t T = 4 * N;
    std::vector<float> xs(static_cast<size_t>(T * C)), dys(xs.size()), ys(xs.size()), dxs(xs.size());
    for (int v = 0; v < 4; ++v) {
      auto xv = tokens(v, 102), dyv = tokens(v, 103);
      std::copy(xv.begin(), xv.end(), xs.begin() + v * N * C);
      std::copy(dyv.begin(), dyv.end(), dys.begin() + v * N * C);
    }
    MoeLayer ref(cfg, *ops, C);
    MoeActs ra;
    const MoeLosses rl = ref.forward(ra, as_tensor(ys, {T, C}), as_tensor(xs, {T, C}), nullptr, w.views());
    MoeWeights rg = gref.views();
    ref.backward(as_tensor(dxs, {T, C}), ra, as_tensor(dys, {T, C}), w.views(), rg, 1.0f);
    check_rows(y, dx, loss, ys, dxs, rl, r);
    check_grads(g, gref);
  }
}
