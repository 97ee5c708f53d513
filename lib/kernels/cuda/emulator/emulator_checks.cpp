// Checks of the host emulator's model of Hopper's asynchronous warpgroup products (docs/testing.md;
// emu::wgmma_issue in cuda_runtime.h): one 128-thread block uses cuda_wgmma.cuh as the attention
// kernels do, correctly (`ok`) or with one ordering mistake that a GPU would turn into wrong
// results or none, which the emulator must stop with its message. CTest (cmake/cuda_emulator.cmake)
// matches each mode's output: `ok` prints "emulator wgmma checks: ok" after checking the products'
// values, the groups of wait_group and the NaN of accumulators in flight; every other mode must
// abort with the emulator's message for its mistake.
//
// Usage: mpigpt_emulator_checks ok|no_fence|no_proxy_fence|overwritten|not_retired
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_wgmma.cuh"

namespace {

using mpigpt::cuda::bf16;
namespace wg = mpigpt::cuda::wg;

constexpr int M = 64, N = 32, K = 16;

// Small integers: every product and sum below is exact in fp32.
float a_at(int m, int k) { return float((m * 3 + k * 5) % 7 - 3); }
float b_at(int n, int k) { return float((n * 5 + k * 3) % 9 - 4); }
float exact(int m, int n) {
  float s = 0.f;
  for (int k = 0; k < K; ++k) s += a_at(m, k) * b_at(n, k);
  return s;
}

int failures = 0;
void expect(bool ok, const char* what, int thread) {
  if (!ok && failures++ < 5) std::printf("emulator wgmma checks: thread %d: %s\n", thread, what);
}

// This thread's accumulator (m64n32, cuda_wgmma.cuh's layout) equals times x A B^T.
void expect_product(const float (&d)[N / 8][4], float times, const char* what) {
  const int w = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  bool ok = true;
  for (int j = 0; j < N / 8; ++j)
    for (int i = 0; i < 4; ++i)
      ok = ok && d[j][i] == times * exact(16 * w + g + 8 * (i >> 1), 8 * j + 2 * t + (i & 1));
  expect(ok, what, int(threadIdx.x));
}
bool all_nan(const float (&d)[N / 8][4]) {
  bool nan = true;
  for (int j = 0; j < N / 8; ++j)
    for (int i = 0; i < 4; ++i) nan = nan && std::isnan(d[j][i]);
  return nan;
}

void block(const std::string& mode, const bf16* a, const bf16* b) {
  bf16* As = reinterpret_cast<bf16*>(emu::dyn_smem());  // 64 x 16, canonical
  bf16* Bs = As + M * K;                                 // 32 x 16, canonical
  wg::load_tile_async<K, M, 128>(As, a, K, 0, M);
  wg::load_tile_async<K, N, 128>(Bs, b, K, 0, N);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  if (mode != "no_proxy_fence") wg::proxy_fence();
  __syncthreads();

  float d1[N / 8][4] = {}, d2[N / 8][4] = {};
  if (mode != "no_fence") wg::fence();
  // Group 1: d1 = A B^T twice over (a chain onto the same accumulators, the second adding onto the
  // first's result in flight). Group 2: d2 = A B^T with A from registers.
  wg::Wgmma<N>::ss<0>(d1, wg::desc_k<K>(As, 0), wg::desc_k<K>(Bs, 0), 0);
  wg::Wgmma<N>::ss<0>(d1, wg::desc_k<K>(As, 0), wg::desc_k<K>(Bs, 0), 1);
  wg::commit();
  uint32_t ar[1][4];
  wg::load_a_regs<K, 1>(ar, As, 16 * (int(threadIdx.x) / 32));
  wg::Wgmma<N>::rs<0>(d2, ar[0], wg::desc_k<K>(Bs, 0), 0);
  wg::commit();
  expect(all_nan(d1) && all_nan(d2), "accumulators in flight do not read NaN", int(threadIdx.x));
  if (mode == "overwritten") {  // B refilled before the products are retired
    __syncthreads();
    if (threadIdx.x == 0) Bs[0] = __float2bfloat16_rn(1.f);
    __syncthreads();
  }
  if (mode == "not_retired") return;
  wg::wait<1>();  // group 1 retired, group 2 still in flight
  expect_product(d1, 2.f, "the chained products' sum is wrong after wait_group 1");
  expect(all_nan(d2), "the product of the later group reads other than NaN after wait_group 1", int(threadIdx.x));
  wg::wait<0>();
  expect_product(d2, 1.f, "the register-A product is wrong after wait_group 0");
}

int run(const std::string& mode) {
  std::vector<bf16> a(M * K), b(N * K);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) a[m * K + k] = __float2bfloat16_rn(a_at(m, k));
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) b[n * K + k] = __float2bfloat16_rn(b_at(n, k));
  static int kernel_id;
  emu::launch(&kernel_id, dim3(1), dim3(128), size_t(M + N) * K * sizeof(bf16), nullptr,
              [&] { block(mode, a.data(), b.data()); });
  if (failures > 0) return 1;
  std::printf("emulator wgmma checks: %s\n", mode == "ok" ? "ok" : "the emulator let the mistake pass");
  return mode == "ok" ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "ok" && mode != "no_fence" && mode != "no_proxy_fence" && mode != "overwritten" &&
      mode != "not_retired") {
    std::fprintf(stderr, "usage: %s ok|no_fence|no_proxy_fence|overwritten|not_retired\n", argv[0]);
    return 2;
  }
  if (mode == "ok") return run(mode);
  // A mistake: the emulator must abort; a child process makes the mistake, so that its abort is
  // this program's expected outcome (its message, on the shared stderr, is what CTest matches).
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child == 0) std::_Exit(run(mode));
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child) {
    std::perror("emulator wgmma checks: fork/waitpid");
    return 1;
  }
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT) {
    std::printf("emulator wgmma checks: %s stopped by the emulator, as it must be\n", mode.c_str());
    return 0;
  }
  std::printf("emulator wgmma checks: %s was not stopped by the emulator\n", mode.c_str());
  return 1;
}
