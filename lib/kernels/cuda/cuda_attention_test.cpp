// GPU tests of the fused causal attention (CUDA backend) against the CPU backend: forward output,
// the saved log-sum-exp and the backward, in f32 and bf16, over GQA and plain multi-head shapes,
// sequence lengths that are not multiples of the kernels' 64-row tiles, and every head-dim kernel.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_attention_testing.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/cuda_wgmma_check.h"
#endif
#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// An environment switch the CUDA ops read on every call (MPIGPT_ATTENTION_FMA), set
// to "1" or unset by the test and back to what it was when the switch goes out of scope.
class EnvSwitch {
 public:
  explicit EnvSwitch(const char* name) : name_(name) {
    const char* v = std::getenv(name);
    had_ = v != nullptr;
    old_ = had_ ? v : "";
  }
  ~EnvSwitch() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }
  void set(bool on) const {
    if (on)
      setenv(name_, "1", 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_;
  std::string old_;
};

// Random bf16 inputs of the causal ops for geometry g (seeds seed and seed + 1), on the device.
struct Bf16Inputs {
  Shape sqkv, sout;
  std::vector<float> qkv;
  DeviceTensor d_qkv, d_dout;
  int64_t nsaved;
};
Bf16Inputs bf16_inputs(Ops& ops, const Geometry& g, uint64_t seed) {
  Bf16Inputs in{{g.B, g.T, g.R()}, {g.B, g.T, g.C()}, {}, {}, {}, ops.attention_saved_numel(g.B, g.T, g.NH)};
  in.qkv = rounded_bf16(random_normal(size_t(g.B * g.T * g.R()), seed, uint64_t(g.T * 1000 + g.HD)));
  const auto dout = rounded_bf16(random_normal(size_t(g.B * g.T * g.C()), seed + 1, uint64_t(g.T * 1000 + g.HD)));
  in.d_qkv = to_device(ops, in.qkv, in.sqkv, DType::BF16);
  in.d_dout = to_device(ops, dout, in.sout, DType::BF16);
  return in;
}

}  // namespace

TEST_CASE("cuda attention forward and backward match the CPU backend (f32 and bf16)") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  // T = 1; T not a multiple of the 64-row and 32-column tiles; GQA 8/2 and plain 4/4 heads; B > 1;
  // every kernel head dim (16, 32, 64, 80, 96, 128) and padded ones (6: element loads, 48: vector
  // loads into the 64 kernel). In bf16, HD 64 and 128 run the tensor-core forward (GQA 128 included).
  const std::vector<Geometry> shapes = {
      {1, 1, 4, 2, 64},    {2, 37, 8, 2, 64},  {1, 200, 4, 4, 128}, {2, 70, 2, 1, 32}, {1, 130, 4, 2, 80},
      {2, 65, 2, 2, 96},   {2, 33, 4, 1, 16},  {2, 7, 4, 2, 6},     {1, 100, 6, 3, 48},  {1, 150, 4, 2, 128},
  };
  for (DType dt : {DType::F32, DType::BF16})
    for (const Geometry& g : shapes) {
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      CAPTURE(g.B);
      CAPTURE(g.T);
      CAPTURE(g.NH);
      CAPTURE(g.NKV);
      CAPTURE(g.HD);
      compare(g, dt, *ops, *cpu);
    }
}

