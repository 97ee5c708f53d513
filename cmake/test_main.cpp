// Entry point of the doctest suite: starts MPI once (multi-rank test files run under mpirun, the
// rest as a singleton) and makes fatal errors inside tests abort every rank instead of hanging.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  doctest::Context ctx(argc, argv);
  int rc = ctx.run();
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world > 1) {
    // A failure on any rank fails the entry: combine the return codes before leaving.
    int worst = rc;
    MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    rc = worst;
  }
  MPI_Finalize();
  return rc;
}
