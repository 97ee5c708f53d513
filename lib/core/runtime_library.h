// A shared library opened at run time (dlopen) for an optional dependency, so that the program
// starts on machines without it and only the features that need it fail, with a message naming
// the library, where it was searched and the fix.
#pragma once
#include <string>

namespace mpigpt {

// How a library is named in its messages.
struct RuntimeLibrarySpec {
  const char* soname;   // the file dlopen looks for, e.g. "libnccl.so.2"
  const char* what;     // its name in "cannot load the <what> library"
  const char* context;  // put before every message, e.g. "engine.comm = nccl: " (may be "")
  const char* install;  // the fix when it cannot be opened
  const char* missing;  // after "lacks the function NAME ": why and the fix
};

// NCCL (parallel/nccl_loader.cpp) and cuDNN (lib/kernels/cuda/cudnn_api.cu) are loaded this way.
// The library is opened RTLD_LOCAL (its symbols stay out of the global namespace) and never
// closed: objects it made may be destroyed late in the process.
class RuntimeLibrary {
 public:
  // Opens spec.soname; when that fails, error() says so.
  explicit RuntimeLibrary(const RuntimeLibrarySpec& spec);
  bool ok() const { return error_.empty(); }
  // Empty while the library is open and every bound function was found; else the first failure.
  const std::string& error() const { return error_; }
  // Points slot at the function name (nullptr when the library is not open or lacks it; the
  // first missing one sets error()).
  template <class F>
  void bind(const char* name, F& slot) {
    slot = reinterpret_cast<F>(symbol(name, true));
  }
  // The same for a function that older versions lack: nullptr then, and error() stays as it was
  // (the feature that needs it says so).
  template <class F>
  void bind_optional(const char* name, F& slot) {
    slot = reinterpret_cast<F>(symbol(name, false));
  }

 private:
  void* symbol(const char* name, bool required);

  RuntimeLibrarySpec spec_;
  void* handle_ = nullptr;
  std::string error_;
};

}  // namespace mpigpt
