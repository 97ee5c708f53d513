// The host emulator's NCCL (docs/testing.md): libnccl.so.2 of the emulated build, which
// parallel/nccl_loader.cpp loads as it loads the real one, implementing the functions it resolves
// over MPI. Each operation snapshots its input when issued (all earlier work on its stream is done
// then: the emulator's streams are the host) and starts as nonblocking MPI, so that no rank's host
// blocks where a GPU's would not; it is finished (the MPI requests waited for, the result copied
// to the receive buffer) in stream order where the stream's later work, an event wait or a
// synchronisation needs it (emu::AsyncHooks). Reductions of bf16 are done in fp32 and rounded once.
//
// A communicator is an MPI communicator of its members: ncclGetUniqueId names the calling world
// rank and a counter; in ncclCommInitRank every member sends its NCCL rank and world rank to that
// rank, which answers with the member list, and MPI_Comm_create_group (collective over the members
// only) makes the communicator, ranked as NCCL ranks them. ncclCommSplit is MPI_Comm_split of the
// parent's.
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_runtime.h"
#include "nccl.h"

struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, nranks = 0;
};

namespace {

using Bytes = std::shared_ptr<std::vector<char>>;

struct Op {
  unsigned long long seq;
  std::vector<MPI_Request> requests;
  std::function<void()> finish;  // after the requests: the result to the receive buffer
};
struct Stream {
  unsigned long long issued = 0;
  std::deque<Op> pending;
};
std::map<cudaStream_t, Stream> streams;

void finish_front(Stream& st) {
  Op& op = st.pending.front();
  MPI_Waitall(int(op.requests.size()), op.requests.data(), MPI_STATUSES_IGNORE);
  if (op.finish) op.finish();
  st.pending.pop_front();
}

unsigned long long issued(cudaStream_t s) { return streams[s].issued; }

void complete(cudaStream_t s, unsigned long long upto) {
  for (auto& [stream, st] : streams) {
    if (s && stream != s) continue;
    while (!st.pending.empty() && st.pending.front().seq <= upto) finish_front(st);
  }
}

bool done(cudaStream_t s, unsigned long long upto) {
  for (auto& [stream, st] : streams) {
    if (s && stream != s) continue;
    while (!st.pending.empty() && st.pending.front().seq <= upto) {
      Op& op = st.pending.front();
      int flag = 0;
      MPI_Testall(int(op.requests.size()), op.requests.data(), &flag, MPI_STATUSES_IGNORE);
      if (!flag) return false;
      finish_front(st);  // the requests are complete: this only delivers the result
    }
  }
  return true;
}

const emu::AsyncHooks hooks{issued, complete, done};
struct Register {
  Register() { emu::set_async_hooks(&hooks); }
  ~Register() { emu::set_async_hooks(nullptr); }
} register_hooks;

// An operation reads its input when issued: everything queued on other streams (the compute work
// that made the input) must be ordered before it, or a GPU would race. Checked before the read.
void check_ordered(cudaStream_t s, const char* op) {
  const std::string unordered = emu::unordered_work(s);
  if (unordered.empty()) return;
  std::fprintf(stderr,
               "emulated NCCL: %s issued while %s: on a GPU it could read its input before that work wrote it "
               "(make the stream wait for an event recorded after it)\n",
               op, unordered.c_str());
  std::abort();
}

void issue(cudaStream_t s, std::vector<MPI_Request> requests, std::function<void()> finish) {
  Stream& st = streams[s];
  st.pending.push_back(Op{++st.issued, std::move(requests), std::move(finish)});
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    default: return 8;
  }
}

// The reduction's element type: bf16 is reduced as fp32.
MPI_Datatype reduce_type(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32:
    case ncclBfloat16: return MPI_FLOAT;
    case ncclFloat64: return MPI_DOUBLE;
    case ncclInt32: return MPI_INT32_T;
    case ncclInt64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
  }
}
size_t reduce_size(ncclDataType_t t) { return t == ncclBfloat16 ? 4 : type_size(t); }

Bytes to_reduce(const void* src, size_t n, ncclDataType_t t) {
  auto v = std::make_shared<std::vector<char>>(n * reduce_size(t));
  if (t == ncclBfloat16) {
    float* f = reinterpret_cast<float*>(v->data());
    for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
  } else if (n) {
    std::memcpy(v->data(), src, v->size());
  }
  return v;
}

