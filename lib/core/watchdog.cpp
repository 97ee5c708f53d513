// Waits that must end: the registry of waits in progress and the thread that checks them.
#include "lib/core/watchdog.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "lib/core/error.h"

namespace mpigpt {

namespace {

using Clock = std::chrono::steady_clock;

// The waits in progress on every thread, in the order they began (appended when they begin,
// removed from wherever they are when they end).
struct Registry {
  std::mutex mu;
  std::vector<WaitEntry*> waits;
};
Registry& registry() {
  static Registry r;
  return r;
}
std::atomic<bool> g_running{false};

double seconds_since(Clock::time_point t, Clock::time_point now) {
  return std::chrono::duration<double>(now - t).count();
}

}  // namespace

WaitEntry::WaitEntry(void* ctx, Describe describe) noexcept : ctx_(ctx), describe_(describe) {
  if (!g_running.load(std::memory_order_acquire)) return;
  start_ = Clock::now();
  Registry& r = registry();
  try {
    const std::lock_guard<std::mutex> lock(r.mu);
    r.waits.push_back(this);
    registered_ = true;
  } catch (...) {  // out of memory: this wait goes unwatched rather than failing the call
  }
}

WaitEntry::~WaitEntry() {
  if (!registered_) return;
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.waits.erase(std::find(r.waits.begin(), r.waits.end(), this));
}

Watchdog::Watchdog(double timeout_s, std::function<void(const std::string&)> action)
    : timeout_s_(timeout_s), action_(std::move(action)) {
  MPIGPT_CHECK(timeout_s > 0, "watchdog: timeout {} s must be positive", timeout_s);
  bool expected = false;
  MPIGPT_CHECK(g_running.compare_exchange_strong(expected, true), "watchdog: one is running already");
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    const std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
  g_running.store(false, std::memory_order_release);
}

void Watchdog::run() {
  // Checked ten times per timeout, at most once a second: a wait is reported between 1 and 1.1
  // timeouts (or one second more) after it began.
  const auto period = std::chrono::duration<double>(std::min(1.0, timeout_s_ / 10));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_cv_.wait_for(lock, period, [this] { return stop_; })) {
    std::string report;
    {
      Registry& r = registry();
      const std::lock_guard<std::mutex> reg(r.mu);
      const Clock::time_point now = Clock::now();
      const auto late = std::find_if(r.waits.begin(), r.waits.end(), [&](const WaitEntry* w) {
        return !w->reported_ && seconds_since(w->start_, now) > timeout_s_;
      });
      if (late == r.waits.end()) continue;
      report =
          fmt::format("waited longer than the timeout of {:g} s; the waits in progress, oldest first:", timeout_s_);
      for (WaitEntry* w : r.waits) {
        std::string what;
        try {
          what = w->describe_(w->ctx_);
        } catch (const std::exception& e) {
          what = fmt::format("(its description failed: {})", e.what());
        }
        report += fmt::format("\n  {:.1f} s in {}", seconds_since(w->start_, now), what);
        w->reported_ = true;  // each wait is reported once, with the ones around it
      }
    }
    lock.unlock();
    action_(report);
    lock.lock();
  }
}

}  // namespace mpigpt
