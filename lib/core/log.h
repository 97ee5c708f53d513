// Console output: plain lines through fmt, flushed at once so that multi-rank output interleaves
// by line. Which rank prints is the caller's choice (lib/core knows no ranks).
#pragma once
#include <fmt/format.h>
#include <poll.h>

#include <csignal>
#include <cstdio>
#include <string>

namespace mpigpt {

// Set (from a signal handler) when the console may no longer be read: a launcher that is ending
// the job (mpirun after SIGTERM or Ctrl-C) stops reading its ranks' output, and a rank blocked
// writing a line could never reach its save. From then on a line that stdout cannot take at
// once is dropped.
inline volatile std::sig_atomic_t g_console_best_effort = 0;

template <class... Args>
void log_line(fmt::format_string<Args...> f, Args&&... args) {
  std::string line = fmt::format(f, std::forward<Args>(args)...);
  line += '\n';
  pollfd out{fileno(stdout), POLLOUT, 0};
  if (g_console_best_effort && (::poll(&out, 1, 0) != 1 || !(out.revents & POLLOUT))) return;
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
}

template <class... Args>
void log_error(fmt::format_string<Args...> f, Args&&... args) {
  fmt::print(stderr, f, std::forward<Args>(args)...);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

}  // namespace mpigpt
