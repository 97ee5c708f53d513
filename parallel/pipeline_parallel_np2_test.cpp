// Two ranks: the executor runs generated schedules through a fake stage (a chain of affine maps
// that records every misuse, pipeline_parallel_testing.h) and must reproduce a serial
// single-process computation exactly, and run_schedule refuses malformed action lists.
#include "parallel/pipeline_parallel_testing.h"

namespace {
std::string joined(const std::vector<std::string>& lines) {
  std::string all;
  for (const std::string& l : lines) all += l + '\n';
  return all;
}
}  // namespace

TEST_CASE("pp 2: the executor reproduces the serial computation for plain and interleaved 1F1B") {
  Comm comm(MPI_COMM_WORLD);
  REQUIRE(comm.size() == 2);
  for (int vpp : {1, 2, 3})
    for (int m : {2, 4, 6}) check_against_serial(comm, vpp, m);
  for (int m : {1, 3}) check_against_serial(comm, 1, m);  // plain 1F1B with m not a multiple of pp
  // pp 1: the chunks of one rank pass activations to each other through MPI's self messages
  Comm self(MPI_COMM_SELF);
  for (int vpp : {1, 2, 3})
    for (int m : {1, 3}) check_against_serial(self, vpp, m);
  // 400 KB messages go by MPI's rendezvous protocol, which reads the send buffer late: an
  // executor sending straight from the stage's reused output buffer would deliver NaN here.
  check_against_serial(comm, 2, 4, 100000);
  // The executor sends no more than the schedule's messages (Comm counts every byte).
  comm.reset_stats();
  check_against_serial(comm, 2, 4);
  // 4 virtual stages have 3 boundaries, crossed both ways by 4 micro-batches: 24 messages of 5
  // floats, half of them sent by each rank
  CHECK(comm.stats().send == int64_t(12 * 5 * sizeof(float)));
  CHECK(comm.stats().recv == comm.stats().send);
}

TEST_CASE("messages of different links stay apart when sent in another order than received") {
  // In generated schedules each pair of ranks happens to send and receive all its messages in
  // the same order, so even one tag for everything would pass the test above. Here rank 0 runs
  // its chunk 1 forward of micro-batch 0 before the chunk 0 forward of micro-batch 1 (still a
  // valid schedule), so rank 1 receives link 0->1 micro-batch 1 before link 2->3 micro-batch 0
  // although rank 0 sent them the other way round; only the per-link tags pair them right.
  Comm comm(MPI_COMM_WORLD);
  const int rank = comm.rank();
  Schedule schedule = make_schedule(2, 2, 2);
  std::vector<Action>& r0 = schedule[0];
  REQUIRE(to_string(r0).substr(0, 54) == "F0.0 sF0.0>1 F1.0 sF1.0>1 rF0.1<1 F0.1 sF0.1>1 rF1.1<1");
  std::rotate(r0.begin() + 2, r0.begin() + 4, r0.begin() + 7);
  REQUIRE(to_string(r0).substr(0, 54) == "F0.0 sF0.0>1 rF0.1<1 F0.1 sF0.1>1 F1.0 sF1.0>1 rF1.1<1");
  const SimResult sim = simulate(schedule, 2, 2, 1.0, 2.0);
  REQUIRE(sim.ok());
  AffineStage stage(2, 2, rank, 2);
  or_abort([&] { run_schedule(schedule[rank], stage, comm); });
  stage.finish();
  CHECK(stage.misuse.empty());
  const Reference ref = serial(4, 2, 5);
  for (int c = 0; c < 2; ++c) CHECK(stage.da[c] == ref.da[stage.stage(c)]);
  if (rank == 1) CHECK(stage.loss == ref.loss);
}

