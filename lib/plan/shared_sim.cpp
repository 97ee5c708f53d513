// Processor-sharing replay of pipeline schedules: an event loop over compute completions and
// message arrivals, the runnable ranks dividing the cores among them.
#include "lib/plan/shared_sim.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "lib/core/error.h"

namespace mpigpt {

namespace {

using Key = std::tuple<bool, int, int>;  // (backward direction, micro-batch, the sending virtual stage)

Key key_of(const Action& a, int pp, int rank) {
  const int s = virtual_stage(pp, rank, a.chunk);
  switch (a.type) {
    case ActionType::SendForward: return {false, a.mb, s};
    case ActionType::RecvForward: return {false, a.mb, s - 1};
    case ActionType::SendBackward: return {true, a.mb, s};
    default: return {true, a.mb, s + 1};  // RecvBackward
  }
}

double cost(const std::vector<double>& c, int s) { return c.size() == 1 ? c[0] : c.at(size_t(s)); }

// Moves every rank past its sends and arrived receives to a compute action (listed in `running`,
// its work set in `left`) or a wait (the earliest later arrival in `next_arrival`), sweeping until
// no rank moves: a send late in one sweep may release a receive checked earlier in it.
void advance(const Schedule& schedule, int pp, const SimCosts& work, double now, std::vector<size_t>& pos,
             std::vector<double>& left, std::map<Key, double>& arrival, std::vector<int>& running,
             double& next_arrival) {
  for (bool moved = true; moved;) {
    moved = false;
    running.clear();
    next_arrival = std::numeric_limits<double>::infinity();
    for (int r = 0; r < pp; ++r) {
      for (; pos[r] < schedule[r].size(); ++pos[r], moved = true) {
        const Action& a = schedule[r][pos[r]];
        if (a.type == ActionType::SendForward || a.type == ActionType::SendBackward) {
          arrival.emplace(key_of(a, pp, r), now + work.p2p_latency);
        } else if (a.type == ActionType::RecvForward || a.type == ActionType::RecvBackward) {
          auto it = arrival.find(key_of(a, pp, r));
          if (it != arrival.end() && it->second <= now) continue;
          if (it != arrival.end()) next_arrival = std::min(next_arrival, it->second);
          break;
        } else {
          if (left[r] < 0)
            left[r] = cost(a.type == ActionType::Forward ? work.forward : work.backward, virtual_stage(pp, r, a.chunk));
          running.push_back(r);
          break;
        }
      }
    }
  }
}

}  // namespace

SimResult simulate_shared(const Schedule& schedule, int pp, int vpp, const SimCosts& work, int copies, int cores) {
  MPIGPT_CHECK(copies >= 1 && cores >= 1 && int(schedule.size()) == pp, "simulate_shared: copies {} cores {} pp {}",
               copies, cores, pp);
  constexpr double inf = std::numeric_limits<double>::infinity();
  SimResult res;
  res.busy.assign(pp, 0.0), res.finish.assign(pp, 0.0), res.peak_in_flight.assign(pp, 0);
  std::vector<size_t> pos(pp, 0);
  std::vector<double> left(pp, -1.0);  // work left of the compute action at pos (-1: not started)
  std::map<Key, double> arrival;
  double now = 0;
  for (;;) {
    std::vector<int> running;
    double next_arrival = inf;
    bool pending = false;
    advance(schedule, pp, work, now, pos, left, arrival, running, next_arrival);
    for (int r = 0; r < pp; ++r) pending = pending || pos[r] < schedule[r].size();
    if (!pending) break;
    if (running.empty() && next_arrival == inf) {
      res.deadlock = true;
      res.errors.push_back("simulate_shared: deadlock (a receive whose message is never sent)");
      break;
    }
    const int working = copies * int(running.size());
    const double rate = std::min(1.0, busy_cores(working, copies * pp - working, cores) / working);
    double dt = next_arrival - now;
    for (int r : running) dt = std::min(dt, left[r] / rate);
    now += dt;
    for (int r : running) {
      left[r] -= dt * rate;
      if (left[r] > 1e-15) continue;
      const Action& a = schedule[r][pos[r]];
      res.busy[r] += cost(a.type == ActionType::Forward ? work.forward : work.backward, virtual_stage(pp, r, a.chunk));
      left[r] = -1.0;
      ++pos[r];
      res.finish[r] = now;  // its last compute so far (sends after it take no time)
    }
  }
  res.makespan = *std::max_element(res.finish.begin(), res.finish.end());
  // Without idling: the busiest rank's work, or all work spread over the cores if that is more.
  double all = 0;
  for (double b : res.busy) all += b * copies;
  res.ideal = std::max(*std::max_element(res.busy.begin(), res.busy.end()), all / cores);
  res.bubble = res.ideal > 0 ? (res.makespan - res.ideal) / res.ideal : 0.0;
  return res;
}

double shared_makespan(std::vector<double> work, int cores) {
  MPIGPT_CHECK(cores >= 1, "shared_makespan: {} cores", cores);
  std::sort(work.begin(), work.end());
  double now = 0, done = 0;  // work each remaining task has received
  const int n = int(work.size());
  for (int i = 0; i < n; ++i) {
    const double rate = std::min(1.0, busy_cores(n - i, i, cores) / (n - i));
    now += (work[size_t(i)] - done) / rate;
    done = work[size_t(i)];
  }
  return now;
}

double busy_cores(int working, int waiting, int cores) {
  MPIGPT_CHECK(working >= 0 && waiting >= 0 && cores >= 1, "busy_cores: {} working, {} waiting, {} cores", working,
               waiting, cores);
  const int n = working + waiting;
  if (working == 0 || n <= cores) return std::min(working, cores);
  // A core with m places holds no working rank with probability prod_{j<m} (waiting-j)/(n-j); the
  // places per core, n / cores, are interpolated between the whole numbers around them.
  auto idle = [&](int m) {
    double p = 1;
    for (int j = 0; j < m; ++j) p *= std::max(0.0, double(waiting - j) / double(n - j));
    return p;
  };
  const double per = double(n) / cores;
  const int lo = int(per);
  const double p = idle(lo) + (per - lo) * (idle(lo + 1) - idle(lo));
  return std::min(double(working), cores * (1 - p));
}

}  // namespace mpigpt
