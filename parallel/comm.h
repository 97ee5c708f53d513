// Comm: the collective interface a component receives for the one group it talks to. MPI
// backend (host memory); a NCCL backend will fill the same interface. Every call is checked (a
// failure throws, and the job aborts) and counted: stats() gives the payload bytes per kind of
// call, which is how the communication volume per group and step is measured.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "lib/core/tensor.h"

namespace mpigpt {

// Payload bytes this rank handed to each kind of call (what it contributes, not wire traffic).
struct CommStats {
  int64_t allreduce = 0, reduce_scatter = 0, all_gather = 0, broadcast = 0, send = 0, recv = 0, all_to_all = 0;
  int64_t calls = 0;
  int64_t total() const { return allreduce + reduce_scatter + all_gather + broadcast + send + recv + all_to_all; }
};

// A pending non-blocking operation; wait() completes it (the destructor waits too, so a
// request is never abandoned with its buffers in flight). `then` runs once, right after the MPI
// requests complete: an in-place reduce-scatter uses it to move its result where it belongs.
class Request {
 public:
  Request() = default;
  explicit Request(std::vector<MPI_Request> r, std::function<void()> then = {})
      : reqs_(std::move(r)), then_(std::move(then)) {}
  Request(Request&& o) noexcept : reqs_(std::move(o.reqs_)), then_(std::move(o.then_)) {
    o.reqs_.clear();
    o.then_ = nullptr;
  }
  Request& operator=(Request&& o) noexcept;
  ~Request();
  void wait();
  // Completes the request if MPI has finished it (true). Calling it now and then is what moves a
  // non-blocking collective along: without an asynchronous progress thread, MPI advances one
  // only inside MPI calls.
  bool test();
  bool done() const { return reqs_.empty() && !then_; }

 private:
  void finish() noexcept;
  std::vector<MPI_Request> reqs_;
  std::function<void()> then_;
};

class Comm {
 public:
  explicit Comm(MPI_Comm comm);  // MPI_COMM_NULL: a rank outside the group (size 0)
  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm mpi() const { return comm_; }
  const CommStats& stats() const { return stats_; }
  void reset_stats() const { stats_ = {}; }

  // In-place sums / maxima over the group (no-ops when the group has one rank).
  void allreduce_sum(Tensor t) const;
  void allreduce_max(Tensor t) const;
  void allreduce_sum(double* x, int n) const;
  void allreduce_sum(int64_t* x, int n) const;
  // out (n) = the sum over ranks of this rank's block of inp (size * n), block r to rank r.
  void reduce_scatter_sum(Tensor out, Tensor inp) const;
  // out (size * n) = the concatenation of every rank's inp (n), in rank order.
  void all_gather(Tensor out, Tensor inp) const;
  void broadcast(Tensor t, int root) const;
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
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  mutable CommStats stats_;
};

// Throws mpigpt::Error with the MPI error string when rc is not MPI_SUCCESS.
void mpi_check(int rc, const char* call, const char* file, int line);
#define MPIGPT_MPI(call) ::mpigpt::mpi_check((call), #call, __FILE__, __LINE__)

}  // namespace mpigpt
