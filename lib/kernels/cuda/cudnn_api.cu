// Run-time loading of cuDNN (see cudnn_api.h).
#include "lib/kernels/cuda/cudnn_api.h"

#include "lib/core/error.h"

#ifdef MPIGPT_HAVE_CUDNN
#include <fmt/format.h>

#include "lib/core/runtime_library.h"
#endif

namespace mpigpt::cuda {

#ifndef MPIGPT_HAVE_CUDNN

std::string cudnn_load_error() {
  return "this mpigpt was built without cuDNN's headers (cudnn_graph.h in the CUDA toolkit's include folder); "
         "install cuDNN 9 into the toolkit and rebuild";
}

#else

namespace {

constexpr const char* kLibrary = "libcudnn.so.9";
// The graph (backend) API with bf16 fused attention on Hopper: cuDNN 9.
constexpr size_t kMinVersion = 90000;

struct Loaded {
  CudnnApi api{};
  std::string error;  // empty when api is complete
};

Loaded load() {
  Loaded l;
  RuntimeLibrary lib({kLibrary, "cuDNN", "",
                      "Install cuDNN 9 (or PyTorch's nvidia-cudnn pip package) and add its lib folder to "
                      "LD_LIBRARY_PATH",
                      "(not cuDNN 9?); install cuDNN >= 9.0"});
  CudnnApi& a = l.api;
  lib.bind("cudnnGetVersion", a.GetVersion);
  lib.bind("cudnnGetErrorString", a.GetErrorString);
  lib.bind("cudnnGetLastErrorString", a.GetLastErrorString);
  lib.bind("cudnnCreate", a.Create);
  lib.bind("cudnnDestroy", a.Destroy);
  lib.bind("cudnnSetStream", a.SetStream);
  lib.bind("cudnnBackendCreateDescriptor", a.BackendCreateDescriptor);
  lib.bind("cudnnBackendDestroyDescriptor", a.BackendDestroyDescriptor);
  lib.bind("cudnnBackendFinalize", a.BackendFinalize);
  lib.bind("cudnnBackendSetAttribute", a.BackendSetAttribute);
  lib.bind("cudnnBackendGetAttribute", a.BackendGetAttribute);
  lib.bind("cudnnBackendExecute", a.BackendExecute);
  l.error = lib.error();
  if (!l.error.empty()) return l;
  const size_t version = a.GetVersion();
  if (version < kMinVersion)
    l.error = fmt::format("{} is cuDNN version {}, older than the 9.0 this program's fused attention needs; install "
                          "cuDNN 9", kLibrary, version);
  return l;
}

// Loaded once per process; thread-safe by the rules of function-local statics.
const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace

std::string cudnn_load_error() { return loaded().error; }

const CudnnApi& cudnn() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw Error(l.error);
  return l.api;
}

std::string cudnn_error_text(cudnnStatus_t rc) {
  const CudnnApi& a = cudnn();
  char last[1024] = {0};
  a.GetLastErrorString(last, sizeof last);
  return fmt::format("{}{}{}", a.GetErrorString(rc), last[0] ? ": " : "", last);
}

#endif

}  // namespace mpigpt::cuda
