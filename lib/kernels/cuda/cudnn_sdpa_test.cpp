// Tests of cuDNN's fused attention (engine.attention_backend = cudnn | auto). Without a GPU: every
// operation of the forward and backward graphs finalizes in cuDNN (which checks attributes, shapes
// and dtypes). With one: the causal ops through cuDNN against the CPU backend in bf16, its saved
// log-sum-exp against the reference, each pass paired with the builtin kernels' other pass (the
// saved state is the same), and the errors of an explicit cudnn request it cannot honour. Without
// cuDNN (the host emulator has none), that cudnn is an error naming it and auto runs the builtin
// kernels.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "lib/core/error.h"
#include "lib/kernels/cuda/cuda_attention_testing.h"
#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/ops.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/cuda_ops.h"
#include "lib/kernels/cuda/cudnn_sdpa.h"
#include "lib/kernels/cuda/device.h"
#endif

using namespace mpigpt;
using namespace mpigpt::testing;

#ifdef MPIGPT_WITH_CUDA
namespace {

using cuda::CudaOps;
using Backend = CudaOps::AttentionBackend;

// Whether cuDNN can be loaded here; says why not when it cannot.
bool have_cudnn() {
  const std::string why = cuda::cudnn_sdpa_unavailable();
  if (!why.empty()) MESSAGE("no cuDNN: " << why);
  return why.empty();
}

cuda::SdpaShape shape_of(const Geometry& g) { return {g.B, g.T, g.NH, g.NKV, g.HD}; }

// The shapes of the numerical tests: plain heads and grouped-query heads, HD 64 and 128, B > 1,
// T a multiple of 128 (every cuDNN 9 runs these) and not (only cuDNN newer than 9.15.0).
const std::vector<Geometry> kShapes = {
    {2, 128, 4, 4, 64}, {1, 256, 8, 2, 128}, {2, 384, 6, 3, 64}, {2, 200, 4, 2, 64}, {1, 77, 2, 2, 128},
};

}  // namespace

TEST_CASE("cudnn attention graphs: every operation of the forward and backward finalizes (no GPU needed)") {
  if (!have_cudnn()) return;
  // GPT-2 124M's shape (plain heads) and a Llama-style one (grouped-query heads, HD 128): the
  // backward has two more operations (the dK and dV group sums) with grouped-query heads.
  const auto mha = cuda::cudnn_sdpa_finalize_operations({8, 1024, 12, 12, 64});
  CHECK(mha.forward == 14);
  CHECK(mha.backward == 22);
  const auto gqa = cuda::cudnn_sdpa_finalize_operations({2, 2048, 32, 8, 128});
  CHECK(gqa.forward == 14);
  CHECK(gqa.backward == 24);
}

TEST_CASE("cudnn attention forward and backward match the CPU backend (bf16)") {
  if (!have_cudnn()) return;
  if (cuda::device_count() == 0) {
    MESSAGE("no CUDA device: the numerical cuDNN attention checks did not run");
    return;
  }
  auto ops = cuda_ops_or_skip();
  auto& cuda_ops = dynamic_cast<CudaOps&>(*ops);
  auto cpu = make_cpu_ops();
  cuda::CudnnSdpa probe(ops->stream());
  const std::string version = cuda::cudnn_sdpa_version();  // in every failure's message
  CAPTURE(version);
  for (const Geometry& g : kShapes) {
    CAPTURE(g.B);
    CAPTURE(g.T);
    CAPTURE(g.NH);
    CAPTURE(g.NKV);
    CAPTURE(g.HD);
    std::string why;
    const bool runs = probe.prepare(shape_of(g), &why);
    // Every cuDNN 9 this program accepts runs T a multiple of 128 at these head dims.
    if (g.T % 128 == 0) CHECK_MESSAGE(runs, why);
    if (!runs) {
      MESSAGE("cuDNN does not run this shape (" << why << "); auto takes the builtin kernels");
      cuda_ops.set_attention_backend(Backend::Auto);
      compare(g, DType::BF16, *ops, *cpu);
      continue;
    }
    std::string pass = "both passes on cuDNN";
    CAPTURE(pass);
    cuda_ops.set_attention_backend(Backend::Cudnn);
    compare(g, DType::BF16, *ops, *cpu, {}, false);
    pass = "cuDNN forward, builtin backward";
    compare(g, DType::BF16, *ops, *cpu, [&] { cuda_ops.set_attention_backend(Backend::Builtin); });
    pass = "builtin forward, cuDNN backward";
    cuda_ops.set_attention_backend(Backend::Builtin);
    compare(g, DType::BF16, *ops, *cpu, [&] { cuda_ops.set_attention_backend(Backend::Cudnn); }, false);
  }
}

TEST_CASE("cudnn attention: an explicit cudnn request it cannot honour is an error, auto falls back") {
  const bool cudnn = have_cudnn();
  if (cudnn && cuda::device_count() == 0) {
    MESSAGE("no CUDA device: the cuDNN attention error checks did not run");
    return;
  }
  auto ops = cuda_ops_or_skip();
  auto& cuda_ops = dynamic_cast<CudaOps&>(*ops);
  auto cpu = make_cpu_ops();
  // f32 data: cuDNN's fused attention takes 16-bit data.
  const Geometry g{1, 128, 2, 2, 64};
  auto qkv = zeros(*ops, {g.B, g.T, g.R()});
  auto out = zeros(*ops, {g.B, g.T, g.C()});
  auto saved = zeros(*ops, {g.B * g.NH * g.T});
  cuda_ops.set_attention_backend(Backend::Cudnn);
  CHECK_THROWS_WITH_AS(ops->attention_forward(out.t, saved.t, qkv.t, g.NH, g.NKV, g.HD),
                       doctest::Contains("engine.attention_backend = cudnn runs bf16 data"), Error);
  // bf16 with a head dim cuDNN does not take (not a multiple of 8), or with no cuDNN at all: cudnn
  // names the shape or the missing library; auto runs the builtin kernels and matches the CPU.
  const Geometry odd{1, 128, 2, 1, 48 + 4};
  auto qkv2 = zeros(*ops, {odd.B, odd.T, odd.R()}, DType::BF16);
  auto out2 = zeros(*ops, {odd.B, odd.T, odd.C()}, DType::BF16);
  auto saved2 = zeros(*ops, {odd.B * odd.NH * odd.T});
  CHECK_THROWS_WITH_AS(ops->attention_forward(out2.t, saved2.t, qkv2.t, odd.NH, odd.NKV, odd.HD),
                       doctest::Contains(cudnn ? "cuDNN cannot run attention with B=1 T=128 NH=2 NKV=1 HD=52"
                                               : "engine.attention_backend = cudnn: "),
                       Error);
  cuda_ops.set_attention_backend(Backend::Auto);
  compare(odd, DType::BF16, *ops, *cpu);
  if (!cudnn) compare(g, DType::BF16, *ops, *cpu);  // a shape cuDNN would take: the builtin kernels run it
}

#else

TEST_CASE("cudnn attention: built without the CUDA backend") {
  MESSAGE("built without the CUDA backend: skipped");
  std::exit(77);
}

#endif
