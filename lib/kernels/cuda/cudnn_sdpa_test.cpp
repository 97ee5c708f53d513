// Tests of cuDNN's fused attention (engine.attention_backend). Without a GPU: the graphs finalize and
// device-less planning compiles them for an H100/H200. With one: the causal ops through cuDNN against
// the CPU backend. Everywhere: an explicit cudnn it cannot honour is an error naming why.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>
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
using Backend = CudaOptions::Attention;

// Whether cuDNN can be loaded here; says why not when it cannot.
bool have_cudnn() {
  const std::string why = cuda::cudnn_sdpa_unavailable();
  if (!why.empty()) MESSAGE("no cuDNN: " << why);
  return why.empty();
}

cuda::SdpaShape shape_of(const Geometry& g) { return {g.B, g.T, g.NH, g.NKV, g.HD}; }

// cuDNN compiles its fused attention kernels with NVRTC and loads them through the CUDA driver
// (libcuda.so.1). On a machine without the driver, the toolkit's stub of it (the same soname, every
// call failing) lets cuDNN's device-less planning run up to that loading: loaded here first, it is
// the library cuDNN's own dlopen of libcuda.so.1 finds. Empty when NVRTC and either load, else
// what is missing.
std::string cudnn_compiler_missing() {
  bool nvrtc = false;
  for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"})
    nvrtc = nvrtc || dlopen(name, RTLD_LAZY | RTLD_GLOBAL) != nullptr;
  if (!nvrtc) return "NVRTC (libnvrtc.so) does not load";
  if (dlopen("libcuda.so.1", RTLD_LAZY | RTLD_GLOBAL)) return "";
#ifdef MPIGPT_CUDA_DRIVER_STUB
  if (dlopen(MPIGPT_CUDA_DRIVER_STUB, RTLD_LAZY | RTLD_GLOBAL)) return "";
#endif
  return "neither the CUDA driver nor the toolkit's stub of it (stubs/libcuda.so) loads";
}

// A Hopper GPU (sm_90, 132 multiprocessors, as the H100 SXM and the H200) in cuDNN's device
// description format; name and memory as the device reports them.
std::string hopper_json(const std::string& name, int64_t memory) {
  return R"({"maxGridSize":[2147483647,65535,65535],"maxBlockSize":[1024,1024,64],"regsPerBlock":65536,)"
         R"("multiProcessorCount":132,"warpSize":32,"maxSharedMemoryPerBlock":49152,)"
         R"("maxSharedMemoryPerBlockOptin":232448,"reservedSharedMemoryPerBlock":1024,"maxRegistersPerSM":65536,)"
         R"("maxCtasPerSM":32,"maxThreadsPerBlock":1024,"maxThreadsPerSM":2048,"pciDeviceId":0,"isTccDriver":0,)"
         R"("supportCoopLaunch":1,"totalGlobalMem":)" +
         std::to_string(memory) +
         R"(,"smClockRateKHz":1980000,"memClockRateKHz":2619000,"l2CacheSize":52428800,"cudaDeviceId":0,)"
         R"("deviceVer":900,"driverVer":13000,"deviceName":")" +
         name + R"("})";
}

// The shapes of the numerical tests: plain heads and grouped-query heads, HD 64 and 128, B > 1,
// T a multiple of 128 (every cuDNN 9 runs these) and not (only cuDNN newer than 9.15.0).
const std::vector<Geometry> kShapes = {
    {2, 128, 4, 4, 64}, {1, 256, 8, 2, 128}, {2, 384, 6, 3, 64}, {2, 200, 4, 2, 64}, {1, 77, 2, 2, 128},
};

}  // namespace

