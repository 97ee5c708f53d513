// Test helper: a watchdog action that keeps the reports instead of stopping the job.
#pragma once
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace mpigpt {

struct WatchdogReports {
  std::mutex mu;
  std::vector<std::string> list;
  std::function<void(const std::string&)> action() {
    return [this](const std::string& r) {
      const std::lock_guard<std::mutex> lock(mu);
      list.push_back(r);
    };
  }
  std::vector<std::string> get() {
    const std::lock_guard<std::mutex> lock(mu);
    return list;
  }
};

}  // namespace mpigpt
