// Console output: plain lines through fmt, flushed at once so that multi-rank output interleaves
// by line. Which rank prints is the caller's choice (lib/core knows no ranks).
#pragma once
#include <fmt/format.h>

#include <cstdio>

namespace mpigpt {

template <class... Args>
void log_line(fmt::format_string<Args...> f, Args&&... args) {
  fmt::print(stdout, f, std::forward<Args>(args)...);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

template <class... Args>
void log_error(fmt::format_string<Args...> f, Args&&... args) {
  fmt::print(stderr, f, std::forward<Args>(args)...);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

}  // namespace mpigpt