TEST_CASE("cudnn attention graphs: cuDNN's fused attention engines take and compile them for an H100/H200") {
  if (!have_cudnn()) return;
  if (const std::string missing = cudnn_compiler_missing(); !missing.empty()) {
    MESSAGE(missing << ": cuDNN cannot compile attention kernels here, so its device-less planning was not checked");
    return;
  }
  const std::string version = cuda::cudnn_sdpa_version();
  CAPTURE(version);
  // The benchmark's shapes: GPT-2 124M and 350M (heads of 64), the 1.3B-class model (heads of 128),
  // the Llama-style 1B (32 query heads over 8 kv heads, T 2048), at their configurations' micro-batch;
  // and the largest that scripts/bench_gpu.sh's search may reach on an H200 (it doubles until the
  // memory runs out, up to 1024: 124M with full recompute, 1.3B at 256 with it).
  const std::vector<cuda::SdpaShape> shapes = {{64, 1024, 12, 12, 64}, {64, 1024, 16, 16, 64},
                                               {64, 1024, 16, 16, 128}, {32, 2048, 32, 8, 64},
                                               {1024, 1024, 12, 12, 64}, {256, 1024, 16, 16, 128}};
  for (const auto& [device, json] :
       {std::pair<std::string, std::string>{"H100 SXM", hopper_json("NVIDIA H100 80GB HBM3", 85520809984)},
        std::pair<std::string, std::string>{"H200", hopper_json("NVIDIA H200", 150754820096)}}) {
    CAPTURE(device);
    for (const cuda::SdpaShape& s : shapes) {
      CAPTURE(s.B);
      CAPTURE(s.T);
      CAPTURE(s.NH);
      CAPTURE(s.NKV);
      CAPTURE(s.HD);
      const cuda::SdpaPlans plans = cuda::cudnn_sdpa_plan_for_device(s, json);
      for (const auto& [pass, info] : {std::pair<std::string, cuda::SdpaPlanInfo>{"forward", plans.forward},
                                       std::pair<std::string, cuda::SdpaPlanInfo>{"backward", plans.backward}}) {
        CAPTURE(pass);
        std::string rejected;
        for (const std::string& r : info.rejected) rejected += "\n  " + r;
        CAPTURE(rejected);
        // The heuristics recognised the graph as fused attention: they offer configurations of its
        // engines, which pass their support checks for this device.
        CHECK(info.offered >= 1);
        if (info.chosen >= 0) continue;  // planned outright: this machine has a CUDA driver
        // No driver: every configuration's kernels compiled, and failed only to load.
        CHECK(info.built == info.offered);
      }
    }
  }
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
    cuda_ops.set_attention(Backend::Default);
    const std::string kernels = ops->attention_kernels(g.B, g.T, g.NH, g.NKV, g.HD, DType::BF16);
    CAPTURE(kernels);
    if (!runs) {
      MESSAGE("cuDNN does not run this shape (" << why << "); the default takes the builtin kernels");
      CHECK(kernels.find("the builtin kernels") == 0);
      compare(g, DType::BF16, *ops, *cpu);
      continue;
    }
    CHECK(kernels.find(version + " fused attention, forward engine ") == 0);
    std::string pass = "both passes on cuDNN";
    CAPTURE(pass);
    cuda_ops.set_attention(Backend::Cudnn);
    compare(g, DType::BF16, *ops, *cpu);
    pass = "cuDNN forward, builtin backward";
    compare(g, DType::BF16, *ops, *cpu, [&] { cuda_ops.set_attention(Backend::Builtin); });
    pass = "builtin forward, cuDNN backward";
    cuda_ops.set_attention(Backend::Builtin);
    compare(g, DType::BF16, *ops, *cpu, [&] { cuda_ops.set_attention(Backend::Cudnn); });
  }
}

TEST_CASE("cudnn attention: an explicit cudnn it cannot honour is an error, the default runs the builtin kernels") {
  const bool cudnn = have_cudnn();
  if (cudnn && cuda::device_count() == 0) {
    MESSAGE("no CUDA device: the cuDNN attention error checks did not run");
    return;
  }
  auto ops = cuda_ops_or_skip();
  auto& cuda_ops = dynamic_cast<CudaOps&>(*ops);
  auto cpu = make_cpu_ops();
  const auto refused = [&](const Geometry& g, DType dt, const std::string& why) {
    CAPTURE(g.HD);
    cuda_ops.set_attention(Backend::Cudnn);
    auto qkv = zeros(*ops, {g.B, g.T, g.R()}, dt);
    auto out = zeros(*ops, {g.B, g.T, g.C()}, dt);
    auto saved = zeros(*ops, {g.B * g.NH * g.T});
    const std::string want = "attention_forward: engine.attention_backend = cudnn, but " + why;
    CHECK_THROWS_WITH_AS(ops->attention_forward(out.t, saved.t, qkv.t, g.NH, g.NKV, g.HD),
                         doctest::Contains(want.c_str()), Error);
    CHECK_THROWS_WITH_AS((void)ops->attention_kernels(g.B, g.T, g.NH, g.NKV, g.HD, dt), doctest::Contains(why.c_str()),
                         Error);
    cuda_ops.set_attention(Backend::Default);
    const std::string kernels = ops->attention_kernels(g.B, g.T, g.NH, g.NKV, g.HD, dt);
    CHECK(kernels.find("the builtin ") == 0);
    CHECK(kernels.find(why) != std::string::npos);
    compare(g, dt, *ops, *cpu);
  };
  // f32 data: cuDNN's fused attention takes 16-bit data.
  refused({1, 128, 2, 2, 64}, DType::F32, "cuDNN's fused attention takes bf16 data and this run's is f32");
  // bf16 with a head dim cuDNN does not take (not a multiple of 8), or with no cuDNN at all.
  refused({1, 128, 2, 1, 48 + 4}, DType::BF16,
          cudnn ? "cuDNN cannot run attention with B 1 T 128 heads 2/1 head dim 52" : cuda::cudnn_sdpa_unavailable());
  // The builtin setting never asks cuDNN.
  cuda_ops.set_attention(Backend::Builtin);
  CHECK(ops->attention_kernels(1, 128, 2, 2, 64, DType::BF16).find("(engine.attention_backend = builtin)") !=
        std::string::npos);
}

#else

TEST_CASE("cudnn attention: built without the CUDA backend") {
  MESSAGE("built without the CUDA backend: skipped");
  std::exit(77);
}

#endif
