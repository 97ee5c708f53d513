// The CUDA and NCCL calls behind Comm's device paths (comm_nccl.h).
#include "parallel/comm_nccl.h"

#include <algorithm>
#include <exception>

#include "lib/core/error.h"
#include "lib/core/log.h"
#include "parallel/nccl_loader.h"

#ifdef MPIGPT_WITH_CUDA
#include <cuda_runtime.h>

#include <bit>
#include <map>
#endif

namespace mpigpt {

std::vector<std::pair<int, int>> ring_links(int size) {
  std::vector<std::pair<int, int>> links;
  for (int s = 0; s < size && size > 1; ++s)
    for (int d : {(s + 1) % size, (s + size - 1) % size}) links.emplace_back(s, d);
  std::sort(links.begin(), links.end());
  links.erase(std::unique(links.begin(), links.end()), links.end());  // two ranks: next == previous
  return links;
}

#ifdef MPIGPT_WITH_CUDA

namespace {

// The CUDA runtime calls of this file. (lib/kernels/cuda has its own macro, in a .cuh that only
// nvcc compiles; this one sees the same message shape.)
[[noreturn]] void cuda_failed(cudaError_t rc, const char* call, const char* file, int line) {
  fail("{}:{}: {} failed: {} ({})", file, line, call, cudaGetErrorString(rc), cudaGetErrorName(rc));
}
#define MPIGPT_CUDART(call)                                                                  \
  do {                                                                                       \
    const cudaError_t mpigpt_cuda_rc_ = (call);                                              \
    if (mpigpt_cuda_rc_ != cudaSuccess) cuda_failed(mpigpt_cuda_rc_, #call, __FILE__, __LINE__); \
  } while (0)

cudaStream_t compute_of(const DeviceComm& dc) { return static_cast<cudaStream_t>(dc.compute_stream); }

}  // namespace

// ---- the staged path -------------------------------------------------------------------------

class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  PinnedPool() = default;
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  ~PinnedPool() {
    for (auto& [bytes, p] : free_) cudaFreeHost(p);  // nothing to report to at exit
  }
  // The smallest free block that fits, else a new one of the next power of two (>= 64 KiB), so
  // that a run's few message sizes settle on a few blocks.
  std::shared_ptr<std::byte> get(size_t bytes) {
    size_t size = 0;
    void* p = nullptr;
    if (auto it = free_.lower_bound(bytes); it != free_.end()) {
      size = it->first;
      p = it->second;
      free_.erase(it);
    } else {
      size = std::bit_ceil(std::max<size_t>(bytes, size_t(1) << 16));
      MPIGPT_CUDART(cudaMallocHost(&p, size));
    }
    return {static_cast<std::byte*>(p),
            [pool = shared_from_this(), size](std::byte* q) { pool->free_.emplace(size, q); }};
  }

 private:
  std::multimap<size_t, void*> free_;
};

std::shared_ptr<std::byte> pinned_host(DeviceComm& dc, size_t bytes) {
  if (!dc.pinned) dc.pinned = std::make_shared<PinnedPool>();
  return dc.pinned->get(bytes);
}

void copy_to_host(const DeviceComm& dc, void* host, const Tensor& dev) {
  if (dev.nbytes() == 0) return;
  if (cudaStream_t s = compute_of(dc)) {
    MPIGPT_CUDART(cudaMemcpyAsync(host, dev.ptr, dev.nbytes(), cudaMemcpyDeviceToHost, s));
    MPIGPT_CUDART(cudaStreamSynchronize(s));
  } else {  // no compute stream known: whatever stream wrote dev has finished after this
    MPIGPT_CUDART(cudaDeviceSynchronize());
    MPIGPT_CUDART(cudaMemcpy(host, dev.ptr, dev.nbytes(), cudaMemcpyDeviceToHost));
  }
}

void copy_to_device(const DeviceComm& dc, const Tensor& dev, const void* host) {
  if (dev.nbytes() == 0) return;
  if (cudaStream_t s = compute_of(dc)) {
    MPIGPT_CUDART(cudaMemcpyAsync(dev.ptr, host, dev.nbytes(), cudaMemcpyHostToDevice, s));
    MPIGPT_CUDART(cudaStreamSynchronize(s));
  } else {
    MPIGPT_CUDART(cudaMemcpy(dev.ptr, host, dev.nbytes(), cudaMemcpyHostToDevice));
    MPIGPT_CUDART(cudaDeviceSynchronize());
  }
}

std::string device_bus_id() {
  int device = 0;
  MPIGPT_CUDART(cudaGetDevice(&device));
  char id[64] = {};
  MPIGPT_CUDART(cudaDeviceGetPCIBusId(id, int(sizeof id), device));
  return id;
}

#else  // no CUDA: no device tensor can exist, so none of these is reached by a correct caller

namespace {
[[noreturn]] void no_cuda(const char* what) {
  fail("{}: a device tensor in a build without the CUDA backend", what);
}
}  // namespace

class PinnedPool {};
std::shared_ptr<std::byte> pinned_host(DeviceComm&, size_t) { no_cuda("pinned_host"); }
void copy_to_host(const DeviceComm&, void*, const Tensor&) { no_cuda("copy_to_host"); }
void copy_to_device(const DeviceComm&, const Tensor&, const void*) { no_cuda("copy_to_device"); }
std::string device_bus_id() { return ""; }

#endif

// ---- NCCL ----------------------------------------------------------------------------------

#ifdef MPIGPT_HAVE_NCCL

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
  }
  fail("NCCL: unknown dtype {}", int(t));
}

