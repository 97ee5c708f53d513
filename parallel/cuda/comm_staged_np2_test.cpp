// GPU test, two ranks on one GPU (CTest label gpu; exits 77, skipped, without a GPU): the staged
// path (engine.comm = mpi) moves device tensors through pinned host memory and must leave exactly
// what the host path leaves; NCCL, asked for two ranks on one GPU, refuses both.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#include "parallel/comm.h"
#include "parallel/data_parallel.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

using Op = std::function<void(const std::vector<Tensor>&)>;

// `op` once on host f32 tensors holding `inputs`, once on device tensors of dtype dt holding the
// same values: every tensor must end the same, and f32 calls count the same bytes.
void same_as_host(Ops& ops, const Comm& c, DType dt, const std::vector<std::vector<float>>& inputs, const Op& op) {
  std::vector<std::vector<float>> host = inputs;
  std::vector<Tensor> ht;
  for (std::vector<float>& h : host) ht.emplace_back(h.data(), Shape{int64_t(h.size())});
  c.reset_stats();
  op(ht);
  const CommStats on_host = c.stats();
  std::vector<DeviceTensor> dev;
  std::vector<Tensor> dt_tensors;
  for (const std::vector<float>& in : inputs) {
    dev.push_back(to_device(ops, in, {int64_t(in.size())}, dt));
    dt_tensors.push_back(dev.back().t);
  }
  c.reset_stats();
  op(dt_tensors);
  for (size_t i = 0; i < dev.size(); ++i) {
    CAPTURE(i);
    CHECK(to_host(ops, dev[i].t) == host[i]);
  }
  if (dt == DType::F32) {
    CHECK(c.stats().total() == on_host.total());
    CHECK(c.stats().calls == on_host.calls);
  }
}

std::vector<float> ramp(int n, int rank, int scale = 1) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = float(scale * (rank + 1) * (i % 5) - 3 * i + rank);
  return v;
}

}  // namespace

// Every call, blocking and not, on device tensors of f32, bf16 and i32 against host f32 tensors of
// the same values (small integers: exact in bf16 and in any summation order), with the compute
// stream given and without.
TEST_CASE("staged: every call on device tensors equals the host path") {
  std::unique_ptr<Ops> ops = cuda_ops_or_skip();
  Comm c(MPI_COMM_WORLD);
  REQUIRE(c.size() == 2);
  const int r = c.rank(), other = 1 - r;
  for (bool with_stream : {true, false}) {
    c.use_staging(with_stream ? ops->stream() : nullptr);
    CHECK_FALSE(c.uses_nccl());
    for (DType dt : {DType::F32, DType::BF16}) {
      CAPTURE(with_stream);
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      auto same = [&](const std::vector<std::vector<float>>& in, const Op& op) { same_as_host(*ops, c, dt, in, op); };
      same({ramp(6, r)}, [&](auto& t) { c.allreduce_sum(t[0]); });
      same({ramp(6, r)}, [&](auto& t) { c.allreduce_max(t[0]); });
      same({ramp(6, r)}, [&](auto& t) { c.iallreduce_sum(t[0]).wait(); });
      same({std::vector<float>(3), ramp(6, r)}, [&](auto& t) { c.reduce_scatter_sum(t[0], t[1]); });
      same({std::vector<float>(3), ramp(6, r)}, [&](auto& t) { c.ireduce_scatter_sum(t[0], t[1]).wait(); });
      same({std::vector<float>(8), ramp(4, r)}, [&](auto& t) { c.all_gather(t[0], t[1]); });
      same({std::vector<float>(8), ramp(4, r)}, [&](auto& t) { c.iall_gather(t[0], t[1]).wait(); });
      same({ramp(8, r)}, [&](auto& t) { c.reduce_scatter_sum_inplace(t[0]); });
      same({ramp(8, r)}, [&](auto& t) {
        Request q = c.ireduce_scatter_sum_inplace(t[0]);
        while (!q.test()) {
        }
      });
      same({ramp(8, r)}, [&](auto& t) { c.all_gather_inplace(t[0]); });
      same({ramp(8, r)}, [&](auto& t) { c.iall_gather_inplace(t[0]).wait(); });
      same({ramp(5, r)}, [&](auto& t) { c.broadcast(t[0], 1); });
      // rank q sends q + 1 elements to rank 0 and 2 to rank 1, so rank 0 receives 1 and 2, rank 1
      // receives 2 and 2; out has room to spare (untouched)
      const std::vector<int64_t> recv_counts = r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 2};
      same({std::vector<float>(9, -7), ramp(r + 3, r)},
           [&](auto& t) { c.all_to_all_v(t[0], recv_counts, t[1], {int64_t(r + 1), 2}); });
      same({ramp(7, r)}, [&](auto& t) {
        if (r == 0)
          c.send(t[0], 1, 3);
        else
          c.recv(t[0], 0, 3);
      });
      // Both ranks send before either receives: non-blocking sends make this exchange work.
      same({ramp(7, r), std::vector<float>(7)}, [&](auto& t) {
        Request rq = c.irecv(t[1], other, 4);
        Request sq = c.isend(t[0], other, 4);
        sq.wait();
        rq.wait();
      });
    }
    // i32: gathered and summed as integers
    DeviceTensor i = to_device(*ops, std::vector<int32_t>{r, 10 * r + 1}, {2}), g = zeros(*ops, {4}, DType::I32);
    c.all_gather(g.t, i.t);
    c.allreduce_sum(i.t);
    CHECK(to_host_i32(*ops, g.t) == std::vector<int32_t>{0, 1, 1, 11});
    CHECK(to_host_i32(*ops, i.t) == std::vector<int32_t>{1, 12});
  }
}

