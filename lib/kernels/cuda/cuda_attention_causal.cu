// CUDA backend: the causal attention ops and who runs them (engine.attention_backend): cuDNN's fused
// attention (cudnn_sdpa.cu) where it loads and runs the call, the builtin kernels (cuda_attention.cu)
// elsewhere or when asked.
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "lib/kernels/cuda/cuda_attention.cuh"
#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

std::string shape_str(const SdpaShape& s) {
  return fmt::format("B {} T {} heads {}/{} head dim {}", s.B, s.T, s.NH, s.NKV, s.HD);
}

// The call's shape: qkv (B,T,(NH+2*NKV)*HD).
SdpaShape causal_shape(const Tensor& qkv, int NH, int NKV, int HD) { return {qkv.size(0), qkv.size(1), NH, NKV, HD}; }

}  // namespace

std::string CudaOps::cudnn_refusal(const SdpaShape& shape, DType dt) {
  if (dt != DType::BF16)
    return fmt::format("cuDNN's fused attention takes bf16 data and this run's is {} (training.precision = fp32 "
                       "runs the builtin fp32 kernels)", dtype_name(dt));
  if (!sdpa_ && cudnn_missing_.empty()) {
    cudnn_missing_ = cudnn_sdpa_unavailable();
    if (cudnn_missing_.empty()) {
      MPIGPT_CUDA(cudaSetDevice(device_));
      try {
        sdpa_ = std::make_unique<CudnnSdpa>(stream_);
      } catch (const Error& e) {  // e.g. a cuDNN built for another CUDA
        cudnn_missing_ = e.what();
      }
    }
  }
  if (!sdpa_) return cudnn_missing_;
  std::string why;
  if (!sdpa_->prepare(shape, &why)) return fmt::format("cuDNN cannot run attention with {}: {}", shape_str(shape), why);
  return {};
}

CudnnSdpa* CudaOps::cudnn_for(const SdpaShape& shape, DType dt, const char* op) {
  if (attention_ == CudaOptions::Attention::Builtin) return nullptr;
  const std::string why = cudnn_refusal(shape, dt);
  if (why.empty()) return sdpa_.get();
  if (attention_ == CudaOptions::Attention::Cudnn)
    fail("{}: engine.attention_backend = cudnn, but {}; set engine.attention_backend = builtin, or leave it unset "
         "(cuDNN where it runs, the builtin kernels elsewhere)", op, why);
  return nullptr;
}

std::string CudaOps::attention_kernels(int64_t B, int64_t T, int NH, int NKV, int HD, DType dt) {
  const SdpaShape shape{B, T, NH, NKV, HD};
  const char* builtin = dt == DType::BF16 ? "the builtin kernels (bf16 on tensor cores at head dims 64 and 128, "
                                            "fp32 FMA elsewhere)"
                                          : "the builtin fp32 kernels";
  if (attention_ == CudaOptions::Attention::Builtin)
    return fmt::format("{} (engine.attention_backend = builtin)", builtin);
  if (CudnnSdpa* sdpa = cudnn_for(shape, dt, "attention")) {
    const SdpaPlans plans = sdpa->plans(shape);
    return fmt::format("{} fused attention, forward engine {}, backward engine {} ({}, workspace {:.1f} MiB)",
                       cudnn_sdpa_version(), plans.forward.engine, plans.backward.engine, shape_str(shape),
                       double(sdpa->workspace_bytes(shape)) / (1 << 20));
  }
  return fmt::format("{}: {}", builtin, cudnn_refusal(shape, dt));
}

std::vector<std::string> CudaOps::take_notes() { return std::exchange(notes_, {}); }

// Both save the same log-sum-exp, so a forward of one pairs with a backward of the other.
void CudaOps::attention_forward_impl(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) {
  // out (B,T,NH*HD), saved = lse (B,NH,T) f32, qkv (B,T,(NH+2*NKV)*HD)
  const char* op = "attention_forward";
  const DType dt = out.dtype;
  const SdpaShape shape = causal_shape(qkv, NH, NKV, HD);
  if (CudnnSdpa* sdpa = cudnn_for(shape, dt, op)) {
    Scratch ws = scratch(std::max<size_t>(1, sdpa->workspace_bytes(shape)));
    sdpa->forward(shape, out.ptr, ptr<float>(saved), qkv.ptr, ws.ptr);
    return;
  }
  fused_attention_forward(*this, dt, out, saved, qkv, {}, {}, {}, {}, {}, NH, NKV, HD);
}

void CudaOps::attention_backward_impl(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                                      int HD) {
  // dqkv (B,T,(NH+2*NKV)*HD) overwritten, dout and out (B,T,NH*HD), qkv as forward, saved = lse (B,NH,T)
  const char* op = "attention_backward";
  const DType dt = dqkv.dtype;
  const SdpaShape shape = causal_shape(qkv, NH, NKV, HD);
  if (CudnnSdpa* sdpa = cudnn_for(shape, dt, op)) {
    Scratch ws = scratch(std::max<size_t>(1, sdpa->workspace_bytes(shape)));
    sdpa->backward(shape, dqkv.ptr, dout.ptr, qkv.ptr, out.ptr, ptr<const float>(saved), ws.ptr);
    return;
  }
  fused_attention_backward(*this, dt, dqkv, {}, dout, qkv, {}, out, saved, {}, {}, {}, {}, NH, NKV, HD);
}

}  // namespace mpigpt::cuda
