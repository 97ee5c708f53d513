// The MPI backend of Comm.
#include "parallel/comm.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <utility>

#include "lib/core/error.h"

namespace mpigpt {

void mpi_check(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail("{}:{}: {} failed: {}", file, line, call, std::string(msg, len));
}

namespace {

MPI_Datatype mpi_type(const Tensor& t) {
  switch (t.dtype) {
    case DType::F32: return MPI_FLOAT;
    case DType::I32: return MPI_INT32_T;
    case DType::BF16: return MPI_UINT16_T;  // moved, never reduced
  }
  return MPI_BYTE;
}

void check_host(const Tensor& t, const char* op) {
  MPIGPT_CHECK(t.device == Device::CPU, "{}: the MPI backend moves host memory, got a {} tensor on the device", op,
               t.str());
}

void check_reducible(const Tensor& t, const char* op) {
  check_host(t, op);
  MPIGPT_CHECK(t.dtype != DType::BF16, "{}: MPI cannot reduce bf16 ({})", op, t.str());
}

int as_count(int64_t n, const char* op) {
  MPIGPT_CHECK(n <= INT_MAX, "{}: {} elements per rank exceed MPI's int count; split the buffer", op, n);
  return int(n);
}

// MPI counts are int: large reductions go in pieces of at most 2^30 elements.
template <class F>
void in_pieces(int64_t n, F&& f) {
  for (int64_t off = 0; off < n;) {
    const int count = int(std::min<int64_t>(n - off, int64_t(1) << 30));
    f(off, count);
    off += count;
  }
}

char* at(const Tensor& t, int64_t elements) { return static_cast<char*>(t.ptr) + elements * dtype_size(t.dtype); }

}  // namespace

Request& Request::operator=(Request&& o) noexcept {
  if (this != &o) {
    finish();
    reqs_ = std::move(o.reqs_);
    then_ = std::move(o.then_);
    o.reqs_.clear();
    o.then_ = nullptr;
  }
  return *this;
}

// Waiting without a check: it runs in the destructor, where throwing is no option.
void Request::finish() noexcept {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // Unwinding from an error: the job is about to abort, and waiting for a peer that may never
  // post its side would hang instead (DESIGN principle 7). Leave the requests.
  if (std::uncaught_exceptions() > 0) {
    reqs_.clear();
    then_ = nullptr;
    return;
  }
  if (!reqs_.empty()) MPI_Waitall(int(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE);
  reqs_.clear();
  if (then_) std::exchange(then_, nullptr)();
}

Request::~Request() { finish(); }

void Request::wait() {
  if (!reqs_.empty()) MPIGPT_MPI(MPI_Waitall(int(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE));
  reqs_.clear();
  if (then_) std::exchange(then_, nullptr)();
}

bool Request::test() {
  if (!reqs_.empty()) {
    int flag = 0;
    MPIGPT_MPI(MPI_Testall(int(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE));
    if (!flag) return false;
    reqs_.clear();
  }
  if (then_) std::exchange(then_, nullptr)();
  return true;
}

Comm::Comm(MPI_Comm comm) : comm_(comm) {
  if (comm == MPI_COMM_NULL) {  // not a member of any group of this kind
    size_ = 0;
    return;
  }
  MPIGPT_MPI(MPI_Comm_rank(comm, &rank_));
  MPIGPT_MPI(MPI_Comm_size(comm, &size_));
}

void Comm::allreduce_sum(Tensor t) const { iallreduce_sum(t).wait(); }

void Comm::allreduce_max(Tensor t) const {
  check_reducible(t, "allreduce_max");
  if (size_ <= 1) return;
  stats_.allreduce += int64_t(t.nbytes());
  ++stats_.calls;
  in_pieces(t.numel(), [&](int64_t off, int count) {
    MPIGPT_MPI(MPI_Allreduce(MPI_IN_PLACE, at(t, off), count, mpi_type(t), MPI_MAX, comm_));
  });
}

void Comm::allreduce_sum(double* x, int n) const {
  if (size_ <= 1) return;
  stats_.allreduce += int64_t(n) * 8;
  ++stats_.calls;
  MPIGPT_MPI(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_DOUBLE, MPI_SUM, comm_));
}

void Comm::allreduce_sum(int64_t* x, int n) const {
  if (size_ <= 1) return;
  stats_.allreduce += int64_t(n) * 8;
  ++stats_.calls;
  MPIGPT_MPI(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_INT64_T, MPI_SUM, comm_));
}

Request Comm::iallreduce_sum(Tensor t) const {
  check_reducible(t, "allreduce_sum");
  if (size_ <= 1) return Request();
  stats_.allreduce += int64_t(t.nbytes());
  ++stats_.calls;
  std::vector<MPI_Request> reqs;
  in_pieces(t.numel(), [&](int64_t off, int count) {
    reqs.emplace_back();
    MPIGPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, at(t, off), count, mpi_type(t), MPI_SUM, comm_, &reqs.back()));
  });
  return Request(std::move(reqs));
}

void Comm::reduce_scatter_sum(Tensor out, Tensor inp) const { ireduce_scatter_sum(out, inp).wait(); }

Request Comm::ireduce_scatter_sum(Tensor out, Tensor inp) const {
  check_reducible(inp, "reduce_scatter_sum");
  check_host(out, "reduce_scatter_sum");
  MPIGPT_CHECK(inp.numel() == out.numel() * size_ && inp.dtype == out.dtype,
               "reduce_scatter_sum: inp {} must hold {} blocks of out {}", inp.str(), size_, out.str());
  stats_.reduce_scatter += int64_t(inp.nbytes());
  ++stats_.calls;
  std::vector<MPI_Request> reqs(1);
  MPIGPT_MPI(MPI_Ireduce_scatter_block(inp.ptr, out.ptr, as_count(out.numel(), "reduce_scatter_sum"), mpi_type(inp),
                                       MPI_SUM, comm_, &reqs[0]));
  return Request(std::move(reqs));
}

