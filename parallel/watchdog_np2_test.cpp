// The watchdog over real communication: a rank whose peer joins a call late has that wait
// reported, naming the call, its payload, the group and the peer. (Stopping the job is the
// command-line test cli/comm_timeout_np2: here the action only records.)
#include <doctest/doctest.h>
#include <mpi.h>

#include <chrono>
#include <thread>
#include <vector>

#include "lib/core/watchdog.h"
#include "lib/core/watchdog_testing.h"
#include "parallel/comm.h"

namespace mpigpt {
namespace {

// A named duplicate of the world, as the mesh names its groups.
struct NamedWorld {
  MPI_Comm c = MPI_COMM_NULL;
  NamedWorld() {
    MPI_Comm_dup(MPI_COMM_WORLD, &c);
    MPI_Comm_set_name(c, "watchdog-test");
  }
  ~NamedWorld() { MPI_Comm_free(&c); }
};

void late(int rank, int who) {
  if (rank == who) std::this_thread::sleep_for(std::chrono::milliseconds(800));
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("watchdog over MPI: the waiting rank's report names the call, its payload, the group and the peer") {
  NamedWorld w;
  const Comm comm(w.c);
  REQUIRE(comm.size() == 2);
  const int me = comm.rank();
  CHECK(comm.label().str() == fmt::format("group watchdog-test (rank {} of 2; world ranks 0, 1)", me));
  WatchdogReports reports;
  {
    const Watchdog dog(0.2, reports.action());

    // A blocking collective: rank 1 comes late, rank 0 waits.
    late(me, 1);
    double x[3] = {1, 2, 3};
    comm.allreduce_sum(x, 3);
    CHECK(x[2] == 6);

    // A non-blocking one, waited for: rank 0 comes late.
    std::vector<float> v(5, 1.0f);
    late(me, 0);
    comm.iallreduce_sum(Tensor(v.data(), Shape{5}, DType::F32)).wait();
    CHECK(v[0] == 2.0f);

    // A message: rank 1 receives from rank 0, which sends late.
    std::vector<float> m(4, float(me));
    if (me == 0) {
      late(me, 0);
      comm.send(Tensor(m.data(), Shape{4}, DType::F32), 1, 7);
    } else {
      comm.recv(Tensor(m.data(), Shape{4}, DType::F32), 0, 7);
      CHECK(m[0] == 0.0f);
    }
    comm.barrier();  // no one late
  }
  const std::vector<std::string> r = reports.get();
  const std::string group = "over group watchdog-test (rank " + std::to_string(me) + " of 2; world ranks 0, 1)";
  if (me == 0) {
    REQUIRE(r.size() == 1);
    CHECK(has(r[0], "waited longer than the timeout of 0.2 s"));
    CHECK(has(r[0], "s in all-reduce (sum) of 3 f64 " + group));
  } else {
    REQUIRE(r.size() == 2);
    CHECK(has(r[0], "s in all-reduce (sum) of 5 f32 " + group));
    CHECK(has(r[1], "s in receive of 4 f32 from group rank 0 (world rank 0) " + group));
  }
}

}  // namespace mpigpt
