// CUDA backend, private: choosing among interchangeable implementations by timing them on the GPU,
// as the GEMM autotuner (cuda_matmul_plans.cu) and the bias-gradient choice (cuda_matmul.cu) do.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <vector>

namespace mpigpt::cuda {

// Candidate 0 (the reference, which must be usable) runs first for warmup_s seconds: an idle GPU's
// clocks ramp up over tens of ms, and a candidate timed before that would look slower than it is.
// Then 3 rounds run every usable candidate `reps` times between two stream synchronisations (reps
// <= 0: as many as make a round of about 10 ms of the reference, 2 to 20), and each keeps its best
// round, so that a drift in clocks during the rounds reaches every candidate alike. run(i) queues
// candidate i on the stream and says whether it ran; one that does not run is not chosen.
struct CandidateTimes {
  std::vector<double> seconds;  // per run in the best round; 0: not usable, or did not run
  size_t fastest = 0;           // candidate 0 unless another is at least 3% faster
};
CandidateTimes time_candidates(cudaStream_t stream, const std::vector<bool>& usable,
                               const std::function<bool(size_t)>& run, double warmup_s, int reps);

}  // namespace mpigpt::cuda
