// The operation graphs of cuDNN's fused attention (cudnn_sdpa.cu plans and runs them).
#include <fmt/format.h>

#include "lib/core/error.h"
#include "lib/kernels/cuda/cudnn_api.h"
#include "lib/kernels/cuda/cudnn_sdpa.h"
#include "lib/kernels/cuda/cudnn_sdpa_graphs.h"

namespace mpigpt::cuda {

#ifdef MPIGPT_HAVE_CUDNN

namespace sdpa {

void check(cudnnStatus_t rc, const std::string& what) {
  if (rc != CUDNN_STATUS_SUCCESS) fail("cuDNN attention: {} failed: {}", what, cudnn_error_text(rc));
}

namespace {

// The tensors both graphs share, for shape s. Layouts are strides: Q, K, V, dQ, dK, dV are column
// blocks of the (B,T,(NH+2*NKV)*HD) qkv rows, O and dO (B,T,NH*HD) rows; K^T and V^T are the same
// memory with the last two strides swapped.
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
// kSdpaMaskValue) where the key follows the query. In the backward (lse given) the softmax
// statistics are subtracted before the mask, as cuDNN's frontend does.
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

}  // namespace

// cuDNN 9 runs fused flash attention for a pattern of matmul, pointwise and reduction operations
// (its single attention operations take a causal mask only from 9.21 on, and the backward one is
// chosen by the heuristics only from 9.27): these graphs are that pattern, built as cuDNN's own
// frontend builds them for causal training (bf16 in and out, fp32 softmax statistics).
// S = scale * Q K^T, masked to -inf above the diagonal (GEN_INDEX rows and columns, CMP_GE,
// BINARY_SELECT); M = rowmax S, Z = rowsum exp(S - M); lse = M + log Z (the natural-log
// log-sum-exp, (B,NH,T) fp32: the builtin kernels' saved state); O = bf16(exp(S - M) / Z) V.
void build_forward(Graph& g, const SdpaShape& s) {
  const Layout l(s);
  const Desc& q = g.tensor("Q", l.heads(l.NH), l.qkv_strides(), kBF16, kSdpaQ);
  const Desc& kt = g.tensor("K^T", l.heads_t(l.NKV), l.qkv_strides_t(), kBF16, kSdpaK);
  const Desc& v = g.tensor("V", l.heads(l.NKV), l.qkv_strides(), kBF16, kSdpaV);
  const Desc& o = g.tensor("O", l.heads(l.NH), l.out_strides(), kBF16, kSdpaO);
  const Desc& stats = g.tensor("lse", l.rows(), l.row_strides(), kF32, kSdpaStats);
  const Desc& scale = g.scalar("scale", kSdpaScale);
  const Desc& mask_value = g.scalar("mask value", kSdpaMaskValue);

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

// D = rowsum(dO * O) (into an fp32 tensor in our workspace); P = exp(masked S - lse);
// dV = bf16(P)^T dO; dS = scale * P * (dO V^T - D); dK = bf16(dS)^T Q; dQ = dS K, summed in fp32 (a
// workspace tensor) and converted to bf16. With grouped-query heads dK and dV are formed per query
// head and summed over each kv head's group.
void build_backward(Graph& g, const SdpaShape& s) {
  const Layout l(s);
  const Desc& q = g.tensor("Q", l.heads(l.NH), l.qkv_strides(), kBF16, kSdpaQ);
  const Desc& kt = g.tensor("K^T", l.heads_t(l.NKV), l.qkv_strides_t(), kBF16, kSdpaK);
  const Desc& vt = g.tensor("V^T", l.heads_t(l.NKV), l.qkv_strides_t(), kBF16, kSdpaV);
  const Desc& o = g.tensor("O", l.heads(l.NH), l.out_strides(), kBF16, kSdpaO);
  const Desc& d_o = g.tensor("dO", l.heads(l.NH), l.out_strides(), kBF16, kSdpaDO);
  const Desc& stats = g.tensor("lse", l.rows(), l.row_strides(), kF32, kSdpaStats);
  const Desc& dq = g.tensor("dQ", l.heads(l.NH), l.qkv_strides(), kBF16, kSdpaDQ);
  const Desc& dk = g.tensor("dK", l.heads(l.NKV), l.qkv_strides(), kBF16, kSdpaDK);
  const Desc& dv = g.tensor("dV", l.heads(l.NKV), l.qkv_strides(), kBF16, kSdpaDV);
  const Desc& scale = g.scalar("scale", kSdpaScale);
  const Desc& mask_value = g.scalar("mask value", kSdpaMaskValue);
  const Desc& one = g.scalar("one", kSdpaOne);
  const Desc& rowdot = g.tensor("rowsum(dO * O)", l.rows(), l.row_strides(), kF32, kSdpaRowDot);
  const Desc& dq_accum = g.tensor("dQ (fp32)", l.heads(l.NH), l.packed(l.NH), kF32, kSdpaDQAccum);

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

}  // namespace sdpa

#endif

}  // namespace mpigpt::cuda