TEST_CASE("staged: the data-parallel gradient sync on device buffers equals its host run") {
  std::unique_ptr<Ops> ops = cuda_ops_or_skip();
  Comm c(MPI_COMM_WORLD);
  c.use_staging(ops->stream());
  const BufferLayout L = plan_buffer({5, 7, 3, 9}, 8, c.size(), 4);
  for (bool distributed : {false, true}) {
    CAPTURE(distributed);
    const GradSyncOptions opts{distributed, true, distributed};
    std::vector<float> p(size_t(L.total), 0.0f), g(size_t(L.total), 0.0f);
    for (size_t i = 0; i < L.offsets.size(); ++i)
      for (int64_t k = 0; k < L.numels[i]; ++k) {
        p[size_t(L.offsets[i] + k)] = float(int64_t(i) + k);
        g[size_t(L.offsets[i] + k)] = float((c.rank() + 1) * (k % 4) - int64_t(i));
      }
    // One step: gradients final parameter by parameter from the last (as backward makes them),
    // the owned slices "updated" (doubled), the parameters gathered.
    auto step = [&](Tensor params, Tensor grads, const std::function<void(Tensor)>& update) {
      GradSync s(c, L, params, grads, opts);
      for (int i = int(L.offsets.size()) - 1; i >= 0; --i) s.grads_ready(L.param_range(i).begin, L.param_range(i).end);
      s.finish_grad_sync();
      for (const Range& o : s.owned_ranges()) update(params.flat_slice(o.begin, o.size()));
      s.gather_params();
      s.wait_all_params();
      return s.owned_ranges();
    };
    std::vector<float> hp = p, hg = g;
    const std::vector<Range> owned =
        step(Tensor(hp.data(), {L.total}), Tensor(hg.data(), {L.total}), [](Tensor t) {
          for (int64_t k = 0; k < t.numel(); ++k) t.f32()[k] *= 2;
        });
    DeviceTensor dp = to_device(*ops, p, {L.total}), dg = to_device(*ops, g, {L.total});
    step(dp.t, dg.t, [&](Tensor t) { ops->scale(t, 2.0f); });
    CHECK(to_host(*ops, dp.t) == hp);
    const std::vector<float> got = to_host(*ops, dg.t);
    for (const Range& o : owned)
      for (int64_t k = o.begin; k < o.end; ++k) CHECK(got[size_t(k)] == hg[size_t(k)]);
  }
}

TEST_CASE("NCCL refuses two ranks on one GPU and points to engine.comm = mpi") {
  std::unique_ptr<Ops> ops = cuda_ops_or_skip();
  Comm c(MPI_COMM_WORLD);
  // Both ranks fail alike (NCCL missing, or the shared GPU), before either waits in a bootstrap.
  CHECK_THROWS_WITH_AS(c.use_nccl(ops->stream(), true), doctest::Contains("engine.comm = mpi"), Error);
  CHECK_FALSE(c.uses_nccl());
}
