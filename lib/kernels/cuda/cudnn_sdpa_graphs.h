// The operation graphs of cuDNN's fused attention, shared by cudnn_sdpa_graphs.cu (builds them) and
// cudnn_sdpa.cu (plans and runs them): an owned backend descriptor, a graph under construction and the
// user tensors' ids. Needs cuDNN's headers: only lib/kernels/cuda/cudnn_sdpa*.cu include it.
#pragma once
#ifdef MPIGPT_HAVE_CUDNN
#include <fmt/format.h>

#include <array>
#include <deque>
#include <string>
#include <vector>

#include "lib/core/error.h"
#include "lib/kernels/cuda/cudnn_api.h"
#include "lib/kernels/cuda/cudnn_sdpa.h"

namespace mpigpt::cuda::sdpa {

// Fails (mpigpt::Error) with cuDNN's message when rc is not success.
void check(cudnnStatus_t rc, const std::string& what);

// An owned backend descriptor, named for the error messages.
class Desc {
 public:
  Desc(cudnnBackendDescriptorType_t type, std::string what) : what_(std::move(what)) {
    check(cudnn().BackendCreateDescriptor(type, &d_), "creating " + what_);
  }
  ~Desc() {
    if (d_) (void)cudnn().BackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  Desc(Desc&& o) noexcept : d_(o.d_), what_(std::move(o.what_)) { o.d_ = nullptr; }

  template <class T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values, int64_t n = 1) {
    check(cudnn().BackendSetAttribute(d_, name, type, n, values), fmt::format("setting attribute {} of {}",
                                                                                int(name), what_));
    return *this;
  }
  Desc& set(cudnnBackendAttributeName_t name, const Desc& d) {
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &d.d_);
  }
  Desc& finalize() {
    check(cudnn().BackendFinalize(d_), "finalizing " + what_);
    return *this;
  }
  cudnnBackendDescriptor_t get() const { return d_; }
  const std::string& what() const { return what_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
  std::string what_;
};

using Dims = std::array<int64_t, 4>;

// One operation graph under construction: its tensors and operations, in creation order (which
// is topological, as cuDNN wants them).
class Graph {
 public:
  explicit Graph(std::string name) : name_(std::move(name)) {}

  // A tensor of the graph: user (uid given) or virtual (uid 0: the next internal one); by_value for
  // the host scalars.
  const Desc& tensor(const char* what, Dims dims, Dims strides, cudnnDataType_t dt, int64_t uid,
                     bool by_value = false) {
    const bool is_virtual = uid == 0;
    if (is_virtual) uid = next_virtual_++;
    Desc& t = tensors_.emplace_back(CUDNN_BACKEND_TENSOR_DESCRIPTOR, fmt::format("{} tensor {}", name_, what));
    const int64_t alignment = 16;
    const bool yes = true;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &dt)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4)
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4)
        .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid)
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &alignment);
    if (is_virtual) t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &yes);
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &yes);
    return t.finalize();
  }
  const Desc& scalar(const char* what, int64_t uid) {
    return tensor(what, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, uid, true);
  }

  // C = A B over the two last dims, batched over the first two (B's heads may divide A's).
  void matmul(const char* what, const Desc& a, const Desc& b, const Desc& c) {
    Desc& mm = descs_.emplace_back(CUDNN_BACKEND_MATMUL_DESCRIPTOR, label("matmul", what));
    const cudnnDataType_t fp32 = CUDNN_DATA_FLOAT;
    // No padding value: the frontend sets one only for padded (variable-length) sequences, and the
    // fused engines match the attention pattern as the frontend builds it.
    mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &fp32).finalize();
    Desc& op = add_op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul", what);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
        .set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
        .set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
        .set(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm)
        .finalize();
  }

  // y = mode(x[, b]) (b given for the binary modes; BINARY_SELECT: y = t ? x : b). axis: GEN_INDEX's.
  void pointwise(const char* what, cudnnPointwiseMode_t mode, const Desc& x, const Desc* b, const Desc* t,
                 const Desc& y, cudnnDataType_t precision = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    Desc& pw = descs_.emplace_back(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, label("pointwise", what));
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode)
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &precision);
    if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &axis);
    pw.finalize();
    Desc& op = add_op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise", what);
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw).set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t) op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    const float one = 1.0f;
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, &one)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, &one)
        .finalize();
  }

  // y = reduce(x) over the dims where y has size 1 (or fewer heads: the grouped-query fold).
  void reduction(const char* what, cudnnReduceTensorOp_t mode, const Desc& x, const Desc& y) {
    Desc& rd = descs_.emplace_back(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, label("reduction", what));
    const cudnnDataType_t fp32 = CUDNN_DATA_FLOAT;
    rd.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &fp32)
        .set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode);
    // Deterministic (the frontend's deterministic backward): the same bits on every run, so that a
    // resumed run repeats the uninterrupted one. A cuDNN without the attribute ignores it.
    const bool yes = true;
    (void)cudnn().BackendSetAttribute(rd.get(), cudnnBackendAttributeName_t(1602), CUDNN_TYPE_BOOLEAN, 1, &yes);
    rd.finalize();
    Desc& op = add_op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction", what);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd)
        .set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
        .set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)
        .finalize();
  }

  // The same values seen with other strides (a transpose) or another dtype.
  void reshape(const char* what, const Desc& x, const Desc& y) {
    Desc& op = add_op(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape", what);
    op.set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x).set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y).finalize();
  }

  // The operations' descriptors in creation order (an operation graph's).
  std::vector<cudnnBackendDescriptor_t> ops() const {
    std::vector<cudnnBackendDescriptor_t> v;
    for (const Desc* op : ops_) v.push_back(op->get());
    return v;
  }
  const std::string& name() const { return name_; }

 private:
  std::string label(const char* kind, const char* what) const {
    return fmt::format("{} {} {} (operation {})", name_, kind, what, ops_.size() + 1);
  }
  Desc& add_op(cudnnBackendDescriptorType_t type, const char* kind, const char* what) {
    Desc& d = descs_.emplace_back(type, label(kind, what));
    ops_.push_back(&d);
    return d;
  }

  std::string name_;
  int64_t next_virtual_ = kSdpaFirstVirtual;
  std::deque<Desc> tensors_, descs_;  // deques: references stay valid as they grow
  std::vector<const Desc*> ops_;
};

// The forward and backward graphs of shape s (cudnn_sdpa_graphs.cu says what they compute).
void build_forward(Graph& g, const SdpaShape& s);
void build_backward(Graph& g, const SdpaShape& s);

}  // namespace mpigpt::cuda::sdpa
#endif
