// engine.attention_backend, parsed: who runs the CUDA backend's causal attention ops.
//
// A value names one implementation, `builtin` (the backend's own kernels), `wgmma` (the same
// kernels on Hopper's warpgroup products) or `cudnn` (cuDNN's fused SDPA), or lets auto choose:
// `auto` measures all three on the first call of each pass and shape and keeps the fastest that
// agrees with builtin; a comma-separated list (`builtin,cudnn`) does the same among the listed
// ones only. A list must hold builtin, which auto checks the others against and which runs the
// calls (f32 data, other head dims) the others do not take.
#pragma once
#include <string>

namespace mpigpt {

struct AttentionBackendSpec {
  enum class Kind { Builtin, Wgmma, Cudnn, Auto };
  Kind kind = Kind::Builtin;
  // With Auto: the candidates besides builtin.
  bool wgmma = false, cudnn = false;
  // Whether it asks for a GPU-only implementation outright (auto over any list suits a CPU run,
  // which has only its own kernels).
  bool gpu_only() const { return kind == Kind::Wgmma || kind == Kind::Cudnn; }
  bool operator==(const AttentionBackendSpec& o) const {
    return kind == o.kind && wgmma == o.wgmma && cudnn == o.cudnn;
  }
};

// Parses a value of engine.attention_backend; fails naming the field, the value and what to write.
AttentionBackendSpec parse_attention_backend(const std::string& value);

// The canonical spelling: builtin | wgmma | cudnn | auto, or auto's list (builtin,wgmma,cudnn order).
std::string attention_backend_str(const AttentionBackendSpec& spec);

}  // namespace mpigpt
