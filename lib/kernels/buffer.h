// Buffer: owning memory from a backend, and Arena: carves many tensors out of one buffer so a
// model allocates its parameters, gradients and activations in a few large blocks.
#pragma once
#include <cstddef>
#include <utility>
#include <vector>

#include "lib/kernels/ops.h"

namespace mpigpt {

class Buffer {
 public:
  Buffer() = default;
  Buffer(Ops& ops, size_t bytes) : ops_(&ops), ptr_(bytes ? ops.allocate(bytes) : nullptr), bytes_(bytes) {}
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(ops_, o.ops_);
      std::swap(ptr_, o.ptr_);
      std::swap(bytes_, o.bytes_);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void reset() {
    if (ptr_) ops_->release(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Tensor tensor(Shape s, DType t = DType::F32) const {
    MPIGPT_CHECK(size_t(s.numel()) * dtype_size(t) <= bytes_, "buffer of {} bytes cannot hold {}", bytes_,
                 s.str());
    return Tensor(ptr_, s, t, ops_->device());
  }

 private:
  Ops* ops_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Two passes: first `plan` every tensor (sizes only), then `commit` allocates once and the
// planned tensors become valid. Offsets are rounded to 64 bytes.
class Arena {
 public:
  explicit Arena(Ops& ops) : ops_(ops) {}
  // Reserve a tensor; the returned pointer is patched in commit().
  void plan(Tensor* t, Shape s, DType dt = DType::F32) {
    *t = Tensor(nullptr, s, dt, ops_.device());
    slots_.push_back({t, used_});
    used_ += (size_t(s.numel()) * dtype_size(dt) + 63) / 64 * 64;
  }
  void commit() {
    buf_ = Buffer(ops_, used_);
    for (auto& s : slots_) s.t->ptr = static_cast<char*>(buf_.data()) + s.offset;
    slots_.clear();
  }
  size_t bytes() const { return used_; }

 private:
  struct Slot {
    Tensor* t;
    size_t offset;
  };
  Ops& ops_;
  std::vector<Slot> slots_;
  size_t used_ = 0;
  Buffer buf_;
};

}  // namespace mpigpt
