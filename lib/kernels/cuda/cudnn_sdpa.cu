// cuDNN's fused attention through the graph (backend) API (see cudnn_sdpa.h).
//
// cuDNN 9 runs fused flash attention for a pattern of matmul, pointwise and reduction operations
// (its single attention operations take a causal mask only from 9.21 on, and the backward one is
// chosen by the heuristics only from 9.27): the graphs below are that pattern, built as cuDNN's
// own frontend builds them for causal training (bf16 in and out, fp32 softmax statistics):
//
// forward   S = scale * Q K^T, masked to -inf above the diagonal (GEN_INDEX rows and columns,
//           CMP_GE, BINARY_SELECT); M = rowmax S, Z = rowsum exp(S - M); lse = M + log Z (the
//           natural-log log-sum-exp, (B,NH,T) fp32: the builtin kernels' saved state);
//           O = bf16(exp(S - M) / Z) V.
// backward  D = rowsum(dO * O) (into an fp32 tensor in our workspace); P = exp(masked S - lse);
//           dV = bf16(P)^T dO; dS = scale * P * (dO V^T - D); dK = bf16(dS)^T Q; dQ = dS K,
//           summed in fp32 (a workspace tensor) and converted to bf16. With grouped-query heads
//           dK and dV are formed per query head and summed over each kv head's group.
//
// Layouts are strides: Q, K, V, dQ, dK, dV are column blocks of the (B,T,(NH+2*NKV)*HD) qkv rows,
// O and dO (B,T,NH*HD) rows; K^T and V^T are the same memory with the last two strides swapped.
//
// Each graph's operations are finalized on their own (no GPU needed: the tests check them on
// any machine with cuDNN), then planned for the handle with heuristics mode A: the first engine
// configuration that finalizes is kept per shape.
#include "lib/kernels/cuda/cudnn_sdpa.h"

#include <fmt/format.h>

#include "lib/core/error.h"
#include "lib/kernels/cuda/cudnn_api.h"

#ifdef MPIGPT_HAVE_CUDNN
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <limits>
#include <vector>
#endif

namespace mpigpt::cuda {

std::string cudnn_sdpa_unavailable() { return cudnn_load_error(); }

std::string cudnn_sdpa_version() {
#ifdef MPIGPT_HAVE_CUDNN
  if (cudnn_load_error().empty()) {
    const size_t v = cudnn().GetVersion();
    return fmt::format("cuDNN {}.{}.{}", v / 10000, v % 10000 / 100, v % 100);
  }
#endif
  return {};
}

#ifndef MPIGPT_HAVE_CUDNN

SdpaOpCounts cudnn_sdpa_finalize_operations(const SdpaShape&) { throw Error(cudnn_load_error()); }
SdpaPlans cudnn_sdpa_plan_for_device(const SdpaShape&, const std::string&) {
  throw Error(cudnn_load_error());
}

struct CudnnSdpa::Plans {};
CudnnSdpa::CudnnSdpa(void*) { throw Error(cudnn_load_error()); }
CudnnSdpa::~CudnnSdpa() = default;
bool CudnnSdpa::prepare(const SdpaShape&, std::string* why) {
  *why = cudnn_load_error();
  return false;
}
SdpaPlans CudnnSdpa::plans(const SdpaShape&) const { return {}; }
size_t CudnnSdpa::workspace_bytes(const SdpaShape&) const { return 0; }
void CudnnSdpa::forward(const SdpaShape&, void*, float*, const void*, void*) { throw Error(cudnn_load_error()); }
void CudnnSdpa::backward(const SdpaShape&, void*, const void*, const void*, const void*, const float*, void*) {
  throw Error(cudnn_load_error());
}

#else

namespace {

void check(cudnnStatus_t rc, const std::string& what) {
  if (rc != CUDNN_STATUS_SUCCESS) fail("cuDNN attention: {} failed: {}", what, cudnn_error_text(rc));
}

// Attributes deprecated in cuDNN 9 that its engines still read: the handle of an operation graph
// and of an execution plan (named by value: the enumerators carry deprecation warnings).
constexpr auto kGraphHandle = cudnnBackendAttributeName_t(800);  // CUDNN_ATTR_OPERATIONGRAPH_HANDLE
constexpr auto kPlanHandle = cudnnBackendAttributeName_t(400);   // CUDNN_ATTR_EXECUTION_PLAN_HANDLE

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

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
  std::string what_;
};

using Dims = std::array<int64_t, 4>;

// The user tensors' unique ids (the variant pack's keys); virtual tensors count from kFirstVirtual.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kMaskValue,                     // forward
  kDO, kDQ, kDK, kDV, kOne, kRowDot, kDQAccum,                        // backward
  kFirstVirtual = 100
};

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
        .set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode)
        .finalize();
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

  int op_count() const { return int(ops_.size()); }
  std::vector<cudnnBackendDescriptor_t> ops() const {
    std::vector<cudnnBackendDescriptor_t> v;
    for (const Desc* d : ops_) v.push_back(d->get());
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
  int64_t next_virtual_ = kFirstVirtual;
  std::deque<Desc> tensors_, descs_;  // deques: references stay valid as they grow
  std::vector<const Desc*> ops_;
};