TEST_CASE("the fake stage reports misuse, so the comparison above can fail") {
  SUBCASE("calls out of order, one process") {
    AffineStage s(2, 2, 0, 2);  // rank 0 of pp 2: chunk 0 = virtual stage 0, chunk 1 = stage 2
    s.backward(0, 0);                                  // backward before forward
    s.forward_input(0, 0);                             // stage 0 has no input to receive
    s.forward(0, 0);
    s.forward(1, 0);
    s.forward_output(0, 0);                            // overwritten by forward(1, 0)
    s.forward(0, 1);                                   // its input never arrived
    s.finish();
    const std::string all = joined(s.misuse);
    CHECK(all.find("backward(0, 0) before its forward") != all.npos);
    CHECK(all.find("forward_input(0, 0) on virtual stage 0") != all.npos);
    CHECK(all.find("forward_output(0, 0): the buffer holds (1, 0)") != all.npos);
    CHECK(all.find("forward(0, 1) before its input arrived") != all.npos);
    CHECK(all.find("(1, 1) never ran forward and backward") != all.npos);
  }
  SUBCASE("an executor run with each send moved before the forward that produces it") {
    Comm comm(MPI_COMM_WORLD);
    const int pp = comm.size(), rank = comm.rank();
    Schedule schedule = make_schedule(pp, 2, 4);
    std::vector<Action>& mine = schedule[rank];
    for (size_t i = 1; i < mine.size(); ++i)
      if (mine[i].type == ActionType::SendForward) std::swap(mine[i - 1], mine[i]);
    AffineStage stage(pp, 2, rank, 4);
    or_abort([&] { run_schedule(mine, stage, comm); });  // the same messages in the same order: no hang
    CHECK(!stage.misuse.empty());
    const std::string all = joined(stage.misuse);
    CHECK(all.find("asked before the forward") != all.npos);
    CHECK(all.find("before its input arrived") != all.npos);  // what the peer received was NaN
  }
}

TEST_CASE("run_schedule refuses malformed lists before communicating") {
  Comm comm(MPI_COMM_WORLD);
  const int rank = comm.rank(), prev = (rank + 1) % 2;
  AffineStage stage(2, 2, rank, 2);
  // every rank gets a list it rejects on its own, so no rank waits for another
  CHECK_THROWS_WITH_AS(run_schedule({{ActionType::SendForward, 0, 0, rank}}, stage, comm),
                       doctest::Contains(fmt::format("but that message goes to or comes from rank {}", 1 - rank).c_str()),
                       Error);
  CHECK_THROWS_WITH_AS(
      run_schedule({{ActionType::SendBackward, 1, 1, prev}, {ActionType::SendBackward, 0, 1, prev}}, stage, comm),
      doctest::Contains(fmt::format("sB0.1>{} after micro-batch 1 on the same link", prev).c_str()), Error);
  if (rank == 0)
    CHECK_THROWS_WITH_AS(run_schedule({{ActionType::RecvForward, 0, 0, 1}}, stage, comm),
                         doctest::Contains("on virtual stage 0, which has no previous stage"), Error);
  CHECK(stage.misuse.empty());
}


TEST_CASE("check_p2p_order: what NCCL needs of a schedule, checked with the neighbours") {
  // NCCL pairs the messages of two ranks by order alone (comm.h). Generated schedules keep one
  // order per pair; the rotated schedule of the test above does not (its tags make MPI right),
  // and every rank of the group must refuse it, the one that sends in that order included.
  Comm comm(MPI_COMM_WORLD);
  const int rank = comm.rank();
  for (int vpp : {1, 2, 3})
    for (int m : {2, 4, 6}) CHECK_NOTHROW(check_p2p_order(make_schedule(2, vpp, m)[rank], comm));
  Schedule schedule = make_schedule(2, 2, 2);
  std::rotate(schedule[0].begin() + 2, schedule[0].begin() + 4, schedule[0].begin() + 7);
  CHECK_THROWS_WITH_AS(check_p2p_order(schedule[rank], comm),
                       doctest::Contains(rank == 1 ? "message 1 from pipeline rank 0 to rank 1: the sender sends tag 1004 "
                                                     "micro-batch 0, the receiver expects tag 1000 micro-batch 1"
                                                   : "another pipeline rank receives its messages in another order"),
                       Error);
  // One rank: nothing to pair.
  CHECK_NOTHROW(check_p2p_order(make_schedule(1, 1, 2)[0], Comm(MPI_COMM_SELF)));
}