void from_reduce(void* dst, const Bytes& v, size_t n, ncclDataType_t t, ncclRedOp_t op, int nranks) {
  if (op == ncclAvg) {  // NCCL's average: the sum divided by the rank count
    if (reduce_type(t) == MPI_FLOAT)
      for (size_t i = 0; i < n; ++i) reinterpret_cast<float*>(v->data())[i] /= float(nranks);
    else if (reduce_type(t) == MPI_DOUBLE)
      for (size_t i = 0; i < n; ++i) reinterpret_cast<double*>(v->data())[i] /= double(nranks);
  }
  if (t == ncclBfloat16) {
    const float* f = reinterpret_cast<const float*>(v->data());
    for (size_t i = 0; i < n; ++i) static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(f[i]);
  } else if (n) {
    std::memcpy(dst, v->data(), v->size());
  }
}

MPI_Op mpi_op(ncclRedOp_t op) {
  switch (op) {
    case ncclSum:
    case ncclAvg: return MPI_SUM;
    case ncclProd: return MPI_PROD;
    case ncclMax: return MPI_MAX;
    case ncclMin: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

Bytes copy_of(const void* src, size_t bytes) {
  auto v = std::make_shared<std::vector<char>>(bytes);
  if (bytes) std::memcpy(v->data(), src, bytes);
  return v;
}

bool reducible(ncclDataType_t t, ncclRedOp_t op) {
  return reduce_type(t) != MPI_DATATYPE_NULL && mpi_op(op) != MPI_OP_NULL &&
         (op != ncclAvg || reduce_type(t) == MPI_FLOAT || reduce_type(t) == MPI_DOUBLE);
}

struct IdContents {
  uint32_t magic;
  int root;  // the world rank that made the id
  int counter;
};
constexpr uint32_t kMagic = 0x4d504743;  // "MPGC"

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  *version = 22800;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument (emulated NCCL)";
    case ncclInvalidUsage: return "invalid usage (emulated NCCL)";
    case ncclSystemError: return "system error (emulated NCCL: an MPI call failed)";
    default: return "error (emulated NCCL)";
  }
}

