// Tests of the watchdog: which waits it reports, when, and how.
#include "lib/core/watchdog.h"

#include <doctest/doctest.h>

#include <atomic>
#include <string>
#include <vector>

#include "lib/core/error.h"
#include "lib/core/watchdog_testing.h"

namespace mpigpt {
namespace {

void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

}  // namespace

TEST_CASE("watchdog: a wait longer than the timeout is reported once, with its description") {
  WatchdogReports reports;
  const Watchdog dog(0.2, reports.action());
  {
    const Waiting w([] { return std::string("all-reduce over the test group"); });
    sleep_s(0.6);  // three timeouts: still one report
  }
  const std::vector<std::string> r = reports.get();
  REQUIRE(r.size() == 1);
  CHECK(r[0].find("timeout of 0.2 s") != std::string::npos);
  CHECK(r[0].find("s in all-reduce over the test group") != std::string::npos);
}

TEST_CASE("watchdog: short waits and the time between waits do not count") {
  WatchdogReports reports;
  const Watchdog dog(0.3, reports.action());
  for (int i = 0; i < 5; ++i) {
    const Waiting w([] { return std::string("a short wait"); });
    sleep_s(0.05);
  }
  sleep_s(0.5);  // computing, not waiting
  {
    const Waiting w([] { return std::string("another short wait"); });
    sleep_s(0.05);
  }
  sleep_s(0.1);
  CHECK(reports.get().empty());
}

TEST_CASE("watchdog: nested waits are reported together, outer first") {
  WatchdogReports reports;
  const Watchdog dog(0.2, reports.action());
  {
    const Waiting outer([] { return std::string("the outer call"); });
    sleep_s(0.05);
    const Waiting inner([] { return std::string("the device sync inside it"); });
    sleep_s(0.5);
  }
  const std::vector<std::string> r = reports.get();
  REQUIRE(r.size() == 1);
  const size_t o = r[0].find("the outer call"), i = r[0].find("the device sync inside it");
  CHECK(o != std::string::npos);
  CHECK(i != std::string::npos);
  CHECK(o < i);
}

TEST_CASE("watchdog: waits on another thread are watched too") {
  WatchdogReports reports;
  const Watchdog dog(0.2, reports.action());
  std::thread t([] {
    const Waiting w([] { return std::string("a message on a helper thread"); });
    sleep_s(0.5);
  });
  t.join();
  const std::vector<std::string> r = reports.get();
  REQUIRE(r.size() == 1);
  CHECK(r[0].find("a message on a helper thread") != std::string::npos);
}

TEST_CASE("watchdog: without one running, waits are not registered and never described") {
  std::atomic<int> described{0};
  {
    const Waiting w([&] {
      ++described;
      return std::string("unwatched");
    });
    WatchdogReports reports;
    const Watchdog dog(0.1, reports.action());  // started after the wait began: it never sees it
    sleep_s(0.4);
    CHECK(reports.get().empty());
  }
  CHECK(described == 0);
}

TEST_CASE("watchdog: one at a time, a positive timeout") {
  WatchdogReports reports;
  CHECK_THROWS_WITH_AS(Watchdog(0, reports.action()), doctest::Contains("must be positive"), Error);
  {
    const Watchdog dog(1, reports.action());
    CHECK_THROWS_WITH_AS(Watchdog(1, reports.action()), doctest::Contains("one is running already"), Error);
  }
  const Watchdog again(1, reports.action());  // the first one has stopped
  CHECK(again.timeout_s() == 1);
}

}  // namespace mpigpt
