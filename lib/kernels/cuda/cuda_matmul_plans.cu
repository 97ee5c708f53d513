// CUDA backend: the cuBLASLt side of the matrix products (cuda_matmul.cuh): a plan per product
// configuration with cuBLASLt's descriptors and the algorithm chosen for it, and GEMM autotuning.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <vector>

#include "lib/kernels/cuda/cuda_matmul.cuh"

namespace mpigpt::cuda {

// ---- the plan cache ----------------------------------------------------------------------------

namespace {
// Everything the heuristic's answer depends on. Pointer alignments are part of it: cuBLASLt picks
// vectorised kernels only for pointers that allow them (row slices of a grouped matmul do not).
using PlanKey = std::array<int64_t, 18>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool supported = false;  // the heuristic found an algorithm
  bool tuned = false;      // its algorithm was chosen by timing (kept when the cache is full)
};
}  // namespace

struct CudaOps::MatmulPlans {
  // A bound on the cache: the experts' row counts change every step, so grouped matmuls keep
  // meeting new shapes; past the bound the untuned plans go (a heuristic query costs microseconds;
  // a tuned plan, which cost many runs of its product, stays).
  static constexpr size_t kMaxPlans = 4096;
  std::map<PlanKey, Plan> plans;
  void clear(bool keep_tuned = false) {
    // Not CHECKed: this also runs in the destructor, which must not throw; descriptors hold host
    // memory only.
    for (auto it = plans.begin(); it != plans.end();) {
      Plan& p = it->second;
      if (keep_tuned && p.tuned) {
        ++it;
        continue;
      }
      if (p.a) (void)cublasLtMatrixLayoutDestroy(p.a);
      if (p.b) (void)cublasLtMatrixLayoutDestroy(p.b);
      if (p.c) (void)cublasLtMatrixLayoutDestroy(p.c);
      if (p.desc) (void)cublasLtMatmulDescDestroy(p.desc);
      it = plans.erase(it);
    }
  }
  ~MatmulPlans() { clear(); }
};

CudaOps::MatmulPlans& CudaOps::matmul_plans() {
  if (!plans_) plans_ = {new MatmulPlans, [](MatmulPlans* p) { delete p; }};
  return *plans_;
}

size_t CudaOps::gemm_tuned_plans() {
  const auto& plans = matmul_plans().plans;
  return size_t(std::count_if(plans.begin(), plans.end(), [](const auto& kv) { return kv.second.tuned; }));
}

namespace {

cudaDataType_t cuda_type(DType dt) { return dt == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F; }

uint32_t epilogue_of(const LtMatmul& mm) {
  switch (mm.gelu) {
    case Gelu::Forward:
      return mm.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case Gelu::Backward:
      return CUBLASLT_EPILOGUE_DGELU;
    case Gelu::None:
      break;
  }
  return mm.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

// The pointers an epilogue reads or writes, set on the descriptor before the heuristic query (their
// alignment steers it) and again, to the actual pointers, at each call.
void set_epilogue_pointers(cublasLtMatmulDesc_t desc, const LtMatmul& mm) {
  if (mm.bias)
    MPIGPT_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &mm.bias, sizeof(mm.bias)));
  if (mm.aux)
    MPIGPT_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &mm.aux,
                                                 sizeof(mm.aux)));
}

double product_flop(const LtMatmul& mm) { return 2.0 * double(mm.m) * double(mm.n) * double(mm.k); }

// Queues the product with algorithm `algo`, its result to d (mm.C, or a scratch of its layout).
cublasStatus_t launch_matmul(CudaOps& ops, const Plan& p, const LtMatmul& mm, const cublasLtMatmulAlgo_t& algo,
                             void* d) {
  return cublasLtMatmul(ops.cublaslt(), p.desc, &mm.alpha, mm.A, p.a, mm.B, p.b, &mm.beta, mm.Cin ? mm.Cin : mm.C,
                        p.c, d, p.c, &algo, ops.cublaslt_workspace(), CudaOps::kCublasWorkspace, ops.cuda_stream());
}

// The heuristic's candidates that autotuning times (cuBLASLt offers up to 8 for the model's shapes).
constexpr int kTuneCandidates = 8;

