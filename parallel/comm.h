// Comm: the collective interface a component receives for the one group it talks to. Every call
// is checked (a failure throws, and the job aborts) and counted: stats() gives the payload bytes
// per kind of call, which is how the communication volume per group and step is measured.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lib/core/tensor.h"

namespace mpigpt {

// Payload bytes this rank handed to each kind of call (what it contributes, not wire traffic).
struct CommStats {
  int64_t allreduce = 0, reduce_scatter = 0, all_gather = 0, broadcast = 0, send = 0, recv = 0, all_to_all = 0;
  int64_t calls = 0;
  int64_t total() const { return allreduce + reduce_scatter + all_gather + broadcast + send + recv + all_to_all; }
};

// What a group is, for messages: its name (the mesh names its groups: "dp", "expert tp-ep", ...),
// this rank's place in it and the world ranks of its members.
struct GroupLabel {
  std::string name;
  int rank = 0, size = 0;
  std::vector<int> world_ranks;
  std::string str() const;  // "group dp (rank 1 of 4; world ranks 0, 2, 4, 6)"
};

// One communication call, as the watchdog reports a wait in it (lib/core/watchdog.h).
struct CallInfo {
  const char* op = "";
  int64_t count = 0;        // elements this rank contributes (sends, for all-to-all)
  const char* type = "f32";  // their type; nullptr: a call without a payload (a barrier)
  int peer = -1;  // group rank of a send's or receive's peer
  std::shared_ptr<const GroupLabel> group;
  std::string str() const;  // "all-reduce (sum) of 4096 f32 over group dp (rank 1 of 4; world ranks ...)"
};

// Work queued on a device stream by a communication backend (NCCL): wait() makes the compute
// stream wait for it without blocking the host, test() polls whether it has finished.
class AsyncWork {
 public:
  virtual ~AsyncWork() = default;
  virtual void wait() = 0;
  virtual bool test() = 0;
};

// A pending non-blocking operation; wait() completes it (the destructor waits too, so a
// request is never abandoned with its buffers in flight). Either MPI requests, which complete on
// the host, or device work (NCCL), which completes in stream order: after wait() the compute
// stream sees the result. `then` runs once, right after the operation completed: an in-place
// reduce-scatter uses it to move its result where it belongs, the staged path to copy a received
// message to the device.
class Request {
 public:
  Request() = default;
  explicit Request(std::vector<MPI_Request> r, std::function<void()> then = {})
      : reqs_(std::move(r)), then_(std::move(then)) {}
  explicit Request(std::shared_ptr<AsyncWork> work) : work_(std::move(work)) {}
  Request(Request&& o) noexcept
      : reqs_(std::exchange(o.reqs_, {})),
        then_(std::exchange(o.then_, nullptr)),
        work_(std::move(o.work_)),
        call_(std::move(o.call_)) {}
  Request& operator=(Request&& o) noexcept;
  ~Request();
  void wait();
  // Completes the request if it has finished (true). Calling it now and then is what moves a
  // non-blocking MPI collective along: without an asynchronous progress thread, MPI advances one
  // only inside MPI calls. For device work it only polls.
  bool test();
  bool done() const { return reqs_.empty() && !then_ && !work_; }
  // The call this request completes, named in the watchdog's report if wait() takes too long.
  Request about(CallInfo call) && {
    call_ = std::move(call);
    return std::move(*this);
  }

 private:
  void finish() noexcept;
  std::vector<MPI_Request> reqs_;
  std::function<void()> then_;
  std::shared_ptr<AsyncWork> work_;
  CallInfo call_;
};

struct DeviceComm;  // how this Comm moves device tensors (comm_nccl.h)

// Three paths behind the same calls, chosen per call by where the tensors live:
//   host tensors            MPI, as always.
//   device tensors, NCCL    after use_nccl(): NCCL on a communication stream of this Comm, ordered
//                           against the compute stream (Ops::stream()) by events and never by
//                           host synchronisation: the comm stream waits for the compute work
//                           queued before the call; a blocking call returns once the compute
//                           stream waits for the result; a non-blocking one returns a Request
//                           whose wait() does that. Results are thus visible to later ops, not
//                           yet to the host.
//   device tensors, staged  otherwise (engine.comm = mpi): device -> pinned host -> MPI ->
//                           device, synchronously; non-blocking collectives complete before they
//                           return (point-to-point stays non-blocking, see isend). bf16 is summed
//                           in f32 on the host.
class Comm {
 public:
  explicit Comm(MPI_Comm comm);  // MPI_COMM_NULL: a rank outside the group (size 0)
  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm mpi() const { return comm_; }
  // Its name (MPI_Comm_get_name, as the mesh set it), this rank's place and the members.
  const GroupLabel& label() const { return *label_; }
  const CommStats& stats() const { return stats_; }
  void reset_stats() const { stats_ = {}; }

