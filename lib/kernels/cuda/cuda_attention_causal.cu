// CUDA backend: the causal attention ops and the choice of who runs them (engine.attention_backend,
// CudaOps::AttentionBackend): the builtin kernels (cuda_attention.cu), the builtin kernels on
// Hopper's warpgroup products (cuda_attention_wg_*_sm90a.cu) or cuDNN's fused SDPA (cudnn_sdpa.cu),
// named, or measured on each pass and shape's first call (auto). All three save the same
// log-sum-exp, so a forward of one pairs with a backward of another.
//
// auto's measurement runs on the call's own data, so that what it times is what training runs: the
// builtin kernels run first and their outputs are copied to the host; every other candidate runs,
// its outputs are copied and compared with agreement() (lib/kernels/agreement.h), and one that
// disagrees is dropped with a note saying where. The rest are timed in interleaved rounds. A
// one-time cost per pass and shape (tens of milliseconds for GPT-2's shapes, plus copying the
// outputs, about 0.8 GB of gradients per candidate at 1.3B, and comparing them on the host's
// cores), then a map lookup per call.
#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "lib/kernels/agreement.h"
#include "lib/kernels/cuda/cuda_attention.cuh"
#include "lib/kernels/cuda/cuda_attention_tc.cuh"
#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"
#include "lib/kernels/cuda/cuda_timing.cuh"

