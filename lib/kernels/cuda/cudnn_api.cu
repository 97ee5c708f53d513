// Run-time loading of cuDNN (see cudnn_api.h).
#include "lib/kernels/cuda/cudnn_api.h"

#include "lib/core/error.h"

#ifdef MPIGPT_HAVE_CUDNN
#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#endif

namespace mpigpt::cuda {

#ifndef MPIGPT_HAVE_CUDNN

std::string cudnn_load_error() {
  return "this mpigpt was built without cuDNN's headers (cudnn_graph.h in the CUDA toolkit's include folder), or "
         "for the host emulator; install cuDNN 9 into the toolkit and rebuild, or set "
         "engine.attention_backend = builtin";
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

template <class F>
void bind(void* lib, const char* name, F& slot, std::string& error) {
  slot = reinterpret_cast<F>(dlsym(lib, name));
  if (!slot && error.empty())
    error = fmt::format("{} lacks the function {} (not cuDNN 9?); install cuDNN >= 9.0 or set "
                        "engine.attention_backend = builtin", kLibrary, name);
}

Loaded load() {
  Loaded l;
  // RTLD_LOCAL: cuDNN's symbols stay out of the global namespace (nothing else links against them).
  void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    const char* path = std::getenv("LD_LIBRARY_PATH");
    l.error = fmt::format(
        "cannot load the cuDNN library {} ({}); it was searched in LD_LIBRARY_PATH = '{}', the ld.so cache and the "
        "system library directories. Install cuDNN 9 (or PyTorch's nvidia-cudnn pip package) and add its lib folder "
        "to LD_LIBRARY_PATH, or set engine.attention_backend = builtin",
        kLibrary, why ? why : "unknown error", path ? path : "");
    return l;
  }
  // The library stays loaded for the life of the process: handles may be destroyed late.
  CudnnApi& a = l.api;
  bind(lib, "cudnnGetVersion", a.GetVersion, l.error);
  bind(lib, "cudnnGetErrorString", a.GetErrorString, l.error);
  bind(lib, "cudnnGetLastErrorString", a.GetLastErrorString, l.error);
  bind(lib, "cudnnCreate", a.Create, l.error);
  bind(lib, "cudnnDestroy", a.Destroy, l.error);
  bind(lib, "cudnnSetStream", a.SetStream, l.error);
  bind(lib, "cudnnBackendCreateDescriptor", a.BackendCreateDescriptor, l.error);
  bind(lib, "cudnnBackendDestroyDescriptor", a.BackendDestroyDescriptor, l.error);
  bind(lib, "cudnnBackendFinalize", a.BackendFinalize, l.error);
  bind(lib, "cudnnBackendSetAttribute", a.BackendSetAttribute, l.error);
  bind(lib, "cudnnBackendGetAttribute", a.BackendGetAttribute, l.error);
  bind(lib, "cudnnBackendExecute", a.BackendExecute, l.error);
  if (!l.error.empty()) return l;
  const size_t version = a.GetVersion();
  if (version < kMinVersion)
    l.error = fmt::format("{} is cuDNN version {}, older than the 9.0 this program's fused attention needs; install "
                          "cuDNN 9 or set engine.attention_backend = builtin", kLibrary, version);
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
