// Shape and Tensor helpers.
#include "lib/core/tensor.h"

namespace mpigpt {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
  }
  return "?";
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  MPIGPT_CHECK(dims.size() <= size_t(kMaxDims), "at most {} dimensions, got {}", kMaxDims, dims.size());
  for (int64_t x : dims) d[ndim++] = x;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= d[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (d[i] != o.d[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (ndim == 1 ? ",)" : ")");
}

Tensor Tensor::view(Shape s) const {
  MPIGPT_CHECK(s.numel() == numel(), "cannot view {} as {}", shape.str(), s.str());
  return Tensor(ptr, s, dtype, device);
}

Tensor Tensor::flat_slice(int64_t begin, int64_t count) const {
  MPIGPT_CHECK(begin >= 0 && count >= 0 && begin + count <= numel(), "slice [{}, {}) of {} elements",
               begin, begin + count, numel());
  return Tensor(static_cast<char*>(ptr) + begin * dtype_size(dtype), Shape{count}, dtype, device);
}

std::string Tensor::str() const { return std::string(dtype_name(dtype)) + shape.str(); }

}  // namespace mpigpt