TEST_CASE("cuda attention bf16: the tensor-core path agrees with the fp32-FMA path (MPIGPT_ATTENTION_FMA)") {
  // For bf16 and HD 64 or 128 the forward and backward run on tensor cores unless
  // MPIGPT_ATTENTION_FMA is set; both paths must agree within the bf16 tolerances on identical
  // inputs, and the saved lse (fp32 in both, from the same bf16 scores) within 1e-4 abs + 1e-5 rel.
  // GQA and plain heads, T off the 64-row tiles, B > 1, T = 1.
  auto ops = cuda_ops_or_skip();
  const EnvSwitch fma_env("MPIGPT_ATTENTION_FMA");
  const std::vector<Geometry> shapes = {
      {2, 130, 4, 2, 64}, {1, 100, 4, 1, 128}, {1, 64, 2, 2, 64}, {2, 1, 2, 1, 128}, {1, 257, 2, 1, 128},
  };
  for (const Geometry& g : shapes) {
    CAPTURE(g.B);
    CAPTURE(g.T);
    CAPTURE(g.NH);
    CAPTURE(g.NKV);
    CAPTURE(g.HD);
    const Bf16Inputs in = bf16_inputs(*ops, g, 303);
    std::vector<float> outs[2], lses[2], grads[2];
    for (int fma = 0; fma < 2; ++fma) {
      fma_env.set(fma);
      auto d_out = to_device(*ops, std::vector<float>(size_t(in.sout.numel()), kNaN), in.sout, DType::BF16);
      auto d_saved = to_device(*ops, std::vector<float>(size_t(in.nsaved), kNaN), {in.nsaved});
      ops->attention_forward(d_out.t, d_saved.t, in.d_qkv.t, g.NH, g.NKV, g.HD);
      auto d_dqkv = to_device(*ops, std::vector<float>(in.qkv.size(), kNaN), in.sqkv, DType::BF16);
      ops->attention_backward(d_dqkv.t, in.d_dout.t, in.d_qkv.t, d_out.t, d_saved.t, g.NH, g.NKV, g.HD);
      outs[fma] = to_host(*ops, d_out.t);
      lses[fma] = to_host(*ops, d_saved.t);
      grads[fma] = to_host(*ops, d_dqkv.t);
    }
    const Tolerance tol = tolerance(DType::BF16);
    auto r = allclose(outs[0], outs[1], tol.out, tol.out);
    CHECK_MESSAGE(r.ok, "out: ", r.str());
    r = allclose(lses[0], lses[1], 1e-4, 1e-5);
    CHECK_MESSAGE(r.ok, "lse: ", r.str());
    r = allclose(grads[0], grads[1], tol.grad, tol.grad);
    CHECK_MESSAGE(r.ok, "dqkv: ", r.str());
    // Informational: bitwise-equal outputs would mean both runs took the same (FMA) path.
    if (g.T > 1)
      WARN_MESSAGE(outs[0] != outs[1], "tensor-core and FMA outputs are bitwise equal: is the tensor-core path on?");
  }
}

TEST_CASE("cuda attention bf16: the Hopper (wgmma) kernels match the CPU backend (attention_backend = wgmma)") {
  // With engine.attention_backend = wgmma, the causal bf16 forward and backward at HD 64 and 128 run on
  // warpgroup products (cuda_attention_wg_*_sm90a.cu) on GPUs that run sm_90a code. Same checks as
  // the other paths: forward and backward against the CPU within the bf16 tolerances, and a rerun
  // of the backward bitwise equal. GQA and plain heads, T off the 128-query blocks, 64-row tiles
  // and 32-query tiles of HD 128, B > 1, T = 1, and kv heads whose group spans several query heads.
  auto ops = cuda_ops_or_skip();
#ifdef MPIGPT_WITH_CUDA
  if (!cuda::attention_wgmma_available()) {
    MESSAGE("this GPU does not run sm_90a code (wgmma): nothing to check");
    return;
  }
  dynamic_cast<cuda::CudaOps&>(*ops).set_attention_backend(cuda::CudaOps::AttentionBackend::Wgmma);
#endif
  auto cpu = make_cpu_ops();
  const EnvSwitch two_env("MPIGPT_ATTENTION_WG_TWO_BUFFERS");
  const std::vector<Geometry> shapes = {
      {2, 130, 4, 2, 64}, {1, 100, 4, 1, 128}, {1, 64, 2, 2, 64}, {2, 1, 2, 1, 128}, {1, 257, 2, 1, 128},
      {1, 200, 8, 2, 64}, {1, 300, 2, 2, 128},
  };
  for (const Geometry& g : shapes) {
    CAPTURE(g.B);
    CAPTURE(g.T);
    CAPTURE(g.NH);
    CAPTURE(g.NKV);
    CAPTURE(g.HD);
    compare(g, DType::BF16, *ops, *cpu);
    if (g.HD == 64) {  // the backward's two-buffer variant too (HD 128 has only that one)
      INFO("MPIGPT_ATTENTION_WG_TWO_BUFFERS=1");
      two_env.set(true);
      compare(g, DType::BF16, *ops, *cpu);
      two_env.set(false);
    }
  }
}

