// The ops' fronts (ops.h) of attention: rotary embedding, the causal and the blockwise attention, the
// merge of blockwise results, and the row and column moves around them.
#include "lib/kernels/op_checks.h"

namespace mpigpt {

// ---- rotary embedding ----------------------------------------------------------------------------

namespace {
void check_rope(OpArgs& a, const char* name, const Tensor& qkv, const Tensor& positions, int NH, int NKV, int HD,
                float theta) {
  a.data(name, qkv).i32("positions", positions);
  check_heads(a, NH, NKV, HD);
  a.require(HD % 2 == 0, "head dim {} must be even", HD).require(theta > 0.0f, "theta {} must be positive", theta);
  const int64_t R = int64_t(NH + 2 * NKV) * HD;
  const Mat m = mat_of(qkv);
  a.require(m.cols == R && positions.numel() == m.rows,
            "{} {} must be (N, (NH+2*NKV)*HD) = (N, {}) with positions {} of N elements", name, qkv.shape.str(), R,
            positions.shape.str());
}
}  // namespace

void Ops::rope_forward(Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta) {
  OpArgs a(*this, "rope_forward");
  check_rope(a, "qkv", qkv, positions, NH, NKV, HD, theta);
  run("rope_forward", [&] { rope_forward_impl(qkv, positions, NH, NKV, HD, theta); });
}

void Ops::rope_backward(Tensor dqkv, Tensor positions, int NH, int NKV, int HD, float theta) {
  OpArgs a(*this, "rope_backward");
  check_rope(a, "dqkv", dqkv, positions, NH, NKV, HD, theta);
  run("rope_backward", [&] { rope_backward_impl(dqkv, positions, NH, NKV, HD, theta); });
}

// ---- causal attention ----------------------------------------------------------------------------

namespace {
// qkv (B,T,(NH+2*NKV)*HD), out (B,T,NH*HD) in the data dtype, saved (the backend's count) f32.
void check_causal(const Ops& ops, OpArgs& a, const char* out_name, const Tensor& out, const Tensor& saved,
                  const Tensor& qkv, int NH, int NKV, int HD) {
  a.data("qkv", qkv).data(out_name, out).f32("saved", saved);
  check_heads(a, NH, NKV, HD);
  const int64_t R = int64_t(NH + 2 * NKV) * HD;
  a.require(qkv.ndim() == 3 && qkv.size(2) == R, "qkv {} must be (B, T, (NH+2*NKV)*HD = {})", qkv.shape.str(), R);
  const int64_t B = qkv.size(0), T = qkv.size(1), C = int64_t(NH) * HD;
  a.require(out.numel() == B * T * C, "{} {} must be (B, T, NH*HD) = ({}, {}, {})", out_name, out.shape.str(), B, T, C);
  a.require(saved.numel() >= ops.attention_saved_numel(B, T, NH), "saved {} needs {} elements", saved.str(),
            ops.attention_saved_numel(B, T, NH));
}
}  // namespace

void Ops::attention_forward(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) {
  OpArgs a(*this, "attention_forward");
  check_causal(*this, a, "out", out, saved, qkv, NH, NKV, HD);
  run("attention_forward", [&] { attention_forward_impl(out, saved, qkv, NH, NKV, HD); });
}

void Ops::attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                             int HD) {
  OpArgs a(*this, "attention_backward");
  check_causal(*this, a, "dout", dout, saved, qkv, NH, NKV, HD);
  a.data("dqkv", dqkv).data("out", out);
  a.require(dqkv.numel() == qkv.numel(), "dqkv {} must have the shape of qkv {}", dqkv.shape.str(), qkv.shape.str());
  a.require(out.numel() == dout.numel(), "out {} must have the shape of dout {}", out.shape.str(), dout.shape.str());
  run("attention_backward", [&] { attention_backward_impl(dqkv, dout, qkv, out, saved, NH, NKV, HD); });
}

// ---- blockwise attention -------------------------------------------------------------------------

namespace {
// Queries from qkv (B,Tq,(NH+2*NKV)*HD), keys/values from kv (B,Tk,2*NKV*HD), out (B,Tq,NH*HD),
// lse (B,NH,Tq) f32, the mask (B,Tq) and (B,Tk) i32.
void check_block(OpArgs& a, const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                 const Tensor& qpos, const Tensor& qseg, const Tensor& kpos, const Tensor& kseg, int NH, int NKV,
                 int HD) {
  a.data("out", out).data("qkv", qkv).data("kv", kv).f32("lse", lse);
  a.i32("qpos", qpos).i32("qseg", qseg).i32("kpos", kpos).i32("kseg", kseg);
  check_heads(a, NH, NKV, HD);
  const int64_t R = int64_t(NH + 2 * NKV) * HD, RK = int64_t(2 * NKV) * HD;
  a.require(qkv.ndim() == 3 && qkv.size(2) == R, "qkv {} must be (B, Tq, (NH+2*NKV)*HD = {})", qkv.shape.str(), R);
  const int64_t B = qkv.size(0), Tq = qkv.size(1);
  a.require(kv.ndim() == 3 && kv.size(0) == B && kv.size(2) == RK,
            "kv {} must be (B = {}, Tk, 2*NKV*HD = {}) for qkv {}", kv.shape.str(), B, RK, qkv.shape.str());
  const int64_t Tk = kv.size(1), C = int64_t(NH) * HD;
  a.require(out.numel() == B * Tq * C, "out {} must be (B, Tq, NH*HD) = ({}, {}, {})", out.shape.str(), B, Tq, C);
  a.require(lse.numel() == B * NH * Tq, "lse {} must be (B, NH, Tq) = ({}, {}, {})", lse.shape.str(), B, NH, Tq);
  a.require(qpos.numel() == B * Tq && qseg.numel() == B * Tq, "qpos {} and qseg {} must be (B, Tq) = ({}, {})",
            qpos.shape.str(), qseg.shape.str(), B, Tq);
  a.require(kpos.numel() == B * Tk && kseg.numel() == B * Tk, "kpos {} and kseg {} must be (B, Tk) = ({}, {})",
            kpos.shape.str(), kseg.shape.str(), B, Tk);
}
}  // namespace