const char* ncclGetLastError(ncclComm_t) { return ""; }

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static int counter = 0;
  IdContents c{kMagic, 0, counter++};
  MPI_Comm_rank(MPI_COMM_WORLD, &c.root);
  std::memset(id, 0, sizeof *id);
  std::memcpy(id->internal, &c, sizeof c);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  IdContents c;
  std::memcpy(&c, id.internal, sizeof c);
  if (c.magic != kMagic || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  const int tag = 0x4000 + (c.counter & 0x3fff);
  std::vector<int> world_of(size_t(nranks), -1);
  if (me == c.root) {
    world_of[size_t(rank)] = me;
    for (int i = 1; i < nranks; ++i) {
      int pair[2];
      MPI_Recv(pair, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      if (pair[0] < 0 || pair[0] >= nranks) return ncclInvalidUsage;
      world_of[size_t(pair[0])] = pair[1];
    }
    for (int r = 0; r < nranks; ++r)
      if (r != rank) MPI_Send(world_of.data(), nranks, MPI_INT, world_of[size_t(r)], tag, MPI_COMM_WORLD);
  } else {
    const int pair[2] = {rank, me};
    MPI_Send(pair, 2, MPI_INT, c.root, tag, MPI_COMM_WORLD);
    MPI_Recv(world_of.data(), nranks, MPI_INT, c.root, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  MPI_Group world, members;
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  MPI_Group_incl(world, nranks, world_of.data(), &members);
  auto* nc = new ncclComm;
  const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, members, tag, &nc->mpi);
  MPI_Group_free(&members);
  MPI_Group_free(&world);
  if (rc != MPI_SUCCESS) {
    delete nc;
    return ncclSystemError;
  }
  nc->rank = rank;
  nc->nranks = nranks;
  *comm = nc;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  complete(nullptr, ~0ull);
  MPI_Comm_free(&comm->mpi);
  delete comm;
  return ncclSuccess;
}

// Collective over the parent's members, as MPI_Comm_split of its MPI communicator: the same colour
// makes one communicator, ranked by key (ties by parent rank, NCCL's order too); NOCOLOR, none.
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t*) {
  if (!comm || !newcomm || color < NCCL_SPLIT_NOCOLOR) return ncclInvalidArgument;
  MPI_Comm mpi = MPI_COMM_NULL;
  if (MPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &mpi) != MPI_SUCCESS)
    return ncclSystemError;
  *newcomm = nullptr;
  if (mpi == MPI_COMM_NULL) return ncclSuccess;
  auto* nc = new ncclComm;
  nc->mpi = mpi;
  MPI_Comm_rank(mpi, &nc->rank);
  MPI_Comm_size(mpi, &nc->nranks);
  *newcomm = nc;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {  // no waiting for peers: the communicator is dropped
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() { return ncclSuccess; }  // every operation is nonblocking already
ncclResult_t ncclGroupEnd() { return ncclSuccess; }

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  check_ordered(stream, "ncclAllReduce");
  if (!reducible(t, op)) return ncclInvalidArgument;
  Bytes in = to_reduce(send, count, t), out = std::make_shared<std::vector<char>>(in->size());
  MPI_Request rq;
  MPI_Iallreduce(in->data(), out->data(), int(count), reduce_type(t), mpi_op(op), comm->mpi, &rq);
  const int n = comm->nranks;
  issue(stream, {rq}, [=] { from_reduce(recv, out, count, t, op, n); (void)in; });
  return ncclSuccess;
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  check_ordered(stream, "ncclReduceScatter");
  if (!reducible(t, op)) return ncclInvalidArgument;
  Bytes in = to_reduce(send, recvcount * size_t(comm->nranks), t);
  Bytes out = std::make_shared<std::vector<char>>(recvcount * reduce_size(t));
  MPI_Request rq;
  MPI_Ireduce_scatter_block(in->data(), out->data(), int(recvcount), reduce_type(t), mpi_op(op), comm->mpi, &rq);
  const int n = comm->nranks;
  issue(stream, {rq}, [=] { from_reduce(recv, out, recvcount, t, op, n); (void)in; });
  return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t stream) {
  check_ordered(stream, "ncclAllGather");
  const size_t bytes = sendcount * type_size(t);
  Bytes in = copy_of(send, bytes), out = std::make_shared<std::vector<char>>(bytes * size_t(comm->nranks));
  MPI_Request rq;
  MPI_Iallgather(in->data(), int(bytes), MPI_BYTE, out->data(), int(bytes), MPI_BYTE, comm->mpi, &rq);
  issue(stream, {rq}, [=] {
    if (!out->empty()) std::memcpy(recv, out->data(), out->size());
    (void)in;
  });
  return ncclSuccess;
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  check_ordered(stream, "ncclBroadcast");
  if (root < 0 || root >= comm->nranks) return ncclInvalidArgument;  // as NCCL's argument check
  const size_t bytes = count * type_size(t);
  Bytes buf = comm->rank == root ? copy_of(send, bytes) : std::make_shared<std::vector<char>>(bytes);
  MPI_Request rq;
  MPI_Ibcast(buf->data(), int(bytes), MPI_BYTE, root, comm->mpi, &rq);
  issue(stream, {rq}, [=] {
    if (bytes) std::memcpy(recv, buf->data(), bytes);
  });
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  check_ordered(stream, "ncclSend");
  if (peer < 0 || peer >= comm->nranks) return ncclInvalidArgument;
  Bytes in = copy_of(send, count * type_size(t));
  MPI_Request rq;
  MPI_Isend(in->data(), int(in->size()), MPI_BYTE, peer, 0, comm->mpi, &rq);
  issue(stream, {rq}, [in] {});
  return ncclSuccess;
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t stream) {
  check_ordered(stream, "ncclRecv");
  if (peer < 0 || peer >= comm->nranks) return ncclInvalidArgument;
  Bytes out = std::make_shared<std::vector<char>>(count * type_size(t));
  MPI_Request rq;
  MPI_Irecv(out->data(), int(out->size()), MPI_BYTE, peer, 0, comm->mpi, &rq);
  issue(stream, {rq}, [=] {
    if (!out->empty()) std::memcpy(recv, out->data(), out->size());
  });
  return ncclSuccess;
}

}  // extern "C"