// The tensors both graphs share, for shape s.
struct Layout {
  int64_t B, T, NH, NKV, HD, W;
  explicit Layout(const SdpaShape& s)
      : B(s.B), T(s.T), NH(s.NH), NKV(s.NKV), HD(s.HD), W(int64_t(s.NH) + 2 * int64_t(s.NKV)) {}
  Dims heads(int64_t h) const { return {B, h, T, HD}; }
  Dims heads_t(int64_t h) const { return {B, h, HD, T}; }  // transposed: (HD, T) per head
  Dims qkv_strides() const { return {T * W * HD, HD, W * HD, 1}; }
  Dims qkv_strides_t() const { return {T * W * HD, HD, 1, W * HD}; }
  Dims out_strides() const { return {T * NH * HD, HD, NH * HD, 1}; }
  Dims packed(int64_t h) const { return {h * T * HD, T * HD, HD, 1}; }  // (B,h,T,HD) contiguous
  Dims scores() const { return {B, NH, T, T}; }
  Dims score_strides() const { return {NH * T * T, T * T, T, 1}; }
  Dims score_strides_t() const { return {NH * T * T, T * T, 1, T}; }
  Dims rows() const { return {B, NH, T, 1}; }
  Dims row_strides() const { return {NH * T, T, 1, 1}; }
};

constexpr cudnnDataType_t kF32 = CUDNN_DATA_FLOAT, kBF16 = CUDNN_DATA_BFLOAT16;

// The masked, scaled scores of the forward and the backward: scale * Q K^T, -inf (the by-value
// kMaskValue) where the key follows the query. In the backward (lse given) the softmax statistics
// are subtracted before the mask, as cuDNN's frontend does.
const Desc& causal_scores(Graph& g, const Layout& l, const Desc& q, const Desc& kt, const Desc& scale,
                          const Desc& mask_value, const Desc* lse) {
  const Desc& s0 = g.tensor("Q K^T", l.scores(), l.score_strides(), kF32, 0);
  g.matmul("Q K^T", q, kt, s0);
  const Desc& s1 = g.tensor("scaled scores", l.scores(), l.score_strides(), kF32, 0);
  g.pointwise("scale", CUDNN_POINTWISE_MUL, s0, &scale, nullptr, s1);
  const Desc* s = &s1;
  if (lse) {
    const Desc& s2 = g.tensor("scores - lse", l.scores(), l.score_strides(), kF32, 0);
    g.pointwise("subtract lse", CUDNN_POINTWISE_SUB, s1, lse, nullptr, s2);
    s = &s2;
  }
  const Desc& row = g.tensor("row index", l.scores(), l.score_strides(), CUDNN_DATA_INT32, 0);
  g.pointwise("row index", CUDNN_POINTWISE_GEN_INDEX, *s, nullptr, nullptr, row, kF32, 2);
  const Desc& col = g.tensor("column index", l.scores(), l.score_strides(), CUDNN_DATA_INT32, 0);
  g.pointwise("column index", CUDNN_POINTWISE_GEN_INDEX, *s, nullptr, nullptr, col, kF32, 3);
  const Desc& keep = g.tensor("causal mask", l.scores(), l.score_strides(), CUDNN_DATA_BOOLEAN, 0);
  g.pointwise("row >= column", CUDNN_POINTWISE_CMP_GE, row, &col, nullptr, keep, CUDNN_DATA_BOOLEAN);
  const Desc& masked = g.tensor("masked scores", l.scores(), l.score_strides(), kF32, 0);
  g.pointwise("mask", CUDNN_POINTWISE_BINARY_SELECT, *s, &mask_value, &keep, masked);
  return masked;
}