namespace mpigpt::cuda {

namespace {

const char* kernels_name(CudaOps::AttentionKernels k) {
  switch (k) {
    case CudaOps::AttentionKernels::Builtin: return "builtin";
    case CudaOps::AttentionKernels::Wgmma: return "wgmma";
    case CudaOps::AttentionKernels::Cudnn: return "cudnn";
  }
  return "?";
}

std::string shape_str(const SdpaShape& s) {
  return fmt::format("B {} T {} heads {}/{} head dim {}", s.B, s.T, s.NH, s.NKV, s.HD);
}

// The checks both causal passes make, and the call's shape: qkv (B,T,(NH+2*NKV)*HD), out
// (B,T,NH*HD), saved = lse (B,NH,T) f32.
SdpaShape causal_shape(const Ops& ops, const char* op, const Tensor& qkv, const Tensor& out, const Tensor& saved,
                       int NH, int NKV, int HD) {
  check_attention_heads(op, NH, NKV, HD);
  const int64_t R = int64_t(NH + 2 * NKV) * HD;
  MPIGPT_CHECK(qkv.ndim() == 3 && qkv.size(2) == R, "{}: qkv {} must be (B, T, (NH+2*NKV)*HD = {})", op,
               qkv.shape.str(), R);
  const int64_t B = qkv.size(0), T = qkv.size(1);
  MPIGPT_CHECK(out.numel() == B * T * NH * HD, "{}: out {} must be (B, T, NH*HD) = ({}, {}, {})", op, out.shape.str(),
               B, T, int64_t(NH) * HD);
  MPIGPT_CHECK(saved.numel() >= ops.attention_saved_numel(B, T, NH), "{}: saved {} needs {} elements", op,
               saved.str(), ops.attention_saved_numel(B, T, NH));
  return {B, T, NH, NKV, HD};
}

}  // namespace

CudnnSdpa* CudaOps::cudnn_attention(const SdpaShape& shape, DType dt, const char* op, bool required) {
  if (sdpa_missing_) return nullptr;
  if (dt != DType::BF16) {  // cuDNN's fused attention takes 16-bit data
    if (required)
      fail("{}: engine.attention_backend = cudnn runs bf16 data, but this call's data is {}; set "
           "training.precision = bf16, or engine.attention_backend = auto (or builtin)", op, dtype_name(dt));
    return nullptr;
  }
  if (!sdpa_) {
    const std::string why = cudnn_sdpa_unavailable();
    if (!why.empty()) {
      if (required) fail("engine.attention_backend = cudnn: {}", why);
      notes_.push_back(fmt::format("attention auto: cuDNN is not a candidate: {}", why));
      sdpa_missing_ = true;
      return nullptr;
    }
    MPIGPT_CUDA(cudaSetDevice(device_));
    try {
      sdpa_ = std::make_unique<CudnnSdpa>(stream_);
    } catch (const Error& e) {  // e.g. a cuDNN built for another CUDA
      if (required) throw;
      notes_.push_back(fmt::format("attention auto: cuDNN is not a candidate: {}", e.what()));
      sdpa_missing_ = true;
      return nullptr;
    }
  }
  const bool first = !sdpa_->tried(shape);
  std::string why;
  const bool runs = sdpa_->prepare(shape, &why);
  // After the shape's first call there is nothing to note, only an explicit request to refuse.
  if (!first && (runs || !required)) return runs ? sdpa_.get() : nullptr;
  const std::string call = fmt::format("B={} T={} NH={} NKV={} HD={}", shape.B, shape.T, shape.NH, shape.NKV, shape.HD);
  if (runs) {  // which of cuDNN's engines runs it, once per shape
    const SdpaPlans plans = sdpa_->plans(shape);
    notes_.push_back(fmt::format("attention: cuDNN planned {}: forward engine {} (configuration {} of {}), backward "
                                 "engine {} (configuration {} of {}), workspace {:.1f} MiB",
                                 call, plans.forward.engine, plans.forward.chosen + 1, plans.forward.offered,
                                 plans.backward.engine, plans.backward.chosen + 1, plans.backward.offered,
                                 double(sdpa_->workspace_bytes(shape)) / (1 << 20)));
    return sdpa_.get();
  }
  if (!required) notes_.push_back(fmt::format("attention auto: cuDNN does not run {}: {}", call, why));
  if (required)
    fail("{}: engine.attention_backend = cudnn, but cuDNN cannot run attention with {}: {}; set "
         "engine.attention_backend = auto (the builtin kernels take the shapes cuDNN does not) or builtin",
         op, call, why);
  return nullptr;
}

std::optional<CudaOps::AttentionKernels> CudaOps::attention_choice(bool backward, const SdpaShape& shape) const {
  const auto it = attention_choices_.find({backward, shape});
  if (it == attention_choices_.end()) return std::nullopt;
  return it->second;
}

// How close auto holds a candidate's outputs to the builtin kernels' (lib/kernels/agreement.h),
// from measurements of correct kernels at T = 1024 (docs/performance.md, "auto's agreement
// bounds"): bf16 kernels that round P and dS at different points of their sums (the builtin
// kernels against cuDNN's graphs as the host interpreter evaluates them) differ by 0.15-0.3% of
// the norm, and per element by at most 1.4% of |want| plus the larger of the head vector's rms and
// the output's, the tail thinning fast (a hundredfold per doubling of the ratio past 0.8%), so
// that a full batch's 10^8 elements are expected under about 2%. Bounds of 5% per element and 1%
// of the norm keep a margin of about 2.5x and 3x over that, and stay far below what a wrong mask,
// head mapping or scale does (errors of the order of the values themselves). Elements are scaled
// by their head's vector (HD values); the lse is fp32 from identical inputs. cudnn_sdpa_graph_test
// checks that cuDNN's graphs, as the host interpreter evaluates them, stay within these bounds.
AgreementBounds CudaOps::attention_out_bounds(int HD) { return {5e-2, 1e-2, size_t(HD)}; }
AgreementBounds CudaOps::attention_grad_bounds(int HD) { return {5e-2, 1e-2, size_t(HD)}; }
AgreementBounds CudaOps::attention_lse_bounds() { return {1e-3, 1e-3, 0}; }

std::vector<std::string> CudaOps::take_notes() { return std::exchange(notes_, {}); }

size_t CudaOps::fastest_agreeing_attention(const std::string& what, const std::vector<AttentionCandidate>& candidates,
                                           const std::vector<AttentionOutput>& outputs) {
  MPIGPT_CHECK(!candidates.empty(), "attention auto: no candidates for {}", what);
  const size_t n = candidates.size();
  const char* reference = kernels_name(candidates[0].kernels);
  // The outputs of the last run, on the host.
  auto fetch = [&](std::vector<std::vector<char>>& host) {
    host.resize(outputs.size());
    for (size_t o = 0; o < outputs.size(); ++o) {
      host[o].resize(outputs[o].n * dtype_size(outputs[o].dt));
      MPIGPT_CUDA(cudaMemcpyAsync(host[o].data(), outputs[o].ptr, host[o].size(), cudaMemcpyDeviceToHost, stream_));
    }
    wait_for_stream(stream_, "a comparison of attention candidates on the host");
  };
  if (!candidates[0].run()) fail("attention auto: the reference kernels ({}) did not run {}", reference, what);
  std::vector<std::vector<char>> want, got;
  fetch(want);
  std::vector<bool> usable(n, false);
  usable[0] = true;
  std::vector<std::string> dropped;
  for (size_t i = 1; i < n; ++i) {
    const char* name = kernels_name(candidates[i].kernels);
    try {  // a library's refusal at run time (cuDNN's execute) drops the candidate, not the run
      if (!candidates[i].run()) {
        dropped.push_back(fmt::format("{} does not run this call", name));
        continue;
      }
      fetch(got);
    } catch (const Error& e) {
      dropped.push_back(fmt::format("{} failed: {}", name, e.what()));
      continue;
    }
    usable[i] = true;
    for (size_t o = 0; o < outputs.size() && usable[i]; ++o) {
      const AttentionOutput& out = outputs[o];
      const Agreement a = agreement(want[o].data(), got[o].data(), out.n, out.dt, out.bounds);
      if (!a.ok) {
        dropped.push_back(fmt::format("{} disagrees with {} on {} (bounds {:g} per element, {:g} of the norm): {}; "
                                      "the worst element is row {}, column {}",
                                      name, reference, out.name, out.bounds.element, out.bounds.norm, a.str(),
                                      a.worst / out.cols, a.worst % out.cols));
        usable[i] = false;
      }
    }
  }

  // Timed as the GEMM autotuner times (cuda_timing.cuh): a 20 ms warm-up of the reference, then
  // interleaved rounds of about 10 ms each.
  std::vector<double> best(n, 0.0);  // seconds per run, best round
  size_t chosen = 0;
  if (std::count(usable.begin(), usable.end(), true) > 1) {
    CandidateTimes t = time_candidates(stream_, usable, [&](size_t i) { return candidates[i].run(); }, 0.02, 0);
    best = std::move(t.seconds);
    chosen = t.fastest;
  }
  candidates[chosen].run();  // the outputs are the chosen kernels' own

  std::string times;
  for (size_t i = 0; i < n; ++i)
    if (best[i] > 0) times += fmt::format("{}{} {:.3f} ms", times.empty() ? "" : ", ",
                                                       kernels_name(candidates[i].kernels), best[i] * 1e3);
  std::string note = fmt::format("attention auto, {}: {}", what, kernels_name(candidates[chosen].kernels));
  if (!times.empty()) note += fmt::format(" ({})", times);
  for (const std::string& d : dropped) note += "; " + d;
  notes_.push_back(note);
  return chosen;
}

void CudaOps::run_causal_attention(bool backward, const SdpaShape& shape, DType dt, const char* op,
                                   const std::function<bool(AttentionKernels)>& run,
                                   const std::vector<AttentionOutput>& outputs) {
  using K = AttentionKernels;
  switch (attention_.kind) {
    case AttentionBackend::Builtin:
      run(K::Builtin);
      return;
    case AttentionBackend::Cudnn:  // run's cudnn_attention(..., true) fails where cuDNN cannot run the call
      run(K::Cudnn);
      return;
    case AttentionBackend::Wgmma: {
      if (dt != DType::BF16)
        fail("{}: engine.attention_backend = wgmma runs bf16 data, but this call's data is {}; set "
             "training.precision = bf16, or engine.attention_backend = auto (or builtin)", op, dtype_name(dt));
      if (!attention_wgmma_available()) {
        cudaDeviceProp prop{};
        MPIGPT_CUDA(cudaGetDeviceProperties(&prop, device_));
        fail("{}: engine.attention_backend = wgmma needs a GPU that runs sm_90a code (H100/H200 class), but device "
             "{} is a {} (sm_{}{}); set engine.attention_backend = auto or builtin", op, device_, prop.name,
             prop.major, prop.minor);
      }
      if (!run(K::Wgmma))
        fail("{}: engine.attention_backend = wgmma runs head dims 64 and 128 with 16-byte aligned rows, but this call "
             "has {}; set engine.attention_backend = auto (the other kernels take the rest) or builtin", op,
             shape_str(shape));
      return;
    }
    case AttentionBackend::Auto: break;
  }
  if (dt != DType::BF16) {  // only the builtin kernels run f32 data
    run(K::Builtin);
    return;
  }
  const auto key = std::make_pair(backward, shape);
  if (const auto it = attention_choices_.find(key); it != attention_choices_.end()) {
    if (!run(it->second)) fail("{}: attention auto's choice {} no longer runs {}", op, kernels_name(it->second),
                               shape_str(shape));
    return;
  }
  std::vector<AttentionCandidate> candidates = {{K::Builtin, [&] { return run(K::Builtin); }}};
  if (attention_.wgmma && attention_wgmma_available()) candidates.push_back({K::Wgmma, [&] { return run(K::Wgmma); }});
  if (attention_.cudnn && cudnn_attention(shape, dt, op, false))
    candidates.push_back({K::Cudnn, [&] { return run(K::Cudnn); }});
  const std::string what = fmt::format("{} {}", backward ? "backward" : "forward", shape_str(shape));
  attention_choices_[key] = candidates[fastest_agreeing_attention(what, candidates, outputs)].kernels;
}

void CudaOps::attention_forward(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) {
  // out (B,T,NH*HD), saved = lse (B,NH,T) f32, qkv (B,T,(NH+2*NKV)*HD)
  const char* op = "attention_forward";
  check_device(out, op, "out");
  check_f32(saved, op, "saved");
  check_device(qkv, op, "qkv");
  const DType dt = data_dtype(op, {{"out", out}, {"qkv", qkv}});
  const SdpaShape shape = causal_shape(*this, op, qkv, out, saved, NH, NKV, HD);
  auto run = [&](AttentionKernels k) {
    if (k == AttentionKernels::Cudnn) {
      CudnnSdpa* sdpa = cudnn_attention(shape, dt, op, true);
      Scratch ws = scratch(std::max<size_t>(1, sdpa->workspace_bytes(shape)));
      sdpa->forward(shape, out.ptr, ptr<float>(saved), qkv.ptr, ws.ptr);
      return true;
    }
    return fused_attention_forward(*this, dt, out, saved, qkv, {}, {}, {}, {}, {}, NH, NKV, HD,
                                   k == AttentionKernels::Wgmma);
  };
  run_causal_attention(false, shape, dt, op, run,
                       {{out.ptr, size_t(out.numel()), size_t(NH * HD), dt, "out (B*T rows)", attention_out_bounds(HD)},
                        {saved.ptr, size_t(attention_saved_numel(shape.B, shape.T, NH)), size_t(shape.T), DType::F32,
                         "lse (B*NH rows)", attention_lse_bounds()}});
}

void CudaOps::attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                                 int HD) {
  // dqkv (B,T,(NH+2*NKV)*HD) overwritten, dout and out (B,T,NH*HD), qkv as forward, saved = lse (B,NH,T)
  const char* op = "attention_backward";
  check_device(dqkv, op, "dqkv");
  check_device(dout, op, "dout");
  check_device(qkv, op, "qkv");
  check_device(out, op, "out");
  check_f32(saved, op, "saved");
  const DType dt = data_dtype(op, {{"dqkv", dqkv}, {"dout", dout}, {"qkv", qkv}, {"out", out}});
  const SdpaShape shape = causal_shape(*this, op, qkv, out, saved, NH, NKV, HD);
  MPIGPT_CHECK(dqkv.numel() == qkv.numel(), "{}: dqkv {} must have the shape of qkv {}", op, dqkv.shape.str(),
               qkv.shape.str());
  MPIGPT_CHECK(dout.numel() == out.numel(), "{}: dout {} must have the shape of out {}", op, dout.shape.str(),
               out.shape.str());
  auto run = [&](AttentionKernels k) {
    if (k == AttentionKernels::Cudnn) {
      CudnnSdpa* sdpa = cudnn_attention(shape, dt, op, true);
      Scratch ws = scratch(std::max<size_t>(1, sdpa->workspace_bytes(shape)));
      sdpa->backward(shape, dqkv.ptr, dout.ptr, qkv.ptr, out.ptr, ptr<const float>(saved), ws.ptr);
      return true;
    }
    return fused_attention_backward(*this, dt, dqkv, {}, dout, qkv, {}, out, saved, {}, {}, {}, {}, NH, NKV, HD,
                                    k == AttentionKernels::Wgmma);
  };
  run_causal_attention(true, shape, dt, op, run,
                       {{dqkv.ptr, size_t(dqkv.numel()), size_t(qkv.size(2)), dt, "dqkv (B*T rows)",
                         attention_grad_bounds(HD)}});
}

}  // namespace mpigpt::cuda