void Ops::attention_block_forward(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                                  Tensor kpos, Tensor kseg, int NH, int NKV, int HD) {
  OpArgs a(*this, "attention_block_forward");
  check_block(a, out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  run("attention_block_forward",
      [&] { attention_block_forward_impl(out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD); });
}

void Ops::attention_merge(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse) {
  OpArgs a(*this, "attention_merge");
  a.data("out", out).data("blk_out", blk_out).f32("lse", lse).f32("blk_lse", blk_lse);
  a.require(lse.ndim() == 3 && blk_lse.shape == lse.shape, "lse {} and blk_lse {} must both be (B, NH, Tq)",
            lse.shape.str(), blk_lse.shape.str());
  const int64_t B = lse.size(0), NH = lse.size(1), Tq = lse.size(2);
  const Mat mo = mat_of(out), mb = mat_of(blk_out);
  a.require(NH > 0 && mo.cols > 0 && mo.rows == B * Tq && mo.cols % NH == 0 && mb.rows == mo.rows &&
                mb.cols == mo.cols,
            "out {} and blk_out {} must both be (B, Tq, NH*HD) with (B, NH, Tq) = lse {}", out.shape.str(),
            blk_out.shape.str(), lse.shape.str());
  run("attention_merge", [&] { attention_merge_impl(out, lse, blk_out, blk_lse); });
}

void Ops::attention_block_backward(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out,
                                   Tensor lse, Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV,
                                   int HD) {
  OpArgs a(*this, "attention_block_backward");
  check_block(a, out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  a.data("dqkv", dqkv).data("dkv", dkv).data("dout", dout);
  a.require(dqkv.numel() == qkv.numel(), "dqkv {} must have the shape of qkv {}", dqkv.shape.str(), qkv.shape.str());
  a.require(dkv.numel() == kv.numel(), "dkv {} must have the shape of kv {}", dkv.shape.str(), kv.shape.str());
  a.require(dout.numel() == out.numel(), "dout {} must have the shape of out {}", dout.shape.str(), out.shape.str());
  run("attention_block_backward", [&] {
    attention_block_backward_impl(dqkv, dkv, dout, qkv, kv, out, lse, qpos, qseg, kpos, kseg, NH, NKV, HD);
  });
}

// ---- rows and columns ----------------------------------------------------------------------------

void Ops::copy_cols(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t ncols) {
  const Mat md = mat_of(dst), ms = mat_of(src);
  OpArgs(*this, "copy_cols")
      .data("dst", dst)
      .data("src", src)
      .require(md.rows == ms.rows, "dst {} and src {} must have the same number of rows", dst.shape.str(),
               src.shape.str())
      .require(ncols >= 0 && dst_col >= 0 && src_col >= 0 && dst_col + ncols <= md.cols && src_col + ncols <= ms.cols,
               "columns [{}, {}) of dst {} and [{}, {}) of src {} must lie inside them", dst_col, dst_col + ncols,
               dst.shape.str(), src_col, src_col + ncols, src.shape.str());
  run("copy_cols", [&] { copy_cols_impl(dst, dst_col, src, src_col, ncols); });
}

void Ops::gather_rows(Tensor out, Tensor inp, Tensor index) {
  const Mat mo = mat_of(out), mi = mat_of(inp);
  OpArgs(*this, "gather_rows")
      .data("out", out)
      .data("inp", inp)
      .i32("index", index)
      .require(mo.cols == mi.cols && index.numel() == mo.rows,
               "out {} must be (M, C) for inp {} (N, C) and index {} (M)", out.shape.str(), inp.shape.str(),
               index.shape.str());
  run("gather_rows", [&] { gather_rows_impl(out, inp, index); });
}

void Ops::scatter_add_rows(Tensor dinp, Tensor dout, Tensor index) {
  const Mat mi = mat_of(dinp), mo = mat_of(dout);
  OpArgs(*this, "scatter_add_rows")
      .data("dinp", dinp)
      .data("dout", dout)
      .i32("index", index)
      .require(mo.cols == mi.cols && index.numel() == mo.rows,
               "dout {} must be (M, C) for dinp {} (N, C) and index {} (M)", dout.shape.str(), dinp.shape.str(),
               index.shape.str());
  run("scatter_add_rows", [&] { scatter_add_rows_impl(dinp, dout, index); });
}

}  // namespace mpigpt