void build_forward(Graph& g, const SdpaShape& s) {
  const Layout l(s);
  const Desc& q = g.tensor("Q", l.heads(l.NH), l.qkv_strides(), kBF16, kQ);
  const Desc& kt = g.tensor("K^T", l.heads_t(l.NKV), l.qkv_strides_t(), kBF16, kK);
  const Desc& v = g.tensor("V", l.heads(l.NKV), l.qkv_strides(), kBF16, kV);
  const Desc& o = g.tensor("O", l.heads(l.NH), l.out_strides(), kBF16, kO);
  const Desc& stats = g.tensor("lse", l.rows(), l.row_strides(), kF32, kStats);
  const Desc& scale = g.scalar("scale", kScale);
  const Desc& mask_value = g.scalar("mask value", kMaskValue);

  const Desc& sc = causal_scores(g, l, q, kt, scale, mask_value, nullptr);
  const Desc& mx = g.tensor("row max", l.rows(), l.row_strides(), kF32, 0);
  g.reduction("row max", CUDNN_REDUCE_TENSOR_MAX, sc, mx);
  const Desc& shifted = g.tensor("scores - max", l.scores(), l.score_strides(), kF32, 0);
  g.pointwise("subtract max", CUDNN_POINTWISE_SUB, sc, &mx, nullptr, shifted);
  const Desc& e = g.tensor("exp", l.scores(), l.score_strides(), kF32, 0);
  g.pointwise("exp", CUDNN_POINTWISE_EXP, shifted, nullptr, nullptr, e);
  const Desc& z = g.tensor("row sum", l.rows(), l.row_strides(), kF32, 0);
  g.reduction("row sum", CUDNN_REDUCE_TENSOR_ADD, e, z);
  const Desc& logz = g.tensor("log row sum", l.rows(), l.row_strides(), kF32, 0);
  g.pointwise("log", CUDNN_POINTWISE_LOG, z, nullptr, nullptr, logz);
  g.pointwise("lse = max + log sum", CUDNN_POINTWISE_ADD, mx, &logz, nullptr, stats);
  const Desc& p = g.tensor("P", l.scores(), l.score_strides(), kBF16, 0);
  g.pointwise("normalise", CUDNN_POINTWISE_DIV, e, &z, nullptr, p);
  g.matmul("P V", p, v, o);
}

// A key or value gradient: grad = bf16(m)^T x for a score-shaped m (B,NH,T,T) and x (B,NH,T,HD),
// formed per query head and, with grouped-query heads, summed over each kv head's group.
void kv_gradient(Graph& g, const Layout& l, const char* m_name, const Desc& m, const char* x_name, const Desc& x,
                 const char* grad_name, const Desc& grad) {
  const std::string mt_name = fmt::format("{}^T", m_name), product = fmt::format("{}^T {}", m_name, x_name);
  const Desc& mt = g.tensor(mt_name.c_str(), l.scores(), l.score_strides_t(), kBF16, 0);
  g.reshape(mt_name.c_str(), m, mt);
  if (l.NKV == l.NH) {
    g.matmul(product.c_str(), mt, x, grad);
    return;
  }
  const std::string full = fmt::format("{} per query head", grad_name), sum = fmt::format("{} group sum", grad_name);
  const Desc& per_head = g.tensor(full.c_str(), l.heads(l.NH), l.packed(l.NH), kBF16, 0);
  g.matmul(product.c_str(), mt, x, per_head);
  g.reduction(sum.c_str(), CUDNN_REDUCE_TENSOR_ADD, per_head, grad);
}

