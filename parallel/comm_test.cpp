// Comm without a second rank or a GPU: Request's completion rules for device work (a fake stands
// in for NCCL's event), the order of the NCCL point-to-point links, what a host-only build says
// when NCCL is asked for, and the device checks that come before any memory is touched.
#include "parallel/comm.h"

#include <doctest/doctest.h>

#include <set>
#include <utility>

#include "parallel/comm_nccl.h"
#include "parallel/nccl_loader.h"

using namespace mpigpt;

namespace {

// Device work that finishes after `polls` calls of test(); counts the compute stream's waits.
struct FakeWork : AsyncWork {
  int polls = 0, waits = 0;
  void wait() override { ++waits; }
  bool test() override { return polls-- <= 0; }
};

}  // namespace

TEST_CASE("a request for device work: wait() orders the compute stream once, test() polls") {
  auto w = std::make_shared<FakeWork>();
  {
    Request r(w);
    CHECK_FALSE(r.done());
    r.wait();
    CHECK(r.done());
    r.wait();  // nothing left to wait for
  }
  CHECK(w->waits == 1);  // the destructor found it done

  auto p = std::make_shared<FakeWork>();
  p->polls = 2;
  Request r(p);
  CHECK_FALSE(r.test());
  CHECK_FALSE(r.test());
  CHECK(r.test());
  CHECK(r.done());
  CHECK(p->waits == 0);  // finished work needs no wait: later compute is queued after it anyway

  auto d = std::make_shared<FakeWork>();
  { Request abandoned(d); }
  CHECK(d->waits == 1);  // never abandoned with its buffers in flight

  auto m = std::make_shared<FakeWork>(), n = std::make_shared<FakeWork>();
  Request a(m), b(n);
  a = std::move(b);  // a's own work is completed first
  CHECK(m->waits == 1);
  CHECK(b.done());
  a.wait();
  CHECK(n->waits == 1);
}

TEST_CASE("NCCL point-to-point links: directed, between ring neighbours, each once") {
  CHECK(ring_links(1).empty());
  CHECK(ring_links(2) == std::vector<std::pair<int, int>>{{0, 1}, {1, 0}});
  for (int size : {3, 4, 7}) {
    CAPTURE(size);
    const auto links = ring_links(size);
    CHECK(links.size() == size_t(2 * size));
    CHECK(std::is_sorted(links.begin(), links.end()));
    CHECK(std::set(links.begin(), links.end()).size() == links.size());
    for (const auto& [s, r] : links) CHECK((r == (s + 1) % size || r == (s + size - 1) % size));
  }
}

TEST_CASE("Comm refuses mixed devices before touching memory, and says what NCCL needs") {
  Comm self(MPI_COMM_SELF);
  float host[4] = {1, 2, 3, 4};
  Tensor h(host, {4}), fake_device(reinterpret_cast<void*>(0x10), {4}, DType::F32, Device::CUDA);
  CHECK_THROWS_WITH_AS(self.all_gather(h, fake_device), doctest::Contains("must live on one device"), Error);
  CHECK_THROWS_WITH_AS(self.reduce_scatter_sum(fake_device, h), doctest::Contains("must live on one device"), Error);
  CHECK_FALSE(self.uses_nccl());
  // bf16 reduces on the device paths, not on MPI's host path (unchanged).
  uint16_t b[2] = {};
  CHECK_THROWS_WITH_AS(Comm(MPI_COMM_WORLD).reduce_scatter_sum_inplace(Tensor(b, {2}, DType::BF16)),
                       doctest::Contains("MPI cannot reduce bf16"), Error);
#ifdef MPIGPT_HAVE_NCCL
  // Built with NCCL's header: the library is found or the message says where it was looked for.
  const std::string e = nccl_load_error();
  if (!e.empty()) {
    CHECK(e.find("libnccl.so.2") != e.npos);
    CHECK(e.find("LD_LIBRARY_PATH") != e.npos);
    CHECK(e.find("engine.comm = mpi") != e.npos);
  }
#else
  CHECK(nccl_load_error().find("engine.comm = mpi") != std::string::npos);
  CHECK_THROWS_WITH_AS(self.use_nccl(nullptr, true), doctest::Contains("engine.comm = mpi"), Error);
  CHECK_FALSE(self.uses_nccl());
#endif
}
