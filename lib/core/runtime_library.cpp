// Run-time loading of optional shared libraries (see runtime_library.h).
#include "lib/core/runtime_library.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>

namespace mpigpt {

RuntimeLibrary::RuntimeLibrary(const RuntimeLibrarySpec& spec) : spec_(spec) {
  handle_ = dlopen(spec.soname, RTLD_NOW | RTLD_LOCAL);
  if (handle_) return;
  const char* why = dlerror();
  const char* path = std::getenv("LD_LIBRARY_PATH");
  error_ = fmt::format("{}cannot load the {} library {} ({}); it was searched in LD_LIBRARY_PATH = '{}', the ld.so "
                       "cache and the system library directories. {}",
                       spec.context, spec.what, spec.soname, why ? why : "unknown error", path ? path : "",
                       spec.install);
}

void* RuntimeLibrary::symbol(const char* name, bool required) {
  if (!handle_) return nullptr;
  void* p = dlsym(handle_, name);
  if (!p && required && error_.empty())
    error_ = fmt::format("{}{} lacks the function {} {}", spec_.context, spec_.soname, name, spec_.missing);
  return p;
}

}  // namespace mpigpt