TEST_CASE("cuda attention rejects unsupported head dims and inconsistent shapes") {
  auto ops = cuda_ops_or_skip();
  const Geometry g{1, 4, 2, 1, 160};
  auto qkv = zeros(*ops, {g.B, g.T, g.R()});
  auto out = zeros(*ops, {g.B, g.T, g.C()});
  auto saved = zeros(*ops, {g.B * g.NH * g.T});
  CHECK_THROWS_WITH_AS(ops->attention_forward(out.t, saved.t, qkv.t, g.NH, g.NKV, g.HD),
                       doctest::Contains("HD = 160"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_forward(out.t, saved.t, qkv.t, g.NH, g.NKV, 80),  // R would differ
                       doctest::Contains("attention_forward"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_forward(out.t, saved.t, qkv.t, 3, 2, g.HD), doctest::Contains("NH"), Error);
  auto small = zeros(*ops, {g.B * g.NH * g.T - 1});
  const Geometry h{1, 4, 2, 1, 64};
  auto qkv2 = zeros(*ops, {h.B, h.T, h.R()});
  auto out2 = zeros(*ops, {h.B, h.T, h.C()});
  CHECK_THROWS_WITH_AS(ops->attention_forward(out2.t, small.t, qkv2.t, h.NH, h.NKV, h.HD), doctest::Contains("saved"),
                       Error);
  auto out_bf16 = zeros(*ops, {h.B, h.T, h.C()}, DType::BF16);  // one data dtype per call
  CHECK_THROWS_AS(ops->attention_forward(out_bf16.t, saved.t, qkv2.t, h.NH, h.NKV, h.HD), Error);
}

#ifdef MPIGPT_WITH_CUDA
namespace {
using Kernels = cuda::CudaOps::AttentionKernels;
bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("cuda attention auto: candidates that disagree or do not run are dropped, the fastest of the rest runs") {
  // fastest_agreeing_attention on made-up candidates around the real forward:
  //  0 the reference runs it four times (slow);
  //  1 runs it once (fast, right): must be chosen;
  //  2 only moves the lse left by the last run by 1%: the fastest of all, and wrong;
  //  3 does not run the call; 4 throws, as cuDNN refusing a plan at run time would;
  //  5 runs it twice and moves the lse by 1e-5 (slower, within the tolerance): timed last in each
  //    round, so the outputs left are the chosen one's only if it runs again at the end.
  auto ops = cuda_ops_or_skip();
  auto& cuda_ops = dynamic_cast<cuda::CudaOps&>(*ops);
  const Geometry g{1, 64, 2, 1, 64};
  const Bf16Inputs in = bf16_inputs(*ops, g, 404);
  auto d_out = zeros(*ops, in.sout, DType::BF16);
  auto d_saved = zeros(*ops, {in.nsaved});
  auto forward = [&] {
    ops->attention_forward(d_out.t, d_saved.t, in.d_qkv.t, g.NH, g.NKV, g.HD);
    return true;
  };
  auto move_lse = [&](float factor) {
    ops->scale(d_saved.t, factor);
    return true;
  };
  const std::vector<cuda::CudaOps::AttentionCandidate> candidates = {
      {Kernels::Builtin, [&] { return forward() && forward() && forward() && forward(); }},
      {Kernels::Cudnn, forward},
      {Kernels::Wgmma, [&] { return move_lse(1.01f); }},
      {Kernels::Cudnn, [] { return false; }},
      {Kernels::Cudnn, []() -> bool { throw Error("refused at run time"); }},
      {Kernels::Wgmma, [&] { return forward() && forward() && move_lse(1.00001f); }},
  };
  const std::vector<cuda::CudaOps::AttentionOutput> outputs = {
      {d_out.t.ptr, size_t(in.sout.numel()), size_t(g.C()), DType::BF16, "out",
       cuda::CudaOps::attention_out_bounds(g.HD)},
      {d_saved.t.ptr, size_t(g.B * g.NH * g.T), size_t(g.T), DType::F32, "lse", cuda::CudaOps::attention_lse_bounds()}};
  (void)cuda_ops.take_notes();
  CHECK(cuda_ops.fastest_agreeing_attention("the test's call", candidates, outputs) == 1);
  const auto lse_left = to_host(*ops, d_saved.t);
  const auto notes = cuda_ops.take_notes();
  REQUIRE(notes.size() == 1);
  const std::string& note = notes[0];
  CAPTURE(note);
  CHECK(note.find("attention auto, the test's call: cudnn (builtin ") == 0);
  CHECK(has(note, "wgmma disagrees with builtin on lse (bounds 0.001 per element, 0.001 of the norm): "));
  CHECK(has(note, " of 128 elements disagree"));
  {  // the worst element named by its (b * NH + h) row and its query column
    const size_t at = note.find("worst element ");
    REQUIRE(at != std::string::npos);
    const size_t worst = std::stoul(note.substr(at + 14));
    CHECK(has(note, "; the worst element is row " + std::to_string(worst / g.T) + ", column " +
                        std::to_string(worst % g.T)));
  }
  CHECK(has(note, "cudnn does not run this call"));
  CHECK(has(note, "cudnn failed: refused at run time"));
  size_t timed = 0;  // the three that agree; the dropped ones were not timed
  for (size_t at = note.find(" ms"); at != std::string::npos; at = note.find(" ms", at + 1)) ++timed;
  CHECK(timed == 3);
  CHECK(cuda_ops.take_notes().empty());
  forward();
  CHECK(to_host(*ops, d_saved.t) == lse_left);
}

TEST_CASE("cuda attention auto: each pass and shape is measured once, and the causal ops match the CPU backend") {
  auto ops = cuda_ops_or_skip();
  auto& cuda_ops = dynamic_cast<cuda::CudaOps&>(*ops);
  auto cpu = make_cpu_ops();
  cuda_ops.set_attention_backend(cuda::CudaOps::AttentionBackend::Auto);
  (void)cuda_ops.take_notes();
  const std::vector<Geometry> shapes = {{2, 130, 4, 2, 64}, {1, 100, 4, 1, 128}};
  const std::vector<Kernels> wgmma_or_not = cuda::attention_wgmma_available()
                                                ? std::vector<Kernels>{Kernels::Builtin, Kernels::Wgmma}
                                                : std::vector<Kernels>{Kernels::Builtin};
  for (const Geometry& g : shapes) {
    CAPTURE(g.HD);
    // The gradients need not be bitwise reproducible here: cuDNN's may not be.
    compare(g, DType::BF16, *ops, *cpu, {}, false);
    const cuda::SdpaShape shape{g.B, g.T, g.NH, g.NKV, g.HD};
    for (bool backward : {false, true}) {
      const auto choice = cuda_ops.attention_choice(backward, shape);
      REQUIRE(choice.has_value());
      const bool builtin_or_wgmma = std::count(wgmma_or_not.begin(), wgmma_or_not.end(), *choice) > 0;
      CHECK((builtin_or_wgmma || *choice == Kernels::Cudnn));
    }
  }
  auto notes = cuda_ops.take_notes();
  std::string all;
  for (const auto& n : notes) all += n + "\n";
  CAPTURE(all);
  int measured = 0;
  for (const auto& n : notes) measured += has(n, "attention auto, forward ") || has(n, "attention auto, backward ");
  CHECK(measured == 4);  // two passes of two shapes
  CHECK(has(all, "attention auto, forward B 2 T 130 heads 4/2 head dim 64: "));
  CHECK(has(all, "attention auto, backward B 1 T 100 heads 4/1 head dim 128: "));
  CHECK_FALSE(has(all, "disagrees"));
  // Again: the choices stand, nothing is measured; f32 data runs the builtin kernels unmeasured.
  compare(shapes[0], DType::BF16, *ops, *cpu, {}, false);
  compare(shapes[0], DType::F32, *ops, *cpu);
  notes = cuda_ops.take_notes();
  CHECK(notes.empty());
}

TEST_CASE("cuda attention auto among a list (engine.attention_backend = builtin,cudnn): only those listed run") {
  auto ops = cuda_ops_or_skip();
  auto& cuda_ops = dynamic_cast<cuda::CudaOps&>(*ops);
  auto cpu = make_cpu_ops();
  const Geometry g{1, 70, 2, 1, 64};
  const cuda::SdpaShape shape{g.B, g.T, g.NH, g.NKV, g.HD};
  const bool wgmma_runs = cuda::attention_wgmma_available();
  for (const char* value : {"builtin,wgmma", "builtin,cudnn", "auto"}) {
    CAPTURE(value);
    const AttentionBackendSpec spec = parse_attention_backend(value);
    cuda_ops.set_attention_backend(spec);
    (void)cuda_ops.take_notes();
    compare(g, DType::BF16, *ops, *cpu, {}, false);
    std::string all;
    for (const auto& n : cuda_ops.take_notes()) all += n + "\n";
    CAPTURE(all);
    CHECK(has(all, "attention auto, forward B 1 T 70 heads 2/1 head dim 64: "));
    CHECK(has(all, "attention auto, backward B 1 T 70 heads 2/1 head dim 64: "));
    CHECK(has(all, "wgmma") == (spec.wgmma && wgmma_runs));
    if (!spec.cudnn) CHECK_FALSE(has(all, "cudnn"));
    for (bool backward : {false, true}) {
      const auto choice = cuda_ops.attention_choice(backward, shape);
      REQUIRE(choice.has_value());
      CHECK((*choice == Kernels::Builtin || (*choice == Kernels::Wgmma && spec.wgmma) ||
             (*choice == Kernels::Cudnn && spec.cudnn)));
    }
  }
  // make_cuda_ops takes the list, and the backend's description names it.
  CHECK(has(make_cuda_ops(0, CudaOptions{false, "cudnn,builtin"})->name(), "; builtin,cudnn attention, "));
  CHECK(has(make_cuda_ops(0, CudaOptions{false, "builtin,wgmma"})->name(), "; builtin,wgmma attention)"));
  CHECK_THROWS_WITH_AS(make_cuda_ops(0, CudaOptions{false, "cudnn,wgmma"}), doctest::Contains("without builtin"),
                       Error);
}

TEST_CASE("cuda attention: engine.attention_backend = wgmma refuses what its kernels do not run") {
  auto ops = cuda_ops_or_skip();
  auto& cuda_ops = dynamic_cast<cuda::CudaOps&>(*ops);
  cuda_ops.set_attention_backend(cuda::CudaOps::AttentionBackend::Wgmma);
  auto call = [&](const Geometry& g, DType dt) {
    auto qkv = zeros(*ops, {g.B, g.T, g.R()}, dt);
    auto out = zeros(*ops, {g.B, g.T, g.C()}, dt);
    auto saved = zeros(*ops, {g.B * g.NH * g.T});
    ops->attention_forward(out.t, saved.t, qkv.t, g.NH, g.NKV, g.HD);
  };
  const Geometry hd64{1, 64, 2, 1, 64};
  if (!cuda::attention_wgmma_available()) {
    CHECK_THROWS_WITH_AS(call(hd64, DType::BF16), doctest::Contains("needs a GPU that runs sm_90a code"), Error);
    return;
  }
  CHECK_NOTHROW(call(hd64, DType::BF16));
  CHECK_THROWS_WITH_AS(call(hd64, DType::F32), doctest::Contains("engine.attention_backend = wgmma runs bf16 data"),
                       Error);
  CHECK_THROWS_WITH_AS(call({1, 64, 2, 1, 32}, DType::BF16),
                       doctest::Contains("wgmma runs head dims 64 and 128 with 16-byte aligned rows, but this call "
                                         "has B 1 T 64 heads 2/1 head dim 32"),
                       Error);
}
#endif
