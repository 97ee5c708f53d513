// Errors: one exception type for every failure, and the CHECK macros that raise it.
// A failure is thrown, never printed-and-continued; `app/` catches it at the top, prints it with
// the rank and calls MPI_Abort so that no other rank waits forever (DESIGN principle 7).
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace mpigpt {

// Any failure: bad user input (the message names the file/field, the value and the fix) or a
// broken invariant / library call (the message names file:line and the call).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

namespace detail {
[[noreturn]] void check_failed(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace mpigpt

// MPIGPT_CHECK(cond, "fmt", args...): throws mpigpt::Error naming file:line and the condition.
#define MPIGPT_CHECK(cond, ...)                                                             \
  do {                                                                                      \
    if (!(cond)) ::mpigpt::detail::check_failed(__FILE__, __LINE__, #cond, fmt::format(__VA_ARGS__)); \
  } while (0)
