// Comm: the collective interface a component receives for the one group it talks to. MPI
// backend (host memory). Every call is checked; a failure throws (and the job aborts).
#pragma once
#include <mpi.h>

#include <cstdint>

#include "lib/core/tensor.h"

namespace mpigpt {

class Comm {
 public:
  explicit Comm(MPI_Comm comm);  // MPI_COMM_NULL: a rank outside the group (size 0)
  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm mpi() const { return comm_; }

  // In-place sums over the group (no-ops when the group has one rank).
  void allreduce_sum(Tensor t) const;
  void allreduce_sum(double* x, int n) const;
  void allreduce_sum(int64_t* x, int n) const;
  void barrier() const;

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

// Throws mpigpt::Error with the MPI error string when rc is not MPI_SUCCESS.
void mpi_check(int rc, const char* call, const char* file, int line);
#define MPIGPT_MPI(call) ::mpigpt::mpi_check((call), #call, __FILE__, __LINE__)

}  // namespace mpigpt
