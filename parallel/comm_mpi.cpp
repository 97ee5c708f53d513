// The host side of Comm: MPI on host tensors, and the host images of the staged path.
#include "parallel/comm_mpi.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <utility>

#include "lib/core/error.h"

namespace mpigpt {

namespace {

MPI_Datatype mpi_type(const Tensor& t) {
  switch (t.dtype) {
    case DType::F32: return MPI_FLOAT;
    case DType::I32: return MPI_INT32_T;
    case DType::BF16: return MPI_UINT16_T;  // moved, never reduced
  }
  return MPI_BYTE;
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

// bf16 <-> f32 on the host: a bf16 is the upper half of an f32; narrowing rounds to nearest even
// (NaN kept), as the device's __float2bfloat16_rn does.
float widen_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t narrow_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

// ---- MPI on host tensors ----------------------------------------------------------------------

Request mpi_iallreduce(MPI_Comm comm, Tensor t, MPI_Op op) {
  std::vector<MPI_Request> reqs;
  in_pieces(t.numel(), [&](int64_t off, int count) {
    reqs.emplace_back();
    MPIGPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, at(t, off), count, mpi_type(t), op, comm, &reqs.back()));
  });
  return Request(std::move(reqs));
}

void mpi_allreduce(MPI_Comm comm, Tensor t, MPI_Op op) {
  in_pieces(t.numel(), [&](int64_t off, int count) {
    MPIGPT_MPI(MPI_Allreduce(MPI_IN_PLACE, at(t, off), count, mpi_type(t), op, comm));
  });
}

Request mpi_ireduce_scatter(MPI_Comm comm, Tensor out, Tensor inp) {
  std::vector<MPI_Request> reqs(1);
  MPIGPT_MPI(MPI_Ireduce_scatter_block(inp.ptr, out.ptr, as_count(out.numel(), "reduce_scatter_sum"), mpi_type(inp),
                                       MPI_SUM, comm, &reqs[0]));
  return Request(std::move(reqs));
}

Request mpi_iall_gather(MPI_Comm comm, Tensor out, Tensor inp) {
  std::vector<MPI_Request> reqs(1);
  const int n = as_count(inp.numel(), "all_gather");
  MPIGPT_MPI(MPI_Iallgather(inp.ptr, n, mpi_type(inp), out.ptr, n, mpi_type(out), comm, &reqs[0]));
  return Request(std::move(reqs));
}

Request mpi_ireduce_scatter_inplace(MPI_Comm comm, int rank, int size, Tensor buf) {
  const int64_t n = buf.numel() / size;
  std::vector<MPI_Request> reqs(1);
  MPIGPT_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, buf.ptr, as_count(n, "reduce_scatter_sum_inplace"),
                                       mpi_type(buf), MPI_SUM, comm, &reqs[0]));
  // MPI's in-place variant leaves the result in block 0, not block rank(): move it once done.
  std::function<void()> then;
  if (rank != 0)
    then = [dst = at(buf, n * rank), src = at(buf, 0), bytes = size_t(n) * dtype_size(buf.dtype)] {
      std::memcpy(dst, src, bytes);
    };
  return Request(std::move(reqs), std::move(then));
}

Request mpi_iall_gather_inplace(MPI_Comm comm, int size, Tensor buf) {
  std::vector<MPI_Request> reqs(1);
  const int count = as_count(buf.numel() / size, "all_gather_inplace");
  MPIGPT_MPI(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf.ptr, count, mpi_type(buf), comm, &reqs[0]));
  return Request(std::move(reqs));
}

void mpi_broadcast(MPI_Comm comm, Tensor t, int root) {
  in_pieces(t.numel(), [&](int64_t off, int count) {
    MPIGPT_MPI(MPI_Bcast(at(t, off), count, mpi_type(t), root, comm));
  });
}

Request mpi_isend(MPI_Comm comm, Tensor t, int peer, int tag, std::function<void()> then) {
  std::vector<MPI_Request> reqs(1);
  MPIGPT_MPI(MPI_Isend(t.ptr, as_count(t.numel(), "send"), mpi_type(t), peer, tag, comm, &reqs[0]));
  return Request(std::move(reqs), std::move(then));
}

Request mpi_irecv(MPI_Comm comm, Tensor t, int peer, int tag, std::function<void()> then) {
  std::vector<MPI_Request> reqs(1);
  MPIGPT_MPI(MPI_Irecv(t.ptr, as_count(t.numel(), "recv"), mpi_type(t), peer, tag, comm, &reqs[0]));
  return Request(std::move(reqs), std::move(then));
}

void mpi_all_to_all_v(MPI_Comm comm, Tensor out, const std::vector<int64_t>& recv_counts, Tensor inp,
                      const std::vector<int64_t>& send_counts) {
  const int size = int(send_counts.size());
  std::vector<int> sc(size), sd(size), rc(size), rd(size);
  int64_t so = 0, ro = 0;
  for (int r = 0; r < size; ++r) {
    sc[r] = as_count(send_counts[r], "all_to_all_v");
    rc[r] = as_count(recv_counts[r], "all_to_all_v");
    sd[r] = as_count(so, "all_to_all_v");
    rd[r] = as_count(ro, "all_to_all_v");
    so += send_counts[r];
    ro += recv_counts[r];
  }
  MPIGPT_MPI(MPI_Alltoallv(inp.ptr, sc.data(), sd.data(), mpi_type(inp), out.ptr, rc.data(), rd.data(),
                           mpi_type(out), comm));
}

// ---- the staged path -------------------------------------------------------------------------

HostImage::HostImage(DeviceComm& dc, const Tensor& dev, bool load, bool widen)
    : raw_(pinned_host(dc, std::max<size_t>(dev.nbytes(), 1))) {
  if (load) copy_to_host(dc, raw_.get(), dev);
  if (widen && dev.dtype == DType::BF16) {
    wide_.resize(size_t(dev.numel()));
    const auto* b = reinterpret_cast<const uint16_t*>(raw_.get());
    if (load)
      for (size_t i = 0; i < wide_.size(); ++i) wide_[i] = widen_bf16(b[i]);
    host_ = Tensor(wide_.data(), dev.shape, DType::F32);
  } else {
    host_ = Tensor(raw_.get(), dev.shape, dev.dtype);
  }
}

void HostImage::store(const DeviceComm& dc, const Tensor& dev) {
  if (!wide_.empty()) {
    auto* b = reinterpret_cast<uint16_t*>(raw_.get());
    for (size_t i = 0; i < wide_.size(); ++i) b[i] = narrow_bf16(wide_[i]);
  }
  copy_to_device(dc, dev, raw_.get());
}

}  // namespace mpigpt
