// Tensor: a typed, shaped, non-owning view of memory on one device (the owner is a Buffer,
// lib/kernels/buffer.h).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "lib/core/error.h"

namespace mpigpt {

enum class DType : uint8_t { F32, BF16, I32 };
enum class Device : uint8_t { CPU, CUDA };

inline size_t dtype_size(DType t) { return t == DType::BF16 ? 2 : 4; }
const char* dtype_name(DType t);

constexpr int kMaxDims = 4;

struct Shape {
  std::array<int64_t, kMaxDims> d{};
  int ndim = 0;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int64_t operator[](int i) const { return d[i < 0 ? ndim + i : i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "(4, 64, 768)"
};

// Layers keep their weights and activations as views into a few large buffers (one for all
// parameters, one for all gradients, ...) so that communication and the optimizer can treat a
// whole model as one flat range.
struct Tensor {
  void* ptr = nullptr;
  Shape shape;
  DType dtype = DType::F32;
  Device device = Device::CPU;

  Tensor() = default;
  Tensor(void* p, Shape s, DType t = DType::F32, Device dev = Device::CPU)
      : ptr(p), shape(s), dtype(t), device(dev) {}

  int64_t numel() const { return shape.numel(); }
  int64_t size(int i) const { return shape[i]; }
  int ndim() const { return shape.ndim; }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  bool defined() const { return ptr != nullptr; }

  float* f32() const {
    MPIGPT_CHECK(dtype == DType::F32, "tensor is {}, not f32", dtype_name(dtype));
    return static_cast<float*>(ptr);
  }
  int32_t* i32() const {
    MPIGPT_CHECK(dtype == DType::I32, "tensor is {}, not i32", dtype_name(dtype));
    return static_cast<int32_t*>(ptr);
  }
  // The same memory seen with another shape of the same number of elements.
  Tensor view(Shape s) const;
  // Elements [begin, begin+count) of the flattened tensor, as a 1-D view.
  Tensor flat_slice(int64_t begin, int64_t count) const;
  std::string str() const;  // "f32(4, 64, 768)"
};

}  // namespace mpigpt
