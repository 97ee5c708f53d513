// What the ops' fronts (ops*.cpp) share: the argument checks of one call, and Ops::run, which times
// an op when profiling. Private to lib/kernels.
#pragma once
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lib/core/error.h"
#include "lib/kernels/ops.h"

namespace mpigpt {

// A tensor seen as a matrix: cols = its last dimension, rows = everything before it.
struct Mat {
  int64_t rows, cols;
};
inline Mat mat_of(const Tensor& t) {  // (N, 0) still has N rows
  if (t.ndim() == 0) return {1, 1};
  int64_t rows = 1;
  for (int i = 0; i + 1 < t.ndim(); ++i) rows *= t.size(i);
  return {rows, t.size(-1)};
}

// The checks of one call; every message starts with the op's name. Data tensors (inputs, outputs,
// activations, the compute copies of weights) share one dtype that the backend computes in; f32
// ones (statistics, weight gradients, losses, optimizer state) and i32 ones (indices) are those
// dtypes always. Every tensor lives on the backend's device. A *_opt tensor may be undefined.
class OpArgs {
 public:
  OpArgs(const Ops& ops, const char* op) : ops_(ops), op_(op) {}
  const char* op() const { return op_; }
  OpArgs& data(const char* what, const Tensor& t);
  OpArgs& data_opt(const char* what, const Tensor& t) { return t.defined() ? data(what, t) : *this; }
  OpArgs& f32(const char* what, const Tensor& t) { return typed(what, t, DType::F32); }
  OpArgs& f32_opt(const char* what, const Tensor& t) { return t.defined() ? f32(what, t) : *this; }
  OpArgs& i32(const char* what, const Tensor& t) { return typed(what, t, DType::I32); }
  OpArgs& i32_opt(const char* what, const Tensor& t) { return t.defined() ? i32(what, t) : *this; }
  // t (when defined) has the shape of `base`: as many elements, as many columns.
  OpArgs& like(const char* what, const Tensor& t, const char* base_name, const Tensor& base);
  // t (when defined) has n elements; `of` says what n is.
  OpArgs& len(const char* what, const Tensor& t, int64_t n, const char* of);
  // Fails with "op: message" unless ok.
  template <class... A>
  OpArgs& require(bool ok, fmt::format_string<A...> message, A&&... args) {
    if (!ok) fail("{}: {}", op_, fmt::format(message, std::forward<A>(args)...));
    return *this;
  }

 private:
  OpArgs& present(const char* what, const Tensor& t);
  OpArgs& typed(const char* what, const Tensor& t, DType dt);
  const Ops& ops_;
  const char* op_;
  const char* first_data_ = nullptr;  // the first data tensor's name, and its dtype
  DType data_dtype_ = DType::F32;
};

// NH query heads in groups over NKV key/value heads of HD channels each.
void check_heads(OpArgs& a, int NH, int NKV, int HD);

struct Ops::Profile {
  bool on = false;
  std::map<std::string, OpTime> times;
};

template <class F>
auto Ops::run(const char* op, F&& f) -> decltype(f()) {
  struct Depth {
    int& d;
    explicit Depth(int& x) : d(++x) {}
    ~Depth() { --d; }
  } depth(depth_);
  if (!profile_ || !profile_->on || depth_ > 1) return f();
  const auto t0 = std::chrono::steady_clock::now();
  auto done = [&] {
    synchronize();
    OpTime& t = profile_->times[op];
    t.op = op;
    t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++t.calls;
  };
  if constexpr (std::is_void_v<decltype(f())>) {
    f();
    done();
  } else {
    auto r = f();
    done();
    return r;
  }
}

}  // namespace mpigpt
