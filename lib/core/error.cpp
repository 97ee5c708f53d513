// Out-of-line part of the CHECK macros (keeps the formatting code out of every call site).
#include "lib/core/error.h"

#include <cstring>

namespace mpigpt::detail {

void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  const char* base = std::strstr(file, "mpigpt/") ? std::strstr(file, "mpigpt/") + 7 : file;
  throw Error(fmt::format("{}:{}: check `{}` failed: {}", base, line, cond, msg));
}

}  // namespace mpigpt::detail
