#include "lib/kernels/cuda/cuda_timing.cuh"

#include <algorithm>
#include <chrono>

#include "lib/kernels/cuda/cuda_common.cuh"

namespace mpigpt::cuda {

CandidateTimes time_candidates(cudaStream_t stream, const std::vector<bool>& usable,
                               const std::function<bool(size_t)>& run, double warmup_s, int reps) {
  MPIGPT_CHECK(!usable.empty() && usable[0], "time_candidates: the reference (candidate 0) must be usable");
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  const int warm_reps = std::max(reps, 1);
  int runs = 0;
  const auto t0 = Clock::now();
  do {
    for (int r = 0; r < warm_reps; ++r) run(0);
    wait_for_stream(stream, "the end of a timed run of candidate kernels");
    runs += warm_reps;
  } while (seconds_since(t0) < warmup_s);
  if (reps <= 0) reps = std::clamp(int(0.01 / (seconds_since(t0) / runs)), 2, 20);

  const size_t n = usable.size();
  CandidateTimes t;
  t.seconds.assign(n, 0.0);
  std::vector<bool> running = usable;
  constexpr int kRounds = 3;
  for (int round = 0; round < kRounds; ++round)
    for (size_t i = 0; i < n; ++i) {
      if (!running[i]) continue;
      const auto start = Clock::now();
      bool ran = true;
      for (int r = 0; r < reps && ran; ++r) ran = run(i);
      wait_for_stream(stream, "the end of a timed run of candidate kernels");
      const double s = seconds_since(start) / reps;
      running[i] = ran;
      t.seconds[i] = !ran ? 0.0 : round == 0 ? s : std::min(t.seconds[i], s);
    }
  for (size_t i = 1; i < n; ++i)
    if (t.seconds[i] > 0.0 && t.seconds[i] < t.seconds[t.fastest] * (t.fastest == 0 ? 0.97 : 1.0)) t.fastest = i;
  return t;
}

}  // namespace mpigpt::cuda
