// The host side of Comm (comm.cpp): the MPI calls on host tensors, their arguments already checked
// and counted, and the host image through which the staged path moves a device tensor.
#pragma once
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lib/core/tensor.h"
#include "parallel/comm.h"
#include "parallel/comm_nccl.h"

namespace mpigpt {

// ---- MPI on host tensors ----------------------------------------------------------------------
// In place over t; sums and maxima in pieces when t is larger than MPI's int count.
Request mpi_iallreduce(MPI_Comm comm, Tensor t, MPI_Op op);
void mpi_allreduce(MPI_Comm comm, Tensor t, MPI_Op op);
Request mpi_ireduce_scatter(MPI_Comm comm, Tensor out, Tensor inp);
Request mpi_iall_gather(MPI_Comm comm, Tensor out, Tensor inp);
// On size equal blocks of buf, rank's result in block rank (Comm's in-place convention).
Request mpi_ireduce_scatter_inplace(MPI_Comm comm, int rank, int size, Tensor buf);
Request mpi_iall_gather_inplace(MPI_Comm comm, int size, Tensor buf);
void mpi_broadcast(MPI_Comm comm, Tensor t, int root);
// `then` runs once the message has completed.
Request mpi_isend(MPI_Comm comm, Tensor t, int peer, int tag, std::function<void()> then = {});
Request mpi_irecv(MPI_Comm comm, Tensor t, int peer, int tag, std::function<void()> then = {});
void mpi_all_to_all_v(MPI_Comm comm, Tensor out, const std::vector<int64_t>& recv_counts, Tensor inp,
                      const std::vector<int64_t>& send_counts);

// ---- the staged path -------------------------------------------------------------------------
// A device tensor's image in pinned host memory, what MPI moves on the staged path. A bf16
// tensor that is reduced is widened to f32 on the host (MPI has no bf16 sum) and rounded back
// when stored.
class HostImage {
 public:
  // load: copy the device tensor in; widen: a bf16 tensor is held as f32 (it is to be reduced).
  HostImage(DeviceComm& dc, const Tensor& dev, bool load, bool widen);
  HostImage(const HostImage&) = delete;
  HostImage& operator=(const HostImage&) = delete;
  const Tensor& host() const { return host_; }
  // dev <- the image; dev may be a prefix of the tensor the image was made from.
  void store(const DeviceComm& dc, const Tensor& dev);

 private:
  std::shared_ptr<std::byte> raw_;  // the device bytes
  std::vector<float> wide_;         // the f32 copy of a reduced bf16 tensor
  Tensor host_;
};

}  // namespace mpigpt
