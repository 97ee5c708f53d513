// Device choice: one rank per GPU by local rank, and the errors for no GPU and too few GPUs.
#include "lib/kernels/device_select.h"

#include <doctest/doctest.h>

#include "lib/core/error.h"

using namespace mpigpt;

TEST_CASE("device = local rank; too few GPUs or none is an error naming the host and the counts") {
  CHECK(choose_device(0, 1, 1, false, "n1") == 0);
  CHECK(choose_device(5, 8, 8, false, "n1") == 5);
  CHECK(choose_device(3, 4, 8, false, "n1") == 3);       // fewer ranks than GPUs: the first ones
  CHECK(choose_device(3, 4, 2, true, "n1") == 1);        // sharing allowed: round robin
  CHECK_THROWS_WITH_AS(choose_device(2, 4, 2, false, "gpu07"),
                       doctest::Contains("4 ranks run on host gpu07 but it has 2 CUDA device(s)"), Error);
  CHECK_THROWS_WITH_AS(choose_device(0, 2, 0, true, "login1"),
                       doctest::Contains("engine.backend = cuda but host login1 has no CUDA device"), Error);
}