void build_backward(Graph& g, const SdpaShape& s) {
  const Layout l(s);
  const Desc& q = g.tensor("Q", l.heads(l.NH), l.qkv_strides(), kBF16, kQ);
  const Desc& kt = g.tensor("K^T", l.heads_t(l.NKV), l.qkv_strides_t(), kBF16, kK);
  const Desc& vt = g.tensor("V^T", l.heads_t(l.NKV), l.qkv_strides_t(), kBF16, kV);
  const Desc& o = g.tensor("O", l.heads(l.NH), l.out_strides(), kBF16, kO);
  const Desc& d_o = g.tensor("dO", l.heads(l.NH), l.out_strides(), kBF16, kDO);
  const Desc& stats = g.tensor("lse", l.rows(), l.row_strides(), kF32, kStats);
  const Desc& dq = g.tensor("dQ", l.heads(l.NH), l.qkv_strides(), kBF16, kDQ);
  const Desc& dk = g.tensor("dK", l.heads(l.NKV), l.qkv_strides(), kBF16, kDK);
  const Desc& dv = g.tensor("dV", l.heads(l.NKV), l.qkv_strides(), kBF16, kDV);
  const Desc& scale = g.scalar("scale", kScale);
  const Desc& mask_value = g.scalar("mask value", kMaskValue);
  const Desc& one = g.scalar("one", kOne);
  const Desc& rowdot = g.tensor("rowsum(dO * O)", l.rows(), l.row_strides(), kF32, kRowDot);
  const Desc& dq_accum = g.tensor("dQ (fp32)", l.heads(l.NH), l.packed(l.NH), kF32, kDQAccum);

  // D = rowsum(dO * O), stored (through a multiply by one, as the frontend does).
  const Desc& prod = g.tensor("dO * O", l.heads(l.NH), l.packed(l.NH), kF32, 0);
  g.pointwise("dO * O", CUDNN_POINTWISE_MUL, d_o, &o, nullptr, prod);
  const Desc& rsum = g.tensor("row sum of dO * O", l.rows(), l.row_strides(), kF32, 0);
  g.reduction("row sum of dO * O", CUDNN_REDUCE_TENSOR_ADD, prod, rsum);
  g.pointwise("store D", CUDNN_POINTWISE_MUL, rsum, &one, nullptr, rowdot);

  // P = exp(masked scores - lse).
  const Desc& sc = causal_scores(g, l, q, kt, scale, mask_value, &stats);
  const Desc& p = g.tensor("P", l.scores(), l.score_strides(), kF32, 0);
  g.pointwise("exp", CUDNN_POINTWISE_EXP, sc, nullptr, nullptr, p);

  kv_gradient(g, l, "P", p, "dO", d_o, "dV", dv);  // dV = P^T dO

  // dS = scale * P * (dO V^T - D).
  const Desc& dp = g.tensor("dO V^T", l.scores(), l.score_strides(), kF32, 0);
  g.matmul("dO V^T", d_o, vt, dp);
  const Desc& dpd = g.tensor("dP - D", l.scores(), l.score_strides(), kF32, 0);
  g.pointwise("dP - D", CUDNN_POINTWISE_SUB, dp, &rowdot, nullptr, dpd);
  const Desc& pdp = g.tensor("P (dP - D)", l.scores(), l.score_strides(), kF32, 0);
  g.pointwise("P (dP - D)", CUDNN_POINTWISE_MUL, dpd, &p, nullptr, pdp);
  const Desc& ds = g.tensor("dS", l.scores(), l.score_strides(), kF32, 0);
  g.pointwise("scale dS", CUDNN_POINTWISE_MUL, pdp, &scale, nullptr, ds);

  kv_gradient(g, l, "dS", ds, "Q", q, "dK", dk);  // dK = dS^T Q

  // dQ = dS K, in fp32, then to bf16.
  const Desc& k = g.tensor("K", l.heads(l.NKV), l.qkv_strides(), kF32, 0);
  g.reshape("K", kt, k);
  g.matmul("dS K", ds, k, dq_accum);
  g.pointwise("dQ to bf16", CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, dq);
}