  // ---- how device tensors move (the three paths above) -------------------------------------
  // Calling again rebinds the compute stream (and keeps NCCL communicators already made).
  // Staged path ordered against `compute_stream` (nullptr: synchronise the whole device).
  void use_staging(void* compute_stream);
  // NCCL from now on; collective over the group (the NCCL communicator's unique id comes from
  // group rank 0 over MPI, ncclCommInitRank makes it). p2p_links: also the directed links for
  // isend/irecv to ring neighbours (a group that only runs collectives needs none).
  void use_nccl(void* compute_stream, bool p2p_links);
  // The same with the communicator (and links) split from `parent`'s (ncclCommSplit), which
  // use_nccl must have set up: collective over parent's members, the ranks outside this group
  // included (each group of the same kind gets its communicator from the one call, so those
  // ranks call this on their own group's Comm, or on a Comm of size 0 where they have none).
  void use_nccl_split(void* compute_stream, bool p2p_links, const Comm& parent);
  bool uses_nccl() const;

  // In-place sums / maxima over the group (no-ops when the group has one rank).
  void allreduce_sum(Tensor t) const;
  void allreduce_max(Tensor t) const;
  void allreduce_sum(double* x, int n) const;   // host values: always MPI
  void allreduce_sum(int64_t* x, int n) const;  // host values: always MPI
  // out (n) = the sum over ranks of this rank's block of inp (size * n), block r to rank r.
  void reduce_scatter_sum(Tensor out, Tensor inp) const;
  // out (size * n) = the concatenation of every rank's inp (n), in rank order.
  void all_gather(Tensor out, Tensor inp) const;
  void broadcast(Tensor t, int root) const;
  // Point-to-point with NCCL: NCCL pairs sends and receives by order, not by tag, and runs a
  // communicator's operations one after another on its stream. A send finishes only once its
  // receive runs, so with sends and receives on one stream a send blocks the receives queued
  // behind it, which MPI's non-blocking sends never do; schedules that MPI runs then deadlock
  // (interleaved 1F1B does, also when each receive is grouped with the sends before it in one
  // ncclGroupStart/End). Sends and receives therefore go over directed links: 2-rank
  // communicators (sender -> receiver), each with its own stream, carrying one direction only,
  // which behave like MPI's non-blocking sends. A link matches its messages in the order they are
  // posted, hence THE RULE: every pair of ranks must receive its messages in the order they are
  // sent (tags still name them for MPI, but NCCL does not look at them). Links exist between ring
  // neighbours (rank +-1 mod size) of the groups set up with p2p links (the pipeline and
  // context-parallel groups), which is every point-to-point pattern of this program.
  void send(Tensor t, int peer, int tag = 0) const;
  void recv(Tensor t, int peer, int tag = 0) const;
  // out gets recv_counts[r] elements from each rank r (concatenated), inp sends
  // send_counts[r] elements to each rank r (consecutive blocks).
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, Tensor inp,
                    const std::vector<int64_t>& send_counts) const;

  // Non-blocking variants: the buffers must stay untouched until wait().
  Request iallreduce_sum(Tensor t) const;
  Request ireduce_scatter_sum(Tensor out, Tensor inp) const;
  Request iall_gather(Tensor out, Tensor inp) const;
  // Device tensors on the staged path: isend copies the tensor to the host before it returns,
  // irecv's wait() copies the message to the device.
  Request isend(Tensor t, int peer, int tag = 0) const;
  Request irecv(Tensor t, int peer, int tag = 0) const;
  // In place on one buffer of size() equal blocks, block r being rank r's (NCCL's in-place
  // convention), so a gradient bucket needs no second buffer. reduce_scatter: afterwards block
  // rank() holds the sum over ranks of everyone's block rank(); the other blocks hold scratch.
  // all_gather: every rank's block r becomes rank r's block r. Counted as their out-of-place
  // twins (the whole buffer for reduce-scatter, one block for all-gather). No-ops for one rank.
  void reduce_scatter_sum_inplace(Tensor buf) const;
  Request ireduce_scatter_sum_inplace(Tensor buf) const;
  void all_gather_inplace(Tensor buf) const;
  Request iall_gather_inplace(Tensor buf) const;
  void barrier() const;

 private:
  enum class Path { Host, Nccl, Staged };
  Path path(const char* op, std::initializer_list<Tensor> tensors) const;
  DeviceComm& device() const;
  CallInfo call(const char* op, int64_t count, DType dtype, int peer = -1) const {
    return {op, count, dtype_name(dtype), peer, label_};
  }
  CallInfo call(const char* op, int64_t count, const char* type) const { return {op, count, type, -1, label_}; }
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  mutable CommStats stats_;
  // Shared by copies of this Comm, so that a copy made before use_nccl() sees it too.
  std::shared_ptr<DeviceComm> device_;
  std::shared_ptr<const GroupLabel> label_;
};

// Throws mpigpt::Error with the MPI error string when rc is not MPI_SUCCESS.
void mpi_check(int rc, const char* call, const char* file, int line);
#define MPIGPT_MPI(call) ::mpigpt::mpi_check((call), #call, __FILE__, __LINE__)

}  // namespace mpigpt
