// The NCCL library, loaded at run time: dlopen("libnccl.so.2") and a table of the functions Comm
// uses, so that the binary starts on machines without NCCL and engine.comm = mpi never needs it.
#pragma once
#include <string>

// nccl.h supplies only the types and enums. Builds without CUDA, or whose toolkit lacks nccl.h,
// have no table (MPIGPT_HAVE_NCCL undefined) and nccl_load_error() says so.
#if defined(MPIGPT_WITH_CUDA) && __has_include(<nccl.h>)
#include <nccl.h>
#define MPIGPT_HAVE_NCCL 1
#endif

namespace mpigpt {

// Empty when NCCL can be used, else why not: the library, where it was searched and the fixes.
// Loads the library on first call; never throws.
std::string nccl_load_error();

#ifdef MPIGPT_HAVE_NCCL

struct NcclApi {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRank) CommInitRank;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
#ifdef NCCL_SPLIT_NOCOLOR
  // NCCL 2.18 and newer; nullptr in an older library (engine.nccl_init = split then fails, naming it).
  decltype(&::ncclCommSplit) CommSplit;
#endif
};

// The loaded table; throws mpigpt::Error with nccl_load_error()'s text when it cannot be loaded.
const NcclApi& nccl();

// Throws mpigpt::Error naming file:line, the call and NCCL's messages.
[[noreturn]] void nccl_failed(ncclResult_t rc, const char* call, const char* file, int line);

#endif

}  // namespace mpigpt

#ifdef MPIGPT_HAVE_NCCL
#define MPIGPT_NCCL(call)                                                                  \
  do {                                                                                     \
    const ncclResult_t mpigpt_nccl_rc_ = (call);                                           \
    if (mpigpt_nccl_rc_ != ncclSuccess) ::mpigpt::nccl_failed(mpigpt_nccl_rc_, #call, __FILE__, __LINE__); \
  } while (0)
#endif