// The backward's own fp32 tensors ahead of cuDNN's workspace, each on a 256-byte boundary: dQ at
// 0, D (B,NH,T) at rowdot, cuDNN's workspace at total.
struct BackwardWorkspace {
  size_t rowdot, total;
};
BackwardWorkspace backward_workspace(const SdpaShape& s) {
  auto round_up = [](size_t n) { return (n + 255) / 256 * 256; };
  const size_t rows = size_t(s.B) * size_t(s.NH) * size_t(s.T);
  const size_t dq = round_up(rows * size_t(s.HD) * sizeof(float));
  return {dq, dq + round_up(rows * sizeof(float))};
}

// Why cuDNN's fused engines cannot take this shape on this cuDNN (the frontend's support checks).
std::string shape_unsupported(const SdpaShape& s, size_t version) {
  if (s.HD % 8 != 0 || s.HD > 128) return fmt::format("head dim {} is not a multiple of 8 up to 128", s.HD);
  if (s.T < 2) return "the backward needs at least 2 tokens";
  if (version == 91000 || version == 91001) return "cuDNN 9.10.0 and 9.10.1 have known bf16 attention bugs";
  if (version <= 91500 && s.T % 128 != 0)
    return fmt::format("cuDNN {} (9.15.0 or older) runs the backward only for T a multiple of 128 (T = {})", version,
                       s.T);
  return {};
}

}  // namespace

SdpaOpCounts cudnn_sdpa_finalize_operations(const SdpaShape& shape) {
  Graph fwd("forward"), bwd("backward");
  build_forward(fwd, shape);
  build_backward(bwd, shape);
  return {fwd.op_count(), bwd.op_count()};
}

// A planned graph: its descriptors, the engine configuration chosen and the plan.
struct Planned {
  Graph graph;
  std::unique_ptr<Desc> opgraph, heuristics, config, plan;  // kept for the plan's life
  SdpaPlanInfo info;
  explicit Planned(const char* name) : graph(name) {}
};

// The forward and backward graphs of a shape, to be planned (on a handle or a described device).
struct CudnnSdpa::Plans {
  Planned fwd{"forward"}, bwd{"backward"};
  explicit Plans(const SdpaShape& shape) {
    build_forward(fwd.graph, shape);
    build_backward(bwd.graph, shape);
  }
  SdpaPlans info() const { return {fwd.info, bwd.info}; }
};

namespace {

// Where a plan is made for: a handle on the current device, or (device-less, cuDNN 9.8 on) a device
// property descriptor made from another machine's description (cudnn_sdpa_plan_for_device).
struct Target {
  cudnnHandle_t handle = nullptr;
  cudnnBackendDescriptor_t device = nullptr;
};

// The global index of the engine a finalized engine configuration runs, for the reports: -1 when
// cuDNN does not say (never an error).
int64_t engine_index(cudnnBackendDescriptor_t config, const std::string& name) {
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, name + " engine");
  cudnnBackendDescriptor_t raw = engine.get();
  int64_t n = 0, index = -1;
  if (cudnn().BackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &raw) !=
          CUDNN_STATUS_SUCCESS ||
      cudnn().BackendGetAttribute(raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index) !=
          CUDNN_STATUS_SUCCESS)
    return -1;
  return index;
}

