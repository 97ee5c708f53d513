// Run-time loading of NCCL (see nccl_loader.h).
#include "parallel/nccl_loader.h"

#ifdef MPIGPT_HAVE_NCCL
#include <dlfcn.h>

#include <cstdlib>
#endif

#include "lib/core/error.h"

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

template <class F>
void bind(void* lib, const char* name, F& slot, std::string& error) {
  slot = reinterpret_cast<F>(dlsym(lib, name));
  if (!slot && error.empty())
    error = fmt::format("engine.comm = nccl: {} lacks the function {} (too old?); install NCCL >= 2.13 or set "
                        "engine.comm = mpi", kLibrary, name);
}

Loaded load() {
  Loaded l;
  // RTLD_LOCAL: NCCL's symbols stay out of the global namespace (nothing else links against them).
  void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    const char* path = std::getenv("LD_LIBRARY_PATH");
    l.error = fmt::format(
        "engine.comm = nccl: cannot load the NCCL library {} ({}); it was searched in LD_LIBRARY_PATH = '{}', the "
        "ld.so cache and the system library directories. Install NCCL (e.g. the libnccl2 package) or add its lib "
        "directory to LD_LIBRARY_PATH, or set engine.comm = mpi (device memory is then staged through the host)",
        kLibrary, why ? why : "unknown error", path ? path : "");
    return l;
  }
  // The library stays loaded for the life of the process: communicators may be destroyed late.
  NcclApi& a = l.api;
  bind(lib, "ncclGetVersion", a.GetVersion, l.error);
  bind(lib, "ncclGetErrorString", a.GetErrorString, l.error);
  bind(lib, "ncclGetLastError", a.GetLastError, l.error);
  bind(lib, "ncclGetUniqueId", a.GetUniqueId, l.error);
  bind(lib, "ncclCommInitRank", a.CommInitRank, l.error);
  bind(lib, "ncclCommDestroy", a.CommDestroy, l.error);
  bind(lib, "ncclCommAbort", a.CommAbort, l.error);
  bind(lib, "ncclGroupStart", a.GroupStart, l.error);
  bind(lib, "ncclGroupEnd", a.GroupEnd, l.error);
  bind(lib, "ncclAllReduce", a.AllReduce, l.error);
  bind(lib, "ncclReduceScatter", a.ReduceScatter, l.error);
  bind(lib, "ncclAllGather", a.AllGather, l.error);
  bind(lib, "ncclBroadcast", a.Broadcast, l.error);
  bind(lib, "ncclSend", a.Send, l.error);
  bind(lib, "ncclRecv", a.Recv, l.error);
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
