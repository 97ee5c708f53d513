// The device side of Comm: NCCL communicators with their streams and events, and the pinned host
// memory and copies of the staged path. comm_nccl.cpp is the one file of parallel/ that calls
// CUDA and NCCL; this header is plain C++ so that comm.cpp and the mesh stay free of both.
#pragma once
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lib/core/tensor.h"
#include "parallel/comm.h"

namespace mpigpt {

// Without the CUDA backend the functions below fail with a message (no device tensor exists then).
class NcclComm;    // one NCCL communicator and the stream its operations run on
class PinnedPool;  // pinned host blocks, reused from call to call

// How one Comm moves device tensors.
struct DeviceComm {
  void* compute_stream = nullptr;   // Ops::stream(); nullptr: the staged path synchronises the device
  std::shared_ptr<NcclComm> group;  // collectives over the group; null: the staged path
  // Directed point-to-point links (comm.h): to[i] = (peer, the link this rank sends it on),
  // from[i] = (peer, the link this rank receives from it on).
  std::vector<std::pair<int, std::shared_ptr<NcclComm>>> to, from;
  std::shared_ptr<PinnedPool> pinned;  // made on first use
  bool split_done = false;  // Comm::use_nccl_split took part in its ncclCommSplit (member or not)
};

enum class ReduceOp { Sum, Max };

// ---- NCCL ----------------------------------------------------------------------------------
// A communicator over the MPI group `group` (this process is `rank` of `size`), on the current
// CUDA device; collective over the group: rank 0 makes the unique id, MPI_Bcast hands it on,
// ncclCommInitRank joins.
std::shared_ptr<NcclComm> nccl_comm(MPI_Comm group, int rank, int size);
// A communicator split from `parent` (ncclCommSplit, NCCL 2.18 and newer): collective over the
// parent's members, those that pass the same colour (>= 0) forming one, ranked by key; a member
// that passes a negative colour takes part and gets none (nullptr). No unique id is handed
// round: the members meet through the parent's bootstrap.
std::shared_ptr<NcclComm> nccl_split(const NcclComm& parent, int colour, int key);
// The directed links (sender, receiver) between ring neighbours of a group of `size` ranks, each
// once, in the one order every rank creates its own. Creation blocks until both ends join, and
// following one global order cannot deadlock: the first link not yet made has both its ranks
// waiting at it.
std::vector<std::pair<int, int>> ring_links(int size);
// Makes this rank's links of the group (collective over it) into dc.to and dc.from: each with its
// own ncclCommInitRank (the sender's unique id sent over `group`), or, with split, each split from
// the group's communicator dc.group (every member takes part in every link's split).
void nccl_links(DeviceComm& dc, MPI_Comm group, int rank, int size, bool split);

// Queued on the communicator's stream after the compute work queued so far; the Request's
// wait() makes the compute stream wait for the result. Counts are the tensors' (checked by Comm).
Request nccl_allreduce(const DeviceComm& dc, Tensor t, ReduceOp op);
// out = inp's block rank (out.ptr == inp's block rank): in place, NCCL's convention.
Request nccl_reduce_scatter(const DeviceComm& dc, Tensor out, Tensor inp);
// inp = out's block rank: in place.
Request nccl_all_gather(const DeviceComm& dc, Tensor out, Tensor inp);
Request nccl_broadcast(const DeviceComm& dc, Tensor t, int root);
Request nccl_send(const DeviceComm& dc, Tensor t, int peer);
Request nccl_recv(const DeviceComm& dc, Tensor t, int peer);
// Grouped sends and receives on the group's communicator (NCCL has no all-to-all-v).
Request nccl_all_to_all_v(const DeviceComm& dc, Tensor out, const std::vector<int64_t>& recv_counts, Tensor inp,
                          const std::vector<int64_t>& send_counts);

// ---- the staged path -----------------------------------------------------------------------
// Pinned host memory of at least `bytes`, back to dc's pool when the last owner lets go.
std::shared_ptr<std::byte> pinned_host(DeviceComm& dc, size_t bytes);
// host <- dev (dev.nbytes()), after the compute work queued so far; returns when done.
void copy_to_host(const DeviceComm& dc, void* host, const Tensor& dev);
// dev <- host, before the compute work queued later; returns when done (host may be reused).
void copy_to_device(const DeviceComm& dc, const Tensor& dev, const void* host);

// ---- checks before NCCL --------------------------------------------------------------------
// The current CUDA device as a name unique on its node (the PCI bus id), "" without CUDA.
std::string device_bus_id();

}  // namespace mpigpt
