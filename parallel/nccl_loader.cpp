// Run-time loading of NCCL (see nccl_loader.h).
#include "parallel/nccl_loader.h"

#include "lib/core/error.h"
#ifdef MPIGPT_HAVE_NCCL
#include "lib/core/runtime_library.h"
#endif

namespace mpigpt {

#ifndef MPIGPT_HAVE_NCCL

std::string nccl_load_error() {
#ifdef MPIGPT_WITH_CUDA
  return "engine.comm = nccl: this mpigpt was built with a CUDA toolkit that has no nccl.h; install NCCL's "
         "headers and rebuild, or set engine.comm = mpi";
#else
  return "engine.comm = nccl: this mpigpt was built without the CUDA backend; rebuild with the CUDA toolkit "
         "(cmake -DMPIGPT_CUDA=ON) or set engine.comm = mpi";
#endif
}

#else

namespace {

constexpr const char* kLibrary = "libnccl.so.2";
// bf16 reductions (ncclBfloat16) and ncclGetLastError are what we rely on beyond the oldest API.
constexpr int kMinVersion = 21300;  // NCCL_VERSION(2, 13, 0)

struct Loaded {
  NcclApi api{};
  std::string error;  // empty when api is complete
};

Loaded load() {
  Loaded l;
  RuntimeLibrary lib({kLibrary, "NCCL", "engine.comm = nccl: ",
                      "Install NCCL (e.g. the libnccl2 package) or add its lib directory to LD_LIBRARY_PATH, or set "
                      "engine.comm = mpi (device memory is then staged through the host)",
                      "(too old?); install NCCL >= 2.13 or set engine.comm = mpi"});
  NcclApi& a = l.api;
  lib.bind("ncclGetVersion", a.GetVersion);
  lib.bind("ncclGetErrorString", a.GetErrorString);
  lib.bind("ncclGetLastError", a.GetLastError);
  lib.bind("ncclGetUniqueId", a.GetUniqueId);
  lib.bind("ncclCommInitRank", a.CommInitRank);
  lib.bind("ncclCommDestroy", a.CommDestroy);
  lib.bind("ncclCommAbort", a.CommAbort);
  lib.bind("ncclGroupStart", a.GroupStart);
  lib.bind("ncclGroupEnd", a.GroupEnd);
  lib.bind("ncclAllReduce", a.AllReduce);
  lib.bind("ncclReduceScatter", a.ReduceScatter);
  lib.bind("ncclAllGather", a.AllGather);
  lib.bind("ncclBroadcast", a.Broadcast);
  lib.bind("ncclSend", a.Send);
  lib.bind("ncclRecv", a.Recv);
#ifdef NCCL_SPLIT_NOCOLOR
  lib.bind_optional("ncclCommSplit", a.CommSplit);
#endif
  l.error = lib.error();
  if (!l.error.empty()) return l;
  int version = 0;
  if (a.GetVersion(&version) != ncclSuccess || version < kMinVersion)
    l.error = fmt::format("engine.comm = nccl: {} is NCCL version code {}, older than the 2.13 this program needs "
                          "(bf16 reductions, error texts); install a newer NCCL or set engine.comm = mpi",
                          kLibrary, version);
  return l;
}

// Loaded once per process; thread-safe by the rules of function-local statics.
const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace

std::string nccl_load_error() { return loaded().error; }

const NcclApi& nccl() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw Error(l.error);
  return l.api;
}

void nccl_failed(ncclResult_t rc, const char* call, const char* file, int line) {
  const Loaded& l = loaded();
  const char* what = l.api.GetErrorString ? l.api.GetErrorString(rc) : "?";
  const char* last = l.api.GetLastError ? l.api.GetLastError(nullptr) : nullptr;
  fail("{}:{}: {} failed: {}{}{}", file, line, call, what, last && *last ? ": " : "", last ? last : "");
}

#endif

}  // namespace mpigpt
