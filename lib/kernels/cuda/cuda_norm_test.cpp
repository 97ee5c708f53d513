// GPU tests (label gpu) of the CUDA backend's LayerNorm and RMSNorm against the CPU backend on random
// inputs, f32 and bf16 data, forward and backward, on shapes for the 16-byte-pack and scalar paths and
// C = 8192 (whose LayerNorm partial sums need more than the default 48 KiB of shared memory).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

const DType kDtypes[] = {DType::F32, DType::BF16};

// Tolerances. The GPU keeps row statistics in fp32 where the CPU uses double: mean and rstd agree
// to ~1e-6 relative (fp32 sums of up to 8192 terms in a tree), so outputs and dinp (O(1) values,
// O(4) terms) are held to 1e-5 absolute + 1e-5 relative in f32; bf16 outputs add their final
// rounding, u = 2^-8 relative (2u allowed). The weight gradients sum N rows in fp32 per block and
// then over blocks: bounded by (sum depth) * 2^-24 * sum |terms| per column; 2e-6 * sum |terms| is
// that bound for depths up to ~30, well above the realistic error.
double rtol_for(DType dt) { return dt == DType::BF16 ? 2 * kBf16U : 1e-5; }
std::vector<float> in_dtype(std::vector<float> v, DType dt) {
  return dt == DType::BF16 ? rounded_bf16(std::move(v)) : v;
}
void check_close(const std::vector<float>& got, const std::vector<float>& want, double atol, double rtol,
                 const char* what) {
  const auto r = allclose(got, want, atol, rtol);
  CHECK_MESSAGE(r.ok, what, ": ", r.str());
}

// Which backward outputs a case asks for.
struct Wanted {
  bool dinp, dweight, dbias;
};

// One norm case: forward against the CPU, then the backward with each combination of outputs,
// all accumulating onto nonzero initial values. layer: LayerNorm (else RMSNorm).
void norm_case(Ops& gpu, Ops& cpu, bool layer, DType dt, int64_t N, int64_t C, uint64_t seed) {
  CAPTURE(layer);
  const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
  CAPTURE(dtype);
  CAPTURE(N);
  CAPTURE(C);
  const float eps = 1e-5f;
  auto x = in_dtype(random_normal(size_t(N * C), seed, 0, 2.0f, 3.0f), dt);  // mean 3: centring matters
  auto w = in_dtype(random_normal(size_t(C), seed, 1, 0.5f, 1.0f), dt);
  auto b = in_dtype(random_normal(size_t(C), seed, 2), dt);
  std::vector<float> out(static_cast<size_t>(N * C)), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
  if (layer)
    cpu.layernorm_forward(as_tensor(out, {N, C}), as_tensor(mean, {N}), as_tensor(rstd, {N}), as_tensor(x, {N, C}),
                          as_tensor(w, {C}), as_tensor(b, {C}), eps);
  else
    cpu.rmsnorm_forward(as_tensor(out, {N, C}), as_tensor(rstd, {N}), as_tensor(x, {N, C}), as_tensor(w, {C}), eps);

  auto gx = to_device(gpu, x, {N, C}, dt), gw = to_device(gpu, w, {C}, dt), gb = to_device(gpu, b, {C}, dt);
  auto gout = zeros(gpu, {N, C}, dt), gmean = zeros(gpu, {N}), grstd = zeros(gpu, {N});
  if (layer)
    gpu.layernorm_forward(gout.t, gmean.t, grstd.t, gx.t, gw.t, gb.t, eps);
  else
    gpu.rmsnorm_forward(gout.t, grstd.t, gx.t, gw.t, eps);
  check_close(to_host(gpu, gout.t), out, 1e-5, rtol_for(dt), "out");
  if (layer) check_close(to_host(gpu, gmean.t), mean, 1e-5, 1e-5, "mean");
  check_close(to_host(gpu, grstd.t), rstd, 1e-6, 1e-5, "rstd");

  // Backward from the CPU's statistics on both sides, so that only the backward is compared.
  const auto dout = in_dtype(random_normal(size_t(N * C), seed, 3), dt);
  const auto dinp0 = in_dtype(random_normal(size_t(N * C), seed, 4), dt);
  const auto dw0 = random_normal(size_t(C), seed, 5), db0 = random_normal(size_t(C), seed, 6);
  std::vector<double> colmag(static_cast<size_t>(C), 0.0);  // sum over rows of |dout * xhat| + |dout|
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      const double g = dout[size_t(n * C + c)];
      const double xh = (x[size_t(n * C + c)] - (layer ? mean[size_t(n)] : 0.0f)) * rstd[size_t(n)];
      colmag[size_t(c)] += std::abs(g * xh) + std::abs(g);
    }
  double maxmag = 0.0;
  for (double m : colmag) maxmag = std::max(maxmag, m);
  auto g_dout = to_device(gpu, dout, {N, C}, dt), g_mean = to_device(gpu, mean, {N}),
       g_rstd = to_device(gpu, rstd, {N});
  for (Wanted k :
       {Wanted{true, true, true}, Wanted{true, false, false}, Wanted{false, true, true}, Wanted{false, true, false}}) {
    CAPTURE(k.dinp);
    CAPTURE(k.dweight);
    CAPTURE(k.dbias);
    auto dinp = dinp0, dw = dw0, db = db0, dout_h = dout, w_h = w, x_h = x;
    auto g_dinp = to_device(gpu, dinp0, {N, C}, dt), g_dw = to_device(gpu, dw0, {C}), g_db = to_device(gpu, db0, {C});
    const Tensor c_dinp = k.dinp ? as_tensor(dinp, {N, C}) : Tensor(), c_dw = k.dweight ? as_tensor(dw, {C}) : Tensor(),
                 c_db = k.dbias ? as_tensor(db, {C}) : Tensor();
    const Tensor d_dinp = k.dinp ? g_dinp.t : Tensor(), d_dw = k.dweight ? g_dw.t : Tensor(),
                 d_db = k.dbias ? g_db.t : Tensor();
    if (layer) {
      cpu.layernorm_backward(c_dinp, c_dw, c_db, as_tensor(dout_h, {N, C}), as_tensor(x_h, {N, C}),
                             as_tensor(mean, {N}), as_tensor(rstd, {N}), as_tensor(w_h, {C}));
      gpu.layernorm_backward(d_dinp, d_dw, d_db, g_dout.t, gx.t, g_mean.t, g_rstd.t, gw.t);
    } else {
      cpu.rmsnorm_backward(c_dinp, c_dw, as_tensor(dout_h, {N, C}), as_tensor(x_h, {N, C}), as_tensor(rstd, {N}),
                           as_tensor(w_h, {C}));
      gpu.rmsnorm_backward(d_dinp, d_dw, g_dout.t, gx.t, g_rstd.t, gw.t);
    }
    // Outputs not asked for keep their initial values (the CPU leaves them too).
    check_close(to_host(gpu, g_dinp.t), dinp, 1e-5, rtol_for(dt), "dinp");
    const auto got_dw = to_host(gpu, g_dw.t);
    check_close(got_dw, dw, 2e-6 * maxmag, 1e-5, "dweight");
    if (layer) check_close(to_host(gpu, g_db.t), db, 2e-6 * maxmag, 1e-5, "dbias");
    if (k.dweight) {  // the partial sums are combined in a fixed order: the same bits again
      auto g_dw2 = to_device(gpu, dw0, {C});
      if (layer)
        gpu.layernorm_backward(Tensor(), g_dw2.t, Tensor(), g_dout.t, gx.t, g_mean.t, g_rstd.t, gw.t);
      else
        gpu.rmsnorm_backward(Tensor(), g_dw2.t, g_dout.t, gx.t, g_rstd.t, gw.t);
      CHECK(to_host(gpu, g_dw2.t) == got_dw);
    }
  }
}