void Comm::all_gather(Tensor out, Tensor inp) const { iall_gather(out, inp).wait(); }

Request Comm::iall_gather(Tensor out, Tensor inp) const {
  check_host(inp, "all_gather");
  check_host(out, "all_gather");
  MPIGPT_CHECK(out.numel() == inp.numel() * size_ && inp.dtype == out.dtype,
               "all_gather: out {} must hold {} blocks of inp {}", out.str(), size_, inp.str());
  stats_.all_gather += int64_t(inp.nbytes());
  ++stats_.calls;
  std::vector<MPI_Request> reqs(1);
  const int n = as_count(inp.numel(), "all_gather");
  MPIGPT_MPI(MPI_Iallgather(inp.ptr, n, mpi_type(inp), out.ptr, n, mpi_type(out), comm_, &reqs[0]));
  return Request(std::move(reqs));
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
  std::vector<MPI_Request> reqs(1);
  MPIGPT_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, buf.ptr, as_count(n, "reduce_scatter_sum_inplace"),
                                       mpi_type(buf), MPI_SUM, comm_, &reqs[0]));
  // MPI's in-place variant leaves the result in block 0, not block rank(): move it once done.
  std::function<void()> then;
  if (rank_ != 0)
    then = [dst = at(buf, n * rank_), src = at(buf, 0), bytes = size_t(n) * dtype_size(buf.dtype)] {
      std::memcpy(dst, src, bytes);
    };
  return Request(std::move(reqs), std::move(then));
}

void Comm::all_gather_inplace(Tensor buf) const { iall_gather_inplace(buf).wait(); }

Request Comm::iall_gather_inplace(Tensor buf) const {
  check_host(buf, "all_gather_inplace");
  MPIGPT_CHECK(size_ > 0 && buf.numel() % size_ == 0, "all_gather_inplace: {} is not {} equal blocks", buf.str(),
               size_);
  if (size_ <= 1) return Request();
  const int64_t n = buf.numel() / size_;
  stats_.all_gather += n * int64_t(dtype_size(buf.dtype));
  ++stats_.calls;
  std::vector<MPI_Request> reqs(1);
  const int count = as_count(n, "all_gather_inplace");
  MPIGPT_MPI(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf.ptr, count, mpi_type(buf), comm_, &reqs[0]));
  return Request(std::move(reqs));
}

void Comm::broadcast(Tensor t, int root) const {
  check_host(t, "broadcast");
  if (size_ <= 1) return;
  stats_.broadcast += int64_t(t.nbytes());
  ++stats_.calls;
  in_pieces(t.numel(), [&](int64_t off, int count) {
    MPIGPT_MPI(MPI_Bcast(at(t, off), count, mpi_type(t), root, comm_));
  });
}

void Comm::send(Tensor t, int peer, int tag) const { isend(t, peer, tag).wait(); }
void Comm::recv(Tensor t, int peer, int tag) const { irecv(t, peer, tag).wait(); }

Request Comm::isend(Tensor t, int peer, int tag) const {
  check_host(t, "send");
  stats_.send += int64_t(t.nbytes());
  ++stats_.calls;
  std::vector<MPI_Request> reqs(1);
  MPIGPT_MPI(MPI_Isend(t.ptr, as_count(t.numel(), "send"), mpi_type(t), peer, tag, comm_, &reqs[0]));
  return Request(std::move(reqs));
}

Request Comm::irecv(Tensor t, int peer, int tag) const {
  check_host(t, "recv");
  stats_.recv += int64_t(t.nbytes());
  ++stats_.calls;
  std::vector<MPI_Request> reqs(1);
  MPIGPT_MPI(MPI_Irecv(t.ptr, as_count(t.numel(), "recv"), mpi_type(t), peer, tag, comm_, &reqs[0]));
  return Request(std::move(reqs));
}

void Comm::all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, Tensor inp,
                        const std::vector<int64_t>& send_counts) const {
  check_host(inp, "all_to_all_v");
  check_host(out, "all_to_all_v");
  MPIGPT_CHECK(int(recv_counts.size()) == size_ && int(send_counts.size()) == size_,
               "all_to_all_v: {} ranks but {} receive and {} send counts", size_, recv_counts.size(),
               send_counts.size());
  std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
  int64_t so = 0, ro = 0;
  for (int r = 0; r < size_; ++r) {
    sc[r] = as_count(send_counts[r], "all_to_all_v");
    rc[r] = as_count(recv_counts[r], "all_to_all_v");
    sd[r] = as_count(so, "all_to_all_v");
    rd[r] = as_count(ro, "all_to_all_v");
    so += send_counts[r];
    ro += recv_counts[r];
  }
  MPIGPT_CHECK(so <= inp.numel() && ro <= out.numel(), "all_to_all_v: sends {} of {} elements, receives {} into {}",
               so, inp.numel(), ro, out.numel());
  stats_.all_to_all += so * int64_t(dtype_size(inp.dtype));
  ++stats_.calls;
  MPIGPT_MPI(MPI_Alltoallv(inp.ptr, sc.data(), sd.data(), mpi_type(inp), out.ptr, rc.data(), rd.data(),
                           mpi_type(out), comm_));
}

void Comm::barrier() const { MPIGPT_MPI(MPI_Barrier(comm_)); }

}  // namespace mpigpt