// Plans g's operations for the target: the first engine configuration of heuristics mode A whose
// plan finalizes. (Not FALLBACK: its engines would be generic ones, where the builtin kernels are
// the better fallback.) False when none does, each configuration's reason in p.rejected.
bool try_plan(Planned& p, Target target) {
  const std::vector<cudnnBackendDescriptor_t> ops = p.graph.ops();
  const std::string& name = p.graph.name();
  p.opgraph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, name + " operation graph");
  p.opgraph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(), int64_t(ops.size()));
  // Deprecated (as the plan's below): a cuDNN that no longer takes it does not need it.
  if (target.handle)
    (void)cudnn().BackendSetAttribute(p.opgraph->get(), kGraphHandle, CUDNN_TYPE_HANDLE, 1, &target.handle);
  p.opgraph->finalize();
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  auto heur = std::make_unique<Desc>(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, name + " heuristics");
  const cudnnBackendDescriptor_t graph = p.opgraph->get();
  heur->set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, &graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
  if (target.device) heur->set(CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, &target.device);
  check(cudnn().BackendFinalize(heur->get()), name + ": heuristics mode A");
  int64_t count = 0;
  check(cudnn().BackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                    &count, nullptr),
        name + ": counting the heuristics' engine configurations");
  std::deque<Desc> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i)
    raw.push_back(configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, name + " engine configuration").get());
  int64_t returned = 0;
  if (count > 0)
    check(cudnn().BackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                      count, &returned, raw.data()),
          name + ": reading the heuristics' engine configurations");
  p.info.offered = returned;
  for (int64_t i = 0; i < returned; ++i) {
    const int64_t engine = engine_index(raw[size_t(i)], name);
    auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, name + " execution plan");
    if (target.handle)
      (void)cudnn().BackendSetAttribute(plan->get(), kPlanHandle, CUDNN_TYPE_HANDLE, 1, &target.handle);
    if (target.device) plan->set(CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, &target.device);
    plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw[size_t(i)]);
    const cudnnStatus_t rc = cudnn().BackendFinalize(plan->get());
    if (rc != CUDNN_STATUS_SUCCESS) {
      const std::string why = cudnn_error_text(rc);
      // The engine's kernels were generated and compiled; the CUDA driver could not load them
      // (only the device-less planning of a machine without a driver gets this far and no further).
      if (rc == CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER && why.find("cuLibraryLoadData") != std::string::npos)
        ++p.info.built;
      p.info.rejected.push_back(fmt::format("configuration {} (engine {}): {}", i, engine, why));
      continue;
    }
    int64_t ws = 0, n = 0;
    check(cudnn().BackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                      &ws),
          name + ": reading the plan's workspace size");
    p.info.workspace = ws;
    p.info.chosen = i;
    p.info.engine = engine;
    p.plan = std::move(plan);
    p.config = std::make_unique<Desc>(std::move(configs[size_t(i)]));
    p.heuristics = std::move(heur);
    return true;
  }
  if (returned == 0) p.info.rejected.push_back("heuristics mode A offered no engine configuration");
  return false;
}

void make_plan(Planned& p, Target target) {
  if (try_plan(p, target)) return;
  std::string tried;
  for (const std::string& r : p.info.rejected) tried += "; " + r;
  fail("no cuDNN engine runs the {} graph{}", p.graph.name(), tried);
}

// Queues plan p with the (uid, pointer) pairs and the workspace.
void execute(cudnnHandle_t handle, const Planned& p, const std::vector<int64_t>& uids, std::vector<void*> ptrs,
             void* workspace) {
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, p.graph.name() + " variant pack");
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &workspace)
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(), int64_t(ptrs.size()))
      .set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), int64_t(uids.size()))
      .finalize();
  check(cudnn().BackendExecute(handle, p.plan->get(), pack.get()),
        "executing the " + p.graph.name() + " (engine.attention_backend = builtin runs the builtin kernels instead)");
}

cudnnHandle_t as_handle(void* h) { return static_cast<cudnnHandle_t>(h); }

// The value of the masked scores: -inf from cuDNN 9.10 on, the lowest float before (as the
// frontend chooses).
float mask_value() {
  return cudnn().GetVersion() >= 91000 ? -std::numeric_limits<float>::infinity()
                                       : std::numeric_limits<float>::lowest();
}

}  // namespace

SdpaPlans cudnn_sdpa_plan_for_device(const SdpaShape& shape, const std::string& device_json) {
  if (cudnn().GetVersion() < 90800)
    fail("cuDNN attention: planning for a described device needs cuDNN 9.8 or newer, this is {}",
         cudnn_sdpa_version());
  if (std::string why = shape_unsupported(shape, cudnn().GetVersion()); !why.empty())
    fail("cuDNN attention: cuDNN does not run this shape: {}", why);
  Desc device(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, "device description");
  device.set(CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR, device_json.data(),
             int64_t(device_json.size()));
  device.finalize();
  CudnnSdpa::Plans plans(shape);
  try_plan(plans.fwd, {nullptr, device.get()});
  try_plan(plans.bwd, {nullptr, device.get()});
  return plans.info();
}

