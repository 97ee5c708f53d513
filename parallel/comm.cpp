// The MPI backend of Comm.
#include "parallel/comm.h"

#include <algorithm>

#include "lib/core/error.h"

namespace mpigpt {

void mpi_check(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail("{}:{}: {} failed: {}", file, line, call, std::string(msg, len));
}

Comm::Comm(MPI_Comm comm) : comm_(comm) {
  if (comm == MPI_COMM_NULL) {  // not a member of any group of this kind
    size_ = 0;
    return;
  }
  MPIGPT_MPI(MPI_Comm_rank(comm, &rank_));
  MPIGPT_MPI(MPI_Comm_size(comm, &size_));
}

void Comm::allreduce_sum(Tensor t) const {
  if (size_ == 1) return;
  MPIGPT_CHECK(t.device == Device::CPU && t.dtype == DType::F32, "MPI all-reduce of {}", t.str());
  // MPI counts are int: reduce in pieces of at most 2^30 elements.
  float* p = t.f32();
  for (int64_t off = 0, n = t.numel(); off < n;) {
    const int count = int(std::min<int64_t>(n - off, int64_t(1) << 30));
    MPIGPT_MPI(MPI_Allreduce(MPI_IN_PLACE, p + off, count, MPI_FLOAT, MPI_SUM, comm_));
    off += count;
  }
}

void Comm::allreduce_sum(double* x, int n) const {
  if (size_ > 1) MPIGPT_MPI(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_DOUBLE, MPI_SUM, comm_));
}

void Comm::allreduce_sum(int64_t* x, int n) const {
  if (size_ > 1) MPIGPT_MPI(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_INT64_T, MPI_SUM, comm_));
}

void Comm::barrier() const { MPIGPT_MPI(MPI_Barrier(comm_)); }

}  // namespace mpigpt
