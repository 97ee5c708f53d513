// cuDNN's fused scaled-dot-product attention (flash attention: the T x T matrix never exists) for the
// causal ops, built with cuDNN's graph (backend) API as cuDNN's own frontend builds its SDPA node.
// Plain C++ (no CUDA or cuDNN types): the tests include it.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace mpigpt::cuda {

// One causal self-attention call: qkv (B,T,(NH+2*NKV)*HD) rows hold the NH query heads, then the
// NKV key and NKV value heads; out (B,T,NH*HD); lse (B,NH,T) f32; bf16 data.
struct SdpaShape {
  int64_t B = 0, T = 0;
  int NH = 0, NKV = 0, HD = 0;
  auto key() const { return std::tie(B, T, NH, NKV, HD); }
  bool operator<(const SdpaShape& o) const { return key() < o.key(); }
};

// Empty when this build and machine can load cuDNN, else why not (no headers at build time, the
// library missing or too old) and the fixes. Never throws.
std::string cudnn_sdpa_unavailable();
// "cuDNN X.Y.Z" of the library loaded, or empty when it cannot be loaded.
std::string cudnn_sdpa_version();

// The ids of the graphs' user tensors (the keys of an execution's variant pack; virtual tensors
// count from kSdpaFirstVirtual): Q, K, V are column blocks of qkv, dQ, dK, dV of dqkv; D =
// rowsum(dO * O) (B,NH,T) and the fp32 dQ (B,NH,T,HD) are the backward's own workspace tensors;
// the scale, the masked scores' value and one are host scalars.
enum SdpaTensorId : int64_t {
  kSdpaQ = 1, kSdpaK, kSdpaV, kSdpaO, kSdpaStats, kSdpaScale, kSdpaMaskValue,  // forward
  kSdpaDO, kSdpaDQ, kSdpaDK, kSdpaDV, kSdpaOne, kSdpaRowDot, kSdpaDQAccum,     // backward
  kSdpaFirstVirtual = 100
};

// How cuDNN planned one graph: heuristics mode A's engine configurations are tried in order and
// the first whose execution plan finalizes is kept (CudnnSdpa::prepare).
struct SdpaPlanInfo {
  int64_t offered = 0;    // configurations the heuristics offered (after their support checks)
  int64_t chosen = -1;    // the index of the one kept, -1 when none finalized
  int64_t engine = -1;    // its engine's global index
  int64_t workspace = 0;  // bytes of cuDNN workspace it needs
  int64_t built = 0;      // configurations whose kernels were compiled but could not be loaded
  std::vector<std::string> rejected;  // why each configuration before the one kept failed
};
struct SdpaPlans {
  SdpaPlanInfo forward, backward;
};

// Device-less planning (cuDNN 9.8 on): the plans cuDNN makes for shape on a GPU it is told about,
// device_json being that device's description in cuDNN's format (CUDNN_ATTR_DEVICEPROP_JSON_
// REPRESENTATION: compute capability, multiprocessors, shared memory, ...). The heuristics
// recognise the graphs as fused attention (or not), check their engines' support for the device
// and compile the chosen kernels with NVRTC; only loading them needs the CUDA driver. So a machine
// with no GPU checks that cuDNN runs these graphs on, say, a Hopper GPU: there every configuration
// fails at the loading (counted in `built`), where the driver exists the plans finalize. Throws
// mpigpt::Error when cuDNN cannot be loaded, is older than 9.8, rejects the description or does
// not take the shape (cuDNN's version limits).
SdpaPlans cudnn_sdpa_plan_for_device(const SdpaShape& shape, const std::string& device_json);

// A cuDNN handle on one stream and the execution plans per shape. CudaOps runs the causal ops of bf16
// data through it wherever it plans the shape, unless engine.attention_backend = builtin
// (cuda_attention_causal.cu); the saved state is the builtin kernels' log-sum-exp (B,NH,T), so
// either forward pairs with either backward.
class CudnnSdpa {
 public:
  // On the current device, every call queued on stream (a cudaStream_t). Throws when cuDNN is
  // unavailable.
  explicit CudnnSdpa(void* stream);
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;

  // Whether cuDNN runs this shape: on the first call per shape it builds the forward and backward
  // plans (both, so that a shape never pairs a cuDNN forward with a builtin backward by chance)
  // and keeps them; when either cannot be built, false with cuDNN's reason in *why.
  bool prepare(const SdpaShape& shape, std::string* why);
  // How the shape's plans were made (after prepare returned true).
  SdpaPlans plans(const SdpaShape& shape) const;
  // Device workspace the shape's forward or backward needs (after prepare).
  size_t workspace_bytes(const SdpaShape& shape) const;

  // After prepare(shape) returned true; workspace holds workspace_bytes(shape). Queued on the stream.
  void forward(const SdpaShape& shape, void* out, float* lse, const void* qkv, void* workspace);
  // dqkv (B,T,(NH+2*NKV)*HD) overwritten.
  void backward(const SdpaShape& shape, void* dqkv, const void* dout, const void* qkv, const void* out,
                const float* lse, void* workspace);

  struct Plans;

 private:
  void* stream_ = nullptr;  // cudaStream_t
  void* handle_ = nullptr;  // cudnnHandle_t
  std::map<SdpaShape, std::unique_ptr<Plans>> plans_;
  std::map<SdpaShape, std::string> unsupported_;
};

}  // namespace mpigpt::cuda