CudnnSdpa::CudnnSdpa(void* stream) : stream_(stream) {
  cudnnHandle_t h = nullptr;
  check(cudnn().Create(&h), "creating a handle (cudnnCreate)");
  if (const cudnnStatus_t rc = cudnn().SetStream(h, static_cast<cudaStream_t>(stream)); rc != CUDNN_STATUS_SUCCESS) {
    (void)cudnn().Destroy(h);  // the destructor does not run for a constructor that throws
    check(rc, "binding the handle to the stream");
  }
  handle_ = h;
}

CudnnSdpa::~CudnnSdpa() {
  plans_.clear();
  if (handle_) (void)cudnn().Destroy(as_handle(handle_));
}

bool CudnnSdpa::prepare(const SdpaShape& shape, std::string* why) {
  if (plans_.count(shape)) return true;
  if (auto it = unsupported_.find(shape); it != unsupported_.end()) {
    *why = it->second;
    return false;
  }
  std::string reason = shape_unsupported(shape, cudnn().GetVersion());
  if (reason.empty()) {
    try {
      auto plans = std::make_unique<Plans>(shape);
      make_plan(plans->fwd, {as_handle(handle_), nullptr});
      make_plan(plans->bwd, {as_handle(handle_), nullptr});
      plans_.emplace(shape, std::move(plans));
      return true;
    } catch (const Error& e) {
      reason = e.what();
    }
  }
  *why = reason;
  unsupported_.emplace(shape, reason);
  return false;
}

SdpaPlans CudnnSdpa::plans(const SdpaShape& shape) const { return plans_.at(shape)->info(); }

size_t CudnnSdpa::workspace_bytes(const SdpaShape& shape) const {
  const Plans& p = *plans_.at(shape);
  return std::max(size_t(p.fwd.info.workspace), backward_workspace(shape).total + size_t(p.bwd.info.workspace));
}

void CudnnSdpa::forward(const SdpaShape& shape, void* out, float* lse, const void* qkv, void* workspace) {
  const Plans& p = *plans_.at(shape);
  const size_t el = 2;  // bf16
  char* base = static_cast<char*>(const_cast<void*>(qkv));
  float scale = float(1.0 / std::sqrt(double(shape.HD))), masked = mask_value();
  execute(as_handle(handle_), p.fwd, {kQ, kK, kV, kO, kStats, kScale, kMaskValue},
          {base, base + size_t(shape.NH) * shape.HD * el, base + size_t(shape.NH + shape.NKV) * shape.HD * el, out,
           lse, &scale, &masked},
          workspace);
}

void CudnnSdpa::backward(const SdpaShape& shape, void* dqkv, const void* dout, const void* qkv, const void* out,
                         const float* lse, void* workspace) {
  const Plans& p = *plans_.at(shape);
  const size_t el = 2;  // bf16
  const size_t k_off = size_t(shape.NH) * shape.HD * el, v_off = size_t(shape.NH + shape.NKV) * shape.HD * el;
  char* base = static_cast<char*>(const_cast<void*>(qkv));
  char* dbase = static_cast<char*>(dqkv);
  char* ws = static_cast<char*>(workspace);
  const BackwardWorkspace layout = backward_workspace(shape);
  // Before cuDNN 9.6 the engines accumulate into dQ's fp32 tensor without clearing it first.
  if (cudnn().GetVersion() < 90600)
    if (cudaMemsetAsync(ws, 0, layout.rowdot, static_cast<cudaStream_t>(stream_)) != cudaSuccess)
      fail("cuDNN attention: clearing the fp32 dQ (cudaMemsetAsync of {} bytes) failed", layout.rowdot);
  float scale = float(1.0 / std::sqrt(double(shape.HD))), masked = mask_value(), one = 1.0f;
  execute(as_handle(handle_), p.bwd,
          {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kMaskValue, kOne, kRowDot, kDQAccum},
          {base, base + k_off, base + v_off, const_cast<void*>(out), const_cast<void*>(dout),
           const_cast<float*>(lse), dbase, dbase + k_off, dbase + v_off, &scale, &masked, &one, ws + layout.rowdot,
           ws},
          ws + layout.total);
}

#endif

}  // namespace mpigpt::cuda