// Autotuning: which of the heuristic's candidates runs the product fastest on its own operands.
// Candidate 0 first runs for 50 ms (an idle GPU's clocks ramp up over tens of ms); then 3 rounds
// run every usable candidate `reps` times between two synchronisations, each keeping its best
// round (a drift in clocks reaches every candidate alike). The result D goes to the product's own
// output when nothing is read from it (beta 0, or C read from Cin): the chosen algorithm's run
// overwrites it. An accumulation in place (beta != 0, C = D) writes to a scratch D instead, so the
// real one is added to exactly once. Candidate 0 stays unless another is at least 3% faster:
// near-ties keep the heuristic's choice whatever the timing noise.
int fastest_candidate(CudaOps& ops, const Plan& p, const LtMatmul& mm, const cublasLtMatmulHeuristicResult_t* cand,
                      int found) {
  const bool in_place = mm.beta != 0.0f && !mm.Cin;
  const CudaOps::Scratch out{&ops, in_place ? ops.allocate_uninitialised(size_t(mm.ldc) * size_t(mm.n) *
                                                                           dtype_size(mm.cd))
                                            : nullptr};
  void* const d = in_place ? out.ptr : mm.C;
  const int reps = int(std::clamp(2e11 / product_flop(mm), 2.0, 20.0));
  auto run = [&](int i) { return launch_matmul(ops, p, mm, cand[i].algo, d) == CUBLAS_STATUS_SUCCESS; };
  MPIGPT_CUBLAS(launch_matmul(ops, p, mm, cand[0].algo, d));  // the heuristic's first choice runs: the fallback
  std::vector<bool> usable(size_t(found), false);  // not usable: cannot run here, never chosen
  for (int i = 0; i < found; ++i) usable[size_t(i)] = cand[i].state == CUBLAS_STATUS_SUCCESS && run(i);
  const char* what = "the timing of GEMM candidates";
  wait_for_stream(ops.cuda_stream(), what);
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  for (const auto t0 = Clock::now(); since(t0) < 0.05;) {
    for (int r = 0; r < reps; ++r) run(0);
    wait_for_stream(ops.cuda_stream(), what);
  }
  std::vector<double> best(size_t(found), 0.0);  // seconds per run in the best round; 0: did not run
  for (int round = 0; round < 3; ++round)
    for (int i = 0; i < found; ++i) {
      if (!usable[size_t(i)]) continue;
      const auto start = Clock::now();
      bool ran = true;
      for (int r = 0; r < reps && ran; ++r) ran = run(i);
      wait_for_stream(ops.cuda_stream(), what);
      usable[size_t(i)] = ran;
      const double s = since(start) / reps;
      best[size_t(i)] = !ran ? 0.0 : round == 0 ? s : std::min(best[size_t(i)], s);
    }
  int fastest = 0;
  for (int i = 1; i < found; ++i)
    if (best[size_t(i)] > 0.0 && best[size_t(i)] < best[size_t(fastest)] * (fastest == 0 ? 0.97 : 1.0)) fastest = i;
  return fastest;
}

