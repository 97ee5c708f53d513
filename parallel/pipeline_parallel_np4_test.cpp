// Four ranks: the executor against the serial reference for pp = 4, plain and interleaved.
#include "parallel/pipeline_parallel_testing.h"

TEST_CASE("pp 4: the executor reproduces the serial computation for plain and interleaved 1F1B") {
  Comm comm(MPI_COMM_WORLD);
  REQUIRE(comm.size() == 4);
  for (int vpp : {1, 2, 3})
    for (int m : {4, 8, 12}) check_against_serial(comm, vpp, m);
  for (int m : {1, 2, 3, 5}) check_against_serial(comm, 1, m);  // plain 1F1B with m not a multiple of pp
  check_against_serial(comm, 2, 8, 100000);                     // rendezvous-sized messages
}