// A finished or pending operation: the event recorded on the communication stream behind it.
class StreamWork final : public AsyncWork {
 public:
  StreamWork(cudaEvent_t done, cudaStream_t compute) : done_(done), compute_(compute) {}
  ~StreamWork() override { cudaEventDestroy(done_); }  // released once the event completes
  void wait() override { MPIGPT_CUDART(cudaStreamWaitEvent(compute_, done_, 0)); }
  bool test() override {
    const cudaError_t rc = cudaEventQuery(done_);
    if (rc == cudaErrorNotReady) return false;
    MPIGPT_CUDART(rc);
    return true;
  }

 private:
  cudaEvent_t done_;
  cudaStream_t compute_;
};

}  // namespace

class NcclComm {
 public:
  NcclComm() {
    MPIGPT_CUDART(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MPIGPT_CUDART(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() {
    if (comm_) {
      // Unwinding from an error: a clean destroy synchronises with peers that may never come
      // (DESIGN principle 7); abort frees this rank's side alone.
      const NcclApi& a = nccl();
      const ncclResult_t rc = std::uncaught_exceptions() > 0 ? a.CommAbort(comm_) : a.CommDestroy(comm_);
      if (rc != ncclSuccess) log_error("mpigpt: warning: destroying a NCCL communicator: {}", a.GetErrorString(rc));
    }
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  void join(int nranks, const ncclUniqueId& id, int rank) {
    MPIGPT_NCCL(nccl().CommInitRank(&comm_, nranks, id, rank));
  }
  // The colour's (>= 0) communicator split from parent (nccl_split).
  void split_from(const NcclComm& parent, int colour, int key);
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }

  // Orders this stream after the compute work queued so far (the inputs are written, the
  // outputs no longer read).
  void begin(cudaStream_t compute) const {
    MPIGPT_CUDART(cudaEventRecord(ready_, compute));
    MPIGPT_CUDART(cudaStreamWaitEvent(stream_, ready_, 0));
  }
  // What the compute stream waits on for the operations queued since begin().
  Request end(cudaStream_t compute) const {
    cudaEvent_t done = nullptr;
    MPIGPT_CUDART(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    auto work = std::make_shared<StreamWork>(done, compute);  // owns the event from here on
    MPIGPT_CUDART(cudaEventRecord(done, stream_));
    return Request(std::move(work));
  }

 private:
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;  // re-recorded by every begin(); the stream captures it at once
};

namespace {

// ncclCommSplit of parent: the colour's communicator, or nullptr for a negative colour.
ncclComm_t split_comm(ncclComm_t parent, int colour, int key) {
#ifdef NCCL_SPLIT_NOCOLOR
  const NcclApi& a = nccl();
  if (a.CommSplit) {
    ncclComm_t child = nullptr;
    MPIGPT_NCCL(a.CommSplit(parent, colour < 0 ? NCCL_SPLIT_NOCOLOR : colour, key, &child, nullptr));
    return child;
  }
#endif
  (void)parent, (void)colour, (void)key;
  int version = 0;
  (void)nccl().GetVersion(&version);
  fail("engine.nccl_init = split needs ncclCommSplit (NCCL 2.18 and newer), which this NCCL (version code {}) or the "
       "nccl.h this mpigpt was built with lacks; install a newer NCCL or set engine.nccl_init = init_rank", version);
}

}  // namespace

void NcclComm::split_from(const NcclComm& parent, int colour, int key) {
  comm_ = split_comm(parent.comm(), colour, key);
}

std::shared_ptr<NcclComm> nccl_split(const NcclComm& parent, int colour, int key) {
  if (colour < 0) {  // a part in the collective call, no communicator (nor a stream for one)
    split_comm(parent.comm(), colour, key);
    return nullptr;
  }
  auto c = std::make_shared<NcclComm>();
  c->split_from(parent, colour, key);
  return c;
}

std::shared_ptr<NcclComm> nccl_comm(MPI_Comm group, int rank, int size) {
  ncclUniqueId id{};
  if (rank == 0) MPIGPT_NCCL(nccl().GetUniqueId(&id));
  MPIGPT_MPI(MPI_Bcast(&id, int(sizeof id), MPI_BYTE, 0, group));
  auto c = std::make_shared<NcclComm>();
  c->join(size, id, rank);
  return c;
}

void nccl_links(DeviceComm& dc, MPI_Comm group, int rank, int size, bool split) {
  constexpr int kTag = 0x4e43;  // the id's message: no user message is in flight during set-up
  dc.to.clear();
  dc.from.clear();
  MPIGPT_CHECK(!split || dc.group, "nccl_links: splitting links needs the group's NCCL communicator");
  for (const auto& [sender, receiver] : ring_links(size)) {
    const bool member = sender == rank || receiver == rank, sends = sender == rank;
    if (split) {  // the sender is the link's rank 0
      std::shared_ptr<NcclComm> link = nccl_split(*dc.group, member ? 0 : -1, sends ? 0 : 1);
      if (member) (sends ? dc.to : dc.from).emplace_back(sends ? receiver : sender, std::move(link));
      continue;
    }
    if (!member) continue;
    ncclUniqueId id{};
    if (sends) {
      MPIGPT_NCCL(nccl().GetUniqueId(&id));
      MPIGPT_MPI(MPI_Send(&id, int(sizeof id), MPI_BYTE, receiver, kTag, group));
    } else {
      MPIGPT_MPI(MPI_Recv(&id, int(sizeof id), MPI_BYTE, sender, kTag, group, MPI_STATUS_IGNORE));
    }
    auto link = std::make_shared<NcclComm>();
    link->join(2, id, sends ? 0 : 1);  // the sender is the link's rank 0
    (sends ? dc.to : dc.from).emplace_back(sends ? receiver : sender, std::move(link));
  }
}

namespace {

const NcclComm& group_of(const DeviceComm& dc) {
  MPIGPT_CHECK(dc.group, "NCCL operation on a Comm without a NCCL communicator");
  return *dc.group;
}

const NcclComm& link_of(const std::vector<std::pair<int, std::shared_ptr<NcclComm>>>& links, int peer,
                        const char* op) {
  for (const auto& [p, link] : links)
    if (p == peer) return *link;
  std::string have;
  for (const auto& [p, link] : links) have += fmt::format(" {}", p);
  fail("{} with rank {}: NCCL point-to-point runs over links to the ring neighbours of groups made with p2p links "
       "(this rank has them to:{}); send between neighbours, or use engine.comm = mpi",
       op, peer, have.empty() ? std::string(" none") : have);
}

}  // namespace

Request nccl_allreduce(const DeviceComm& dc, Tensor t, ReduceOp op) {
  const NcclComm& c = group_of(dc);
  c.begin(compute_of(dc));
  const ncclRedOp_t nop = op == ReduceOp::Sum ? ncclSum : ncclMax;
  MPIGPT_NCCL(nccl().AllReduce(t.ptr, t.ptr, size_t(t.numel()), nccl_type(t.dtype), nop, c.comm(), c.stream()));
  return c.end(compute_of(dc));
}

Request nccl_reduce_scatter(const DeviceComm& dc, Tensor out, Tensor inp) {
  const NcclComm& c = group_of(dc);
  c.begin(compute_of(dc));
  MPIGPT_NCCL(nccl().ReduceScatter(inp.ptr, out.ptr, size_t(out.numel()), nccl_type(out.dtype), ncclSum, c.comm(),
                                   c.stream()));
  return c.end(compute_of(dc));
}

Request nccl_all_gather(const DeviceComm& dc, Tensor out, Tensor inp) {
  const NcclComm& c = group_of(dc);
  c.begin(compute_of(dc));
  MPIGPT_NCCL(nccl().AllGather(inp.ptr, out.ptr, size_t(inp.numel()), nccl_type(inp.dtype), c.comm(), c.stream()));
  return c.end(compute_of(dc));
}

Request nccl_broadcast(const DeviceComm& dc, Tensor t, int root) {
  const NcclComm& c = group_of(dc);
  c.begin(compute_of(dc));
  MPIGPT_NCCL(nccl().Broadcast(t.ptr, t.ptr, size_t(t.numel()), nccl_type(t.dtype), root, c.comm(), c.stream()));
  return c.end(compute_of(dc));
}

Request nccl_send(const DeviceComm& dc, Tensor t, int peer) {
  const NcclComm& l = link_of(dc.to, peer, "send");
  l.begin(compute_of(dc));
  MPIGPT_NCCL(nccl().Send(t.ptr, size_t(t.numel()), nccl_type(t.dtype), 1, l.comm(), l.stream()));
  return l.end(compute_of(dc));
}

Request nccl_recv(const DeviceComm& dc, Tensor t, int peer) {
  const NcclComm& l = link_of(dc.from, peer, "recv");
  l.begin(compute_of(dc));
  MPIGPT_NCCL(nccl().Recv(t.ptr, size_t(t.numel()), nccl_type(t.dtype), 0, l.comm(), l.stream()));
  return l.end(compute_of(dc));
}

Request nccl_all_to_all_v(const DeviceComm& dc, Tensor out, const std::vector<int64_t>& recv_counts, Tensor inp,
                          const std::vector<int64_t>& send_counts) {
  const NcclComm& c = group_of(dc);
  const ncclDataType_t type = nccl_type(inp.dtype);
  const size_t elem = dtype_size(inp.dtype);
  c.begin(compute_of(dc));
  // One group: every pair's send and receive run together, so no order of peers can deadlock.
  MPIGPT_NCCL(nccl().GroupStart());
  int64_t so = 0, ro = 0;
  for (int r = 0; r < int(send_counts.size()); ++r) {
    if (send_counts[r] > 0)
      MPIGPT_NCCL(nccl().Send(static_cast<char*>(inp.ptr) + so * elem, size_t(send_counts[r]), type, r, c.comm(),
                              c.stream()));
    if (recv_counts[r] > 0)
      MPIGPT_NCCL(nccl().Recv(static_cast<char*>(out.ptr) + ro * elem, size_t(recv_counts[r]), type, r, c.comm(),
                              c.stream()));
    so += send_counts[r];
    ro += recv_counts[r];
  }
  MPIGPT_NCCL(nccl().GroupEnd());
  return c.end(compute_of(dc));
}

#else  // no NCCL in this build: use_nccl() fails before any of these could be reached

class NcclComm {};

namespace {
[[noreturn]] void no_nccl() { throw Error(nccl_load_error()); }
}  // namespace

std::shared_ptr<NcclComm> nccl_comm(MPI_Comm, int, int) { no_nccl(); }
std::shared_ptr<NcclComm> nccl_split(const NcclComm&, int, int) { no_nccl(); }
void nccl_links(DeviceComm&, MPI_Comm, int, int, bool) { no_nccl(); }
Request nccl_allreduce(const DeviceComm&, Tensor, ReduceOp) { no_nccl(); }
Request nccl_reduce_scatter(const DeviceComm&, Tensor, Tensor) { no_nccl(); }
Request nccl_all_gather(const DeviceComm&, Tensor, Tensor) { no_nccl(); }
Request nccl_broadcast(const DeviceComm&, Tensor, int) { no_nccl(); }
Request nccl_send(const DeviceComm&, Tensor, int) { no_nccl(); }
Request nccl_recv(const DeviceComm&, Tensor, int) { no_nccl(); }
Request nccl_all_to_all_v(const DeviceComm&, Tensor, const std::vector<int64_t>&, Tensor, const std::vector<int64_t>&) {
  no_nccl();
}

#endif

}  // namespace mpigpt
