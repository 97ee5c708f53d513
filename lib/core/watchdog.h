// Waits that must end: a rank blocked on its peers marks the wait, and a watchdog stops the job
// when one lasts too long, so that a rank whose peer never reaches the matching call fails loudly
// instead of hanging (as Megatron-LM's --distributed-timeout-minutes and PyTorch's NCCL watchdog).
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace mpigpt {

// One registered wait: its start and how to describe it (a callable that the watchdog's thread
// calls, under the registry's lock, only when it reports). Use Waiting below.
class WaitEntry {
 public:
  using Describe = std::string (*)(void* ctx);  // ctx not const: GCC would warn that it reads an empty lambda
  WaitEntry(void* ctx, Describe describe) noexcept;
  ~WaitEntry();
  WaitEntry(const WaitEntry&) = delete;
  WaitEntry& operator=(const WaitEntry&) = delete;

 private:
  friend class Watchdog;
  void* ctx_;
  Describe describe_;
  std::chrono::steady_clock::time_point start_;
  bool registered_ = false, reported_ = false;
};

// RAII: `const Waiting w([&] { return fmt::format("all-reduce of {} ...", n); });` marks the
// enclosing block as a wait on the rank's peers (a collective, a message, the device finishing
// work queued behind a collective). The lambda runs only if the wait is reported, on the
// watchdog's thread, while this scope is still alive; it must not block. Without a running
// watchdog a scope costs one atomic load.
template <class F>
class Waiting {
 public:
  explicit Waiting(F describe) : describe_(std::move(describe)), entry_(&describe_, &call) {}

 private:
  static std::string call(void* f) { return (*static_cast<const F*>(f))(); }
  F describe_;       // constructed before entry_ registers it,
  WaitEntry entry_;  // and unregistered before it is destroyed
};

// While a Watchdog runs, its thread checks that no marked wait has lasted longer than the timeout;
// when one has, it calls the action once with a report of every wait in progress, oldest first.
// The trainer's action prints the report and stops the whole job (parallel/mpi_env.h). Only time
// spent waiting counts: a long computation between waits never trips the watchdog, but its
// peers' waits for it do.
class Watchdog {
 public:
  // timeout_s > 0. Starts the checking thread; one watchdog at a time (a second throws).
  Watchdog(double timeout_s, std::function<void(const std::string& report)> action);
  ~Watchdog();  // stops the thread; waits no longer count
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  double timeout_s() const { return timeout_s_; }

 private:
  void run();
  double timeout_s_;
  std::function<void(const std::string&)> action_;
  std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mpigpt
