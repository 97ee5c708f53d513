// Comm: requests, the set-up of a group's device paths, and the routing of every call to MPI
// (comm_mpi.cpp), to NCCL (comm_nccl.cpp) or to the staged path between them.
#include "parallel/comm.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "lib/core/error.h"
#include "lib/core/log.h"
#include "lib/core/watchdog.h"
#include "parallel/comm_mpi.h"
#include "parallel/comm_nccl.h"
#include "parallel/nccl_loader.h"

namespace mpigpt {

void mpi_check(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail("{}:{}: {} failed: {}", file, line, call, std::string(msg, len));
}

std::string GroupLabel::str() const {
  constexpr size_t kShown = 16;
  std::string members;
  for (size_t i = 0; i < world_ranks.size() && i < kShown; ++i)
    members += fmt::format("{}{}", i ? ", " : "", world_ranks[i]);
  if (world_ranks.size() > kShown) members += fmt::format(", ... ({} more)", world_ranks.size() - kShown);
  return fmt::format("group {} (rank {} of {}; world ranks {})", name.empty() ? "(unnamed)" : name, rank, size,
                     members);
}

std::string CallInfo::str() const {
  std::string s = type ? fmt::format("{} of {} {}", op, count, type) : op;
  if (peer >= 0) {
    const bool known = group && size_t(peer) < group->world_ranks.size();
    const bool receive = std::string_view(op).find("receive") != std::string_view::npos;
    s += fmt::format(" {} group rank {}{}", receive ? "from" : "to", peer,
                     known ? fmt::format(" (world rank {})", group->world_ranks[size_t(peer)]) : "");
  }
  if (group) s += " over " + group->str();
  return s;
}

namespace {

// Marks a blocking call as a wait for the watchdog (lib/core/watchdog.h): a peer that never
// joins it ends the job with this description instead of hanging it.
auto watch(CallInfo call) {
  return Waiting([c = std::move(call)] { return c.str(); });
}

}  // namespace

// ---- Request ---------------------------------------------------------------------------------

Request& Request::operator=(Request&& o) noexcept {
  if (this != &o) {
    finish();
    reqs_ = std::exchange(o.reqs_, {});
    then_ = std::exchange(o.then_, nullptr);
    work_ = std::move(o.work_);
    call_ = std::move(o.call_);
  }
  return *this;
}

// Waiting without throwing: it runs in the destructor. A failure is reported and dropped; the
// next checked call meets it again (a CUDA error is sticky, a broken peer fails the next call).
void Request::finish() noexcept {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // Unwinding from an error: the job is about to abort, and waiting for a peer that may never
  // post its side would hang instead (DESIGN principle 7). Leave the requests.
  if (std::uncaught_exceptions() > 0) {
    reqs_.clear();
    then_ = nullptr;
    work_.reset();
    return;
  }
  if (!reqs_.empty()) {
    const auto w = watch(call_);
    MPI_Waitall(int(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE);
  }
  reqs_.clear();
  try {
    if (work_) std::exchange(work_, nullptr)->wait();
    if (then_) std::exchange(then_, nullptr)();
  } catch (const std::exception& e) {
    log_error("mpigpt: warning: completing an abandoned request: {}", e.what());
  }
}

Request::~Request() { finish(); }

void Request::wait() {
  if (!reqs_.empty()) {
    const auto w = watch(call_);
    MPIGPT_MPI(MPI_Waitall(int(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE));
  }
  reqs_.clear();
  if (work_) std::exchange(work_, nullptr)->wait();
  if (then_) std::exchange(then_, nullptr)();
}

bool Request::test() {
  if (!reqs_.empty()) {
    int flag = 0;
    MPIGPT_MPI(MPI_Testall(int(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE));
    if (!flag) return false;
    reqs_.clear();
  }
  if (work_) {
    if (!work_->test()) return false;
    work_.reset();  // finished: later compute work is queued after it anyway
  }
  if (then_) std::exchange(then_, nullptr)();
  return true;
}

// ---- Comm: set-up ----------------------------------------------------------------------------

Comm::Comm(MPI_Comm comm) : comm_(comm), device_(std::make_shared<DeviceComm>()) {
  auto label = std::make_shared<GroupLabel>();
  label_ = label;
  if (comm == MPI_COMM_NULL) {  // not a member of any group of this kind
    size_ = 0;
    return;
  }
  MPIGPT_MPI(MPI_Comm_rank(comm, &rank_));
  MPIGPT_MPI(MPI_Comm_size(comm, &size_));
  char name[MPI_MAX_OBJECT_NAME] = {};
  int len = 0;
  MPIGPT_MPI(MPI_Comm_get_name(comm, name, &len));
  label->name.assign(name, size_t(len));
  label->rank = rank_;
  label->size = size_;
  MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPIGPT_MPI(MPI_Comm_group(comm, &mine));
  MPIGPT_MPI(MPI_Comm_group(MPI_COMM_WORLD, &world));
  std::vector<int> ranks(size_t(size_), 0);
  for (int r = 0; r < size_; ++r) ranks[size_t(r)] = r;
  label->world_ranks.resize(size_t(size_));
  MPIGPT_MPI(MPI_Group_translate_ranks(mine, size_, ranks.data(), world, label->world_ranks.data()));
  MPIGPT_MPI(MPI_Group_free(&mine));
  MPIGPT_MPI(MPI_Group_free(&world));
}

DeviceComm& Comm::device() const { return *device_; }

bool Comm::uses_nccl() const { return device_->group != nullptr; }

void Comm::use_staging(void* compute_stream) {
  DeviceComm& d = device();
  d.compute_stream = compute_stream;
  d.group.reset();
  d.to.clear();
  d.from.clear();
}

namespace {

// One failing rank fails every rank of the group, before any of them waits in a bootstrap that
// the failing one would never join. `mine` is this rank's error ("" if none).
void fail_together(MPI_Comm comm, const std::string& mine, const std::string& theirs) {
  int bad = mine.empty() ? 0 : 1, any = 0;
  MPIGPT_MPI(MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, comm));
  if (!any) return;
  throw Error(bad ? mine : theirs);
}

// NCCL refuses two ranks of one communicator on one GPU; say why and what to do instead.
// `bus` is this rank's GPU (device_bus_id()).
std::string shared_gpu_error(MPI_Comm comm, int size, const std::string& bus) {
  constexpr int kLen = 256;
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPIGPT_MPI(MPI_Get_processor_name(name, &len));
  std::string mine = fmt::format("{} {}", bus, std::string(name, size_t(len)));
  mine.resize(kLen - 1);
  std::vector<char> all(size_t(size) * kLen);
  MPIGPT_MPI(MPI_Allgather(mine.c_str(), kLen, MPI_CHAR, all.data(), kLen, MPI_CHAR, comm));
  for (int a = 0; a < size; ++a)
    for (int b = a + 1; b < size; ++b)
      if (std::strcmp(&all[size_t(a) * kLen], &all[size_t(b) * kLen]) == 0)
        return fmt::format("engine.comm = nccl: ranks {} and {} of a group share the GPU (bus id and host) '{}'; "
                           "NCCL needs one GPU per rank. Launch at most one rank per GPU, or set engine.comm = mpi "
                           "(with engine.allow_device_sharing = true) to move device memory through the host",
                           a, b, &all[size_t(a) * kLen]);
  return "";
}

}  // namespace

void Comm::use_nccl(void* compute_stream, bool p2p_links) {
  if (size_ == 0) return;  // not a member
  const auto w = watch(call("the set-up of NCCL (error agreement, unique id, ncclCommInitRank, links)", 0, nullptr));
  DeviceComm& d = device();
  d.compute_stream = compute_stream;
  if (!d.group) {
    // Every rank learns of any rank's failure first: each step below is a bootstrap the others
    // would wait in.
    std::string why = nccl_load_error(), bus;
    if (why.empty()) {
      try {
        bus = device_bus_id();
      } catch (const Error& e) {
        why = e.what();
      }
    }
    fail_together(comm_, why,
                  "engine.comm = nccl: another rank of this group cannot use NCCL (its message says why); fix "
                  "that rank's NCCL or GPU, or set engine.comm = mpi");
    const std::string shared = shared_gpu_error(comm_, size_, bus);
    if (!shared.empty()) throw Error(shared);  // every rank found the same pair
    // One communicator per group, each with its own ncclCommInitRank (engine.nccl_init =
    // init_rank; use_nccl_split below splits them from the world's instead).
    d.group = nccl_comm(comm_, rank_, size_);
  }
  if (p2p_links && d.to.empty() && d.from.empty()) nccl_links(d, comm_, rank_, size_, false);
}

void Comm::use_nccl_split(void* compute_stream, bool p2p_links, const Comm& parent) {
  if (parent.size_ == 0) return;  // not in the call at all
  MPIGPT_CHECK(parent.device_->group, "use_nccl_split: the parent group {} has no NCCL communicator yet (use_nccl)",
               parent.label().str());
  DeviceComm& d = device();
  d.compute_stream = compute_stream;
  const std::string op = size_ > 0 ? "ncclCommSplit of NCCL's communicator into the groups " + label().name
                                   : std::string("ncclCommSplit of NCCL's communicator into groups without this rank");
  {
    const auto w = watch(parent.call(op.c_str(), 0, nullptr));
    // Each group's colour is the world rank of its first member (unique: groups of one kind are
    // disjoint); ranked as in the group. Every parent member takes part, once: a second call only
    // rebinds the stream, on every rank alike.
    if (!d.split_done) {
      int colour = -1;
      if (size_ > 0) {
        colour = label().world_ranks[0];
        const std::vector<int>& in_parent = parent.label().world_ranks;
        MPIGPT_CHECK(std::find(in_parent.begin(), in_parent.end(), colour) != in_parent.end(),
                     "use_nccl_split: group {} is not within the parent group {}", label().str(),
                     parent.label().str());
      }
      d.group = nccl_split(*parent.device_->group, colour, rank_);
      d.split_done = true;
    }
  }
  if (size_ > 0 && p2p_links && d.to.empty() && d.from.empty()) {
    const auto w = watch(call("ncclCommSplit of the group's NCCL communicator into its point-to-point links", 0,
                              nullptr));
    nccl_links(d, comm_, rank_, size_, true);
  }
}

// Host tensors take MPI; device tensors NCCL once use_nccl() ran, else the staged path. All
// tensors of a call live on one device.
Comm::Path Comm::path(const char* op, std::initializer_list<Tensor> tensors) const {
  const Device where = tensors.begin()->device;
  for (const Tensor& t : tensors)
    MPIGPT_CHECK(t.device == where,
                 "{}: the tensors of one call must live on one device, got {} on the {} and {} on the {}", op,
                 tensors.begin()->str(), where == Device::CPU ? "host" : "device", t.str(),
                 t.device == Device::CPU ? "host" : "device");
  if (where == Device::CPU) return Path::Host;
  return device_->group ? Path::Nccl : Path::Staged;
}

namespace {

// MPI has no bf16 sum; the device paths reduce bf16 (NCCL natively, the staged path in f32).
void check_reducible(const Tensor& t, const char* op) {
  MPIGPT_CHECK(t.device != Device::CPU || t.dtype != DType::BF16, "{}: MPI cannot reduce bf16 ({})", op, t.str());
}

}  // namespace

// ---- Comm: the calls -------------------------------------------------------------------------

void Comm::allreduce_sum(Tensor t) const { iallreduce_sum(t).wait(); }

void Comm::allreduce_max(Tensor t) const {
  check_reducible(t, "allreduce_max");
  if (size_ <= 1) return;
  stats_.allreduce += int64_t(t.nbytes());
  ++stats_.calls;
  const auto w = watch(call("all-reduce (max)", t.numel(), t.dtype));
  switch (path("allreduce_max", {t})) {
    case Path::Host: return mpi_allreduce(comm_, t, MPI_MAX);
    case Path::Nccl: return nccl_allreduce(device(), t, ReduceOp::Max).wait();
    case Path::Staged: {
      HostImage h(device(), t, true, true);
      mpi_allreduce(comm_, h.host(), MPI_MAX);
      return h.store(device(), t);
    }
  }
}

void Comm::allreduce_sum(double* x, int n) const {
  if (size_ <= 1) return;
  stats_.allreduce += int64_t(n) * 8;
  ++stats_.calls;
  const auto w = watch(call("all-reduce (sum)", n, "f64"));
  MPIGPT_MPI(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_DOUBLE, MPI_SUM, comm_));
}

void Comm::allreduce_sum(int64_t* x, int n) const {
  if (size_ <= 1) return;
  stats_.allreduce += int64_t(n) * 8;
  ++stats_.calls;
  const auto w = watch(call("all-reduce (sum)", n, "i64"));
  MPIGPT_MPI(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_INT64_T, MPI_SUM, comm_));
}

Request Comm::iallreduce_sum(Tensor t) const {
  check_reducible(t, "allreduce_sum");
  if (size_ <= 1) return Request();
  stats_.allreduce += int64_t(t.nbytes());
  ++stats_.calls;
  CallInfo c = call("all-reduce (sum)", t.numel(), t.dtype);
  switch (path("allreduce_sum", {t})) {
    case Path::Host: return mpi_iallreduce(comm_, t, MPI_SUM).about(std::move(c));
    case Path::Nccl: return nccl_allreduce(device(), t, ReduceOp::Sum).about(std::move(c));
    case Path::Staged: break;
  }
  const auto w = watch(std::move(c));
  HostImage h(device(), t, true, true);
  mpi_allreduce(comm_, h.host(), MPI_SUM);
  h.store(device(), t);
  return Request();
}

void Comm::reduce_scatter_sum(Tensor out, Tensor inp) const { ireduce_scatter_sum(out, inp).wait(); }

Request Comm::ireduce_scatter_sum(Tensor out, Tensor inp) const {
  check_reducible(inp, "reduce_scatter_sum");
  const Path p = path("reduce_scatter_sum", {out, inp});
  MPIGPT_CHECK(inp.numel() == out.numel() * size_ && inp.dtype == out.dtype,
               "reduce_scatter_sum: inp {} must hold {} blocks of out {}", inp.str(), size_, out.str());
  stats_.reduce_scatter += int64_t(inp.nbytes());
  ++stats_.calls;
  CallInfo c = call("reduce-scatter (sum)", inp.numel(), inp.dtype);
  switch (p) {
    case Path::Host: return mpi_ireduce_scatter(comm_, out, inp).about(std::move(c));
    case Path::Nccl: return nccl_reduce_scatter(device(), out, inp).about(std::move(c));
    case Path::Staged: break;
  }
  const auto w = watch(std::move(c));
  HostImage hi(device(), inp, true, true), ho(device(), out, false, true);
  mpi_ireduce_scatter(comm_, ho.host(), hi.host()).wait();
  ho.store(device(), out);
  return Request();
}

void Comm::all_gather(Tensor out, Tensor inp) const { iall_gather(out, inp).wait(); }

Request Comm::iall_gather(Tensor out, Tensor inp) const {
  const Path p = path("all_gather", {out, inp});
  MPIGPT_CHECK(out.numel() == inp.numel() * size_ && inp.dtype == out.dtype,
               "all_gather: out {} must hold {} blocks of inp {}", out.str(), size_, inp.str());
  stats_.all_gather += int64_t(inp.nbytes());
  ++stats_.calls;
  CallInfo c = call("all-gather", inp.numel(), inp.dtype);
  switch (p) {
    case Path::Host: return mpi_iall_gather(comm_, out, inp).about(std::move(c));
    case Path::Nccl: return nccl_all_gather(device(), out, inp).about(std::move(c));
    case Path::Staged: break;
  }
  const auto w = watch(std::move(c));
  HostImage hi(device(), inp, true, false), ho(device(), out, false, false);
  mpi_iall_gather(comm_, ho.host(), hi.host()).wait();
  ho.store(device(), out);
  return Request();
}

void Comm::reduce_scatter_sum_inplace(Tensor buf) const { ireduce_scatter_sum_inplace(buf).wait(); }

Request Comm::ireduce_scatter_sum_inplace(Tensor buf) const {
  check_reducible(buf, "reduce_scatter_sum_inplace");
  MPIGPT_CHECK(size_ > 0 && buf.numel() % size_ == 0, "reduce_scatter_sum_inplace: {} is not {} equal blocks",
               buf.str(), size_);
  if (size_ <= 1) return Request();
  stats_.reduce_scatter += int64_t(buf.nbytes());
  ++stats_.calls;
  const int64_t n = buf.numel() / size_;
  CallInfo c = call("reduce-scatter (sum, in place)", buf.numel(), buf.dtype);
  switch (path("reduce_scatter_sum_inplace", {buf})) {
    case Path::Host: return mpi_ireduce_scatter_inplace(comm_, rank_, size_, buf).about(std::move(c));
    // NCCL's in-place convention is ours: the result lands in block rank() directly.
    case Path::Nccl: return nccl_reduce_scatter(device(), buf.flat_slice(n * rank_, n), buf).about(std::move(c));
    case Path::Staged: break;
  }
  const auto w = watch(std::move(c));
  // The host image takes MPI's detour through block 0 (the `then` above) before it goes back.
  HostImage h(device(), buf, true, true);
  mpi_ireduce_scatter_inplace(comm_, rank_, size_, h.host()).wait();
  h.store(device(), buf);
  return Request();
}

void Comm::all_gather_inplace(Tensor buf) const { iall_gather_inplace(buf).wait(); }

Request Comm::iall_gather_inplace(Tensor buf) const {
  MPIGPT_CHECK(size_ > 0 && buf.numel() % size_ == 0, "all_gather_inplace: {} is not {} equal blocks", buf.str(),
               size_);
  if (size_ <= 1) return Request();
  const int64_t n = buf.numel() / size_;
  stats_.all_gather += n * int64_t(dtype_size(buf.dtype));
  ++stats_.calls;
  CallInfo c = call("all-gather (in place)", n, buf.dtype);
  switch (path("all_gather_inplace", {buf})) {
    case Path::Host: return mpi_iall_gather_inplace(comm_, size_, buf).about(std::move(c));
    case Path::Nccl: return nccl_all_gather(device(), buf, buf.flat_slice(n * rank_, n)).about(std::move(c));
    case Path::Staged: break;
  }
  const auto w = watch(std::move(c));
  HostImage h(device(), buf, true, false);
  mpi_iall_gather_inplace(comm_, size_, h.host()).wait();
  h.store(device(), buf);
  return Request();
}

void Comm::broadcast(Tensor t, int root) const {
  const Path p = path("broadcast", {t});
  if (size_ <= 1) return;
  stats_.broadcast += int64_t(t.nbytes());
  ++stats_.calls;
  const auto w = watch(call(rank_ == root ? "broadcast (as its root)" : "broadcast", t.numel(), t.dtype));
  switch (p) {
    case Path::Host: return mpi_broadcast(comm_, t, root);
    case Path::Nccl: return nccl_broadcast(device(), t, root).wait();
    case Path::Staged: {
      HostImage h(device(), t, rank_ == root, false);
      mpi_broadcast(comm_, h.host(), root);
      return h.store(device(), t);
    }
  }
}

void Comm::send(Tensor t, int peer, int tag) const { isend(t, peer, tag).wait(); }
void Comm::recv(Tensor t, int peer, int tag) const { irecv(t, peer, tag).wait(); }

Request Comm::isend(Tensor t, int peer, int tag) const {
  const Path p = path("send", {t});
  stats_.send += int64_t(t.nbytes());
  ++stats_.calls;
  CallInfo c = call("send", t.numel(), t.dtype, peer);
  switch (p) {
    case Path::Host: return mpi_isend(comm_, t, peer, tag).about(std::move(c));
    case Path::Nccl: return nccl_send(device(), t, peer).about(std::move(c));
    case Path::Staged: break;
  }
  // The image is copied now and lives until the send completes (the `then` holds it).
  auto h = std::make_shared<HostImage>(device(), t, true, false);
  return mpi_isend(comm_, h->host(), peer, tag, [h] {}).about(std::move(c));
}

Request Comm::irecv(Tensor t, int peer, int tag) const {
  const Path p = path("recv", {t});
  stats_.recv += int64_t(t.nbytes());
  ++stats_.calls;
  CallInfo c = call("receive", t.numel(), t.dtype, peer);
  switch (p) {
    case Path::Host: return mpi_irecv(comm_, t, peer, tag).about(std::move(c));
    case Path::Nccl: return nccl_recv(device(), t, peer).about(std::move(c));
    case Path::Staged: break;
  }
  auto h = std::make_shared<HostImage>(device(), t, false, false);
  return mpi_irecv(comm_, h->host(), peer, tag, [h, d = device_, t] { h->store(*d, t); }).about(std::move(c));
}

void Comm::all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, Tensor inp,
                        const std::vector<int64_t>& send_counts) const {
  const Path p = path("all_to_all_v", {out, inp});
  MPIGPT_CHECK(int(recv_counts.size()) == size_ && int(send_counts.size()) == size_,
               "all_to_all_v: {} ranks but {} receive and {} send counts", size_, recv_counts.size(),
               send_counts.size());
  MPIGPT_CHECK(inp.dtype == out.dtype, "all_to_all_v: inp {} and out {} differ in dtype", inp.str(), out.str());
  int64_t so = 0, ro = 0;
  for (int r = 0; r < size_; ++r) {
    MPIGPT_CHECK(send_counts[r] >= 0 && recv_counts[r] >= 0, "all_to_all_v: negative count for rank {}", r);
    so += send_counts[r];
    ro += recv_counts[r];
  }
  MPIGPT_CHECK(so <= inp.numel() && ro <= out.numel(), "all_to_all_v: sends {} of {} elements, receives {} into {}",
               so, inp.numel(), ro, out.numel());
  stats_.all_to_all += so * int64_t(dtype_size(inp.dtype));
  ++stats_.calls;
  const auto w = watch(call("all-to-all", so, inp.dtype));
  switch (p) {
    case Path::Host: return mpi_all_to_all_v(comm_, out, recv_counts, inp, send_counts);
    case Path::Nccl: return nccl_all_to_all_v(device(), out, recv_counts, inp, send_counts).wait();
    case Path::Staged: {
      HostImage hi(device(), inp.flat_slice(0, so), true, false), ho(device(), out.flat_slice(0, ro), false, false);
      mpi_all_to_all_v(comm_, ho.host(), recv_counts, hi.host(), send_counts);
      return ho.store(device(), out.flat_slice(0, ro));  // only what arrived: the rest stays as it was
    }
  }
}

void Comm::barrier() const {
  const auto w = watch(call("barrier", 0, nullptr));
  MPIGPT_MPI(MPI_Barrier(comm_));
}

}  // namespace mpigpt