struct Dims {
  int64_t N, C;
};
// 64: packs for both dtypes; 13: scalar; 100: f32 packs, bf16 scalar; 300 rows: several rows per
// block in the backward (each prefetching the next) and the weight gradients' partial sums added
// in two stages; 8192: > 48 KiB of LayerNorm partial sums per block and 2 (bf16) or 4 (f32) packs
// per thread; 16384: 4 (bf16) or 8 (f32, no prefetch) packs per thread.
const Dims kDims[] = {{37, 64}, {37, 13}, {300, 100}, {8, 8192}, {3, 16384}};

}  // namespace

TEST_CASE("cuda layernorm forward/backward match the CPU") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  uint64_t seed = 400;
  for (DType dt : kDtypes)
    for (Dims d : kDims) norm_case(*ops, *cpu, true, dt, d.N, d.C, ++seed);
}

TEST_CASE("cuda rmsnorm forward/backward match the CPU") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  uint64_t seed = 500;
  for (DType dt : kDtypes)
    for (Dims d : kDims) norm_case(*ops, *cpu, false, dt, d.N, d.C, ++seed);
}

TEST_CASE("cuda norm backward refuses a row wider than one block holds") {
  auto ops = cuda_ops_or_skip();
  const int64_t C = 16388;  // f32: 4097 packs of 4, one more than 512 threads x 8 packs
  auto x = zeros(*ops, {2, C}), g = zeros(*ops, {2, C}), w = zeros(*ops, {C}), rstd = zeros(*ops, {2});
  CHECK_THROWS_WITH_AS(ops->rmsnorm_backward(g.t, Tensor(), g.t, x.t, rstd.t, w.t),
                       doctest::Contains("rmsnorm_backward: C = 16388 is more than the CUDA norm backward holds"),
                       Error);
}
