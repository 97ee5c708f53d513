// The pipeline executor's order rule for NCCL, one process: every generated schedule sends each
// pair of ranks' messages in the order the receiver receives them (NCCL matches by order, not by
// tag), so check_p2p_order passes for all of them; the multi-rank checks are in the np2 test.
#include "parallel/pipeline_parallel.h"

#include <doctest/doctest.h>

#include <algorithm>

using namespace mpigpt;

TEST_CASE("generated schedules send and receive each pair's messages in one order") {
  for (int pp : {2, 3, 4})
    for (int vpp : {1, 2, 3})
      for (int m : {1, 2, 3, 4, 6, 8, 12}) {
        if (vpp > 1 && m % pp != 0) continue;
        CAPTURE(pp);
        CAPTURE(vpp);
        CAPTURE(m);
        const Schedule s = make_schedule(pp, vpp, m);
        for (int a = 0; a < pp; ++a)
          for (int b = 0; b < pp; ++b) {
            const auto sent = p2p_sequence(s[a], a, pp, b, true), received = p2p_sequence(s[b], b, pp, a, false);
            CHECK(sent == received);
            if (b != (a + 1) % pp && b != (a + pp - 1) % pp) CHECK(sent.empty());  // only neighbours talk
          }
      }
}

TEST_CASE("p2p_sequence lists (tag, micro-batch) in action order") {
  // rank 0 of pp 2, vpp 2: sends chunk 0's activations (link 0->1, tag 1000), then receives the
  // wrapped activation of virtual stage 1 for its chunk 1 (link 1->2, tag 1002).
  const Schedule s = make_schedule(2, 2, 2);
  const auto sends = p2p_sequence(s[0], 0, 2, 1, true), recvs = p2p_sequence(s[0], 0, 2, 1, false);
  REQUIRE(sends.size() >= 2);
  CHECK(sends[0] == std::pair{1000, 0});
  CHECK(sends[1] == std::pair{1000, 1});
  REQUIRE(!recvs.empty());
  CHECK(recvs[0] == std::pair{1002, 0});
  CHECK(p2p_sequence(s[0], 0, 2, 0, true).empty());  // nobody sends to itself at pp 2
}