Plan& plan_for(CudaOps& ops, const LtMatmul& mm) {
  const PlanKey key = {mm.ta,        mm.tb,         mm.m,          mm.n,          mm.k,
                       mm.lda,       mm.ldb,        mm.ldc,        int64_t(mm.ab), int64_t(mm.cd),
                       mm.bias != nullptr, alignment(mm.A), alignment(mm.B), alignment(mm.C),
                       mm.bias ? alignment(mm.bias) : 0, int64_t(mm.gelu), mm.aux ? alignment(mm.aux) : 0,
                       mm.Cin ? alignment(mm.Cin) : 0};
  auto& cache = ops.matmul_plans();
  auto it = cache.plans.find(key);
  if (it != cache.plans.end()) return it->second;
  if (cache.plans.size() >= CudaOps::MatmulPlans::kMaxPlans) cache.clear(true);  // no Plan& is held here
  Plan& p = cache.plans[key];

  // Compute type 32F for every product, f32 data included: no TF32, as the f32 path must match the CPU
  // reference to fp32 rounding.
  MPIGPT_CUBLAS(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t ta = mm.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = mm.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  MPIGPT_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  MPIGPT_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // The bias has D's dtype (the default) and length m, the bias gradient D's dtype and length n; the
  // GELU input matrix (aux) has D's dtype (the default) and leading dimension.
  const uint32_t epi = epilogue_of(mm);
  if (epi != CUBLASLT_EPILOGUE_DEFAULT)
    MPIGPT_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (mm.aux)
    MPIGPT_CUBLAS(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &mm.ldc, sizeof(mm.ldc)));
  set_epilogue_pointers(p.desc, mm);
  // Stored (untransposed) shapes: op(A) is (m,k), so A is (k,m) when transposed.
  MPIGPT_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, cuda_type(mm.ab), uint64_t(mm.ta ? mm.k : mm.m),
                                           uint64_t(mm.ta ? mm.m : mm.k), mm.lda));
  MPIGPT_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, cuda_type(mm.ab), uint64_t(mm.tb ? mm.n : mm.k),
                                           uint64_t(mm.tb ? mm.k : mm.n), mm.ldb));
  MPIGPT_CUBLAS(cublasLtMatrixLayoutCreate(&p.c, cuda_type(mm.cd), uint64_t(mm.m), uint64_t(mm.n), mm.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  MPIGPT_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = CudaOps::kCublasWorkspace;
  const uint32_t al_a = alignment(mm.A), al_b = alignment(mm.B), al_d = alignment(mm.C);
  const uint32_t al_c = mm.Cin ? alignment(mm.Cin) : al_d;
  MPIGPT_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  MPIGPT_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  MPIGPT_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  MPIGPT_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  MPIGPT_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)));
  if (mm.cd == DType::BF16) {
    // Split-K partial sums must be added in fp32, not in the bf16 output (the in-place and
    // output-type schemes would round every partial sum to 8 bits).
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    MPIGPT_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                       sizeof(schemes)));
  }
  // The heuristic's first choice, or with autotuning on a large enough product its candidates.
  const bool tune = ops.gemm_autotune() && product_flop(mm) >= ops.gemm_autotune_min_flop();
  std::array<cublasLtMatmulHeuristicResult_t, kTuneCandidates> cand{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ops.cublaslt(), p.desc, p.a, p.b, p.c, p.c, pref,
                                                           tune ? kTuneCandidates : 1, cand.data(), &found);
  MPIGPT_CUBLAS(cublasLtMatmulPreferenceDestroy(pref));
  if (st != CUBLAS_STATUS_NOT_SUPPORTED) MPIGPT_CUBLAS(st);
  p.supported = st == CUBLAS_STATUS_SUCCESS && found > 0;
  if (!p.supported) return p;
  int chosen = 0;
  if (tune && found > 1) {  // the epilogue's pointers are mm's already (set above)
    chosen = fastest_candidate(ops, p, mm, cand.data(), found);
    p.tuned = true;
  }
  p.algo = cand[size_t(chosen)].algo;
  return p;
}

std::string describe(const LtMatmul& mm) {
  return fmt::format("column-major m={} n={} k={} op(A)={} op(B)={} lda={} ldb={} ldc={} A/B {} C/D {}{}; "
                     "alignment A {} B {} C {}",
                     mm.m, mm.n, mm.k, mm.ta ? "T" : "N", mm.tb ? "T" : "N", mm.lda, mm.ldb, mm.ldc,
                     dtype_name(mm.ab), dtype_name(mm.cd),
                     mm.gelu != Gelu::None ? ", GELU epilogue" : mm.bias ? ", bias epilogue" : "",
                     alignment(mm.A),
                     alignment(mm.B), alignment(mm.C));
}

}  // namespace

bool run_matmul(CudaOps& ops, const LtMatmul& mm, const char* op) {
  Plan& p = plan_for(ops, mm);
  if (!p.supported) {
    if (epilogue_of(mm) != CUBLASLT_EPILOGUE_DEFAULT) return false;
    fail("{}: cuBLASLt offers no algorithm for {}", op, describe(mm));
  }
  set_epilogue_pointers(p.desc, mm);
  MPIGPT_CUBLAS(launch_matmul(ops, p, mm, p.algo, mm.C));
  return true;
}

}  // namespace mpigpt::cuda
