// The ops' fronts (ops.h): memory, element-wise and matrix products, and the shared argument
// checks and per-op timing; the layers' ops are in ops_layers.cpp, attention's in ops_attention.cpp.
#include <algorithm>

#include "lib/kernels/op_checks.h"

namespace mpigpt {

// ---- argument checks -----------------------------------------------------------------------------

OpArgs& OpArgs::present(const char* what, const Tensor& t) {
  if (!t.defined()) fail("{}: {} is required but undefined", op_, what);
  if (t.device != ops_.device())
    fail("{}: {} {} lives in {} memory, but this backend's ops take {} tensors (copy it with ops.copy first)", op_,
         what, t.str(), t.device == Device::CPU ? "host" : "device", ops_.device() == Device::CPU ? "host" : "device");
  return *this;
}

OpArgs& OpArgs::data(const char* what, const Tensor& t) {
  present(what, t);
  if (!first_data_) {
    if (!ops_.computes_in(t.dtype))
      fail("{}: {} is {}, a dtype this backend does not compute in ({})", op_, what, t.str(), ops_.name());
    first_data_ = what;
    data_dtype_ = t.dtype;
  } else if (t.dtype != data_dtype_) {
    fail("{}: the data tensors of one call share one dtype, but {} is {} and {} is {}", op_, first_data_,
         dtype_name(data_dtype_), what, t.str());
  }
  return *this;
}

OpArgs& OpArgs::typed(const char* what, const Tensor& t, DType dt) {
  present(what, t);
  if (t.dtype != dt) fail("{}: {} must be {}, got {}", op_, what, dtype_name(dt), t.str());
  return *this;
}

OpArgs& OpArgs::like(const char* what, const Tensor& t, const char* base_name, const Tensor& base) {
  return require(!t.defined() || (t.numel() == base.numel() && mat_of(t).cols == mat_of(base).cols),
                 "{} {} must have the shape of {} {}", what, t.shape.str(), base_name, base.shape.str());
}

OpArgs& OpArgs::len(const char* what, const Tensor& t, int64_t n, const char* of) {
  return require(!t.defined() || t.numel() == n, "{} {} must have {} = {} elements", what, t.shape.str(), of, n);
}

void check_heads(OpArgs& a, int NH, int NKV, int HD) {
  a.require(NH > 0 && NKV > 0 && HD > 0 && NH % NKV == 0,
            "need NH, NKV, HD > 0 and NH divisible by NKV, got NH={} NKV={} HD={}", NH, NKV, HD);
}

// ---- per-op timing -------------------------------------------------------------------------------

void Ops::profile_ops(bool on) {
  if (!profile_) profile_ = std::make_shared<Profile>();
  profile_->on = on;
  if (on) profile_->times.clear();
}

std::vector<OpTime> Ops::op_times() const {
  std::vector<OpTime> r;
  if (profile_)
    for (const auto& [op, t] : profile_->times) r.push_back(t);
  std::sort(r.begin(), r.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return r;
}

// ---- memory and element-wise ---------------------------------------------------------------------

namespace {
bool overlap(const Tensor& a, const Tensor& b) {
  const char *x = static_cast<const char*>(a.ptr), *y = static_cast<const char*>(b.ptr);
  return a.device == b.device && x < y + b.nbytes() && y < x + a.nbytes();
}
bool floating(DType dt) { return dt == DType::F32 || dt == DType::BF16; }
}  // namespace

void Ops::copy(Tensor dst, Tensor src) {
  OpArgs a(*this, "copy");
  a.require(dst.defined() && src.defined(), "dst {} and src {} must both be defined", dst.str(), src.str());
  a.require(dst.numel() == src.numel(), "dst {} and src {} differ in element count", dst.str(), src.str());
  for (const Tensor* t : {&dst, &src})
    a.require(t->device == device() || t->device == Device::CPU, "{} lives on another device", t->str());
  if (dst.dtype != src.dtype) {
    a.require(floating(dst.dtype) && floating(src.dtype) && computes_in(dst.dtype) && computes_in(src.dtype),
              "dst {} and src {} differ in dtype; only the data dtypes this backend computes in convert (f32 <-> "
              "bf16 on the GPU; i32 never does)", dst.str(), src.str());
    a.require(dst.device == device() && src.device == device() && device() != Device::CPU,
              "f32 <-> bf16 conversion runs on the device only (dst {}, src {}); copy the host data into a device "
              "tensor of its own dtype first", dst.str(), src.str());
    a.require(!overlap(dst, src), "dst {} and src {} overlap", dst.str(), src.str());
  } else {
    a.require(dst.ptr == src.ptr || !overlap(dst, src), "dst {} and src {} overlap", dst.str(), src.str());
  }
  run("copy", [&] { copy_impl(dst, src); });
}

void Ops::fill(Tensor t, float value) {
  OpArgs a(*this, "fill");
  if (t.defined() && t.dtype == DType::I32)  // index tensors (targets, positions) are filled too
    a.i32("t", t);
  else
    a.data("t", t);
  run("fill", [&] { fill_impl(t, value); });
}

void Ops::scale(Tensor t, float s) {
  OpArgs(*this, "scale").data("t", t);
  run("scale", [&] { scale_impl(t, s); });
}

void Ops::add(Tensor out, Tensor a, Tensor b) {
  OpArgs(*this, "add")
      .data("out", out)
      .data("a", a)
      .data("b", b)
      .require(a.numel() == out.numel() && b.numel() == out.numel(), "out {}, a {}, b {} differ in element count",
               out.str(), a.str(), b.str());
  run("add", [&] { add_impl(out, a, b); });
}

// ---- matrix products -----------------------------------------------------------------------------

void Ops::gemm(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, float alpha, float beta) {
  // c (M,N), a (M,K) or (K,M) when trans_a, b (K,N) or (N,K) when trans_b
  const Mat mc = mat_of(c), ma = mat_of(a), mb = mat_of(b);
  const int64_t K = trans_a ? ma.rows : ma.cols, a_m = trans_a ? ma.cols : ma.rows;
  const int64_t b_k = trans_b ? mb.cols : mb.rows, b_n = trans_b ? mb.rows : mb.cols;
  OpArgs(*this, "gemm")
      .data("c", c)
      .data("a", a)
      .data("b", b)
      .require(a_m == mc.rows && b_k == K && b_n == mc.cols,
               "c {} = op(a {}, trans={}) @ op(b {}, trans={}) has mismatched shapes", c.shape.str(), a.shape.str(),
               trans_a, b.shape.str(), trans_b);
  run("gemm", [&] { gemm_impl(c, a, b, trans_a, trans_b, alpha, beta); });
}

namespace {
// out (N,OC) = inp (N,IC) @ weight (OC,IC)^T + bias (OC), bias optional.
void check_linear(OpArgs& a, const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) {
  a.data("out", out).data("inp", inp).data("weight", weight).data_opt("bias", bias);
  const Mat mo = mat_of(out), mx = mat_of(inp), mw = mat_of(weight);
  a.require(mw.cols == mx.cols && mo.rows == mx.rows && mo.cols == mw.rows,
            "out {} = inp {} @ weight {}^T has mismatched shapes", out.shape.str(), inp.shape.str(),
            weight.shape.str());
  a.len("bias", bias, mw.rows, "OC");
}
// dinp (N,IC) = dout (N,OC) @ weight (OC,IC).
void check_linear_dinp(OpArgs& a, const char* name, const Tensor& dinp, const Tensor& dout, const Tensor& weight) {
  a.data(name, dinp).data("weight", weight);
  const Mat mw = mat_of(weight), mdx = mat_of(dinp), mo = mat_of(dout);
  a.require(mw.rows == mo.cols && mdx.rows == mo.rows && mdx.cols == mw.cols,
            "{} {} = dout {} @ weight {} has mismatched shapes", name, dinp.shape.str(), dout.shape.str(),
            weight.shape.str());
}
// dweight (OC,IC) += dout^T @ inp and dbias (OC) += column sums of dout, both f32 and optional.
void check_linear_dweight(OpArgs& a, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                          const Tensor& inp, const char* inp_name) {
  const Mat mo = mat_of(dout);
  if (dweight.defined()) {
    a.f32("dweight (weight gradients accumulate in f32)", dweight).data(inp_name, inp);
    const Mat mx = mat_of(inp), mdw = mat_of(dweight);
    a.require(mx.rows == mo.rows && mdw.rows == mo.cols && mdw.cols == mx.cols,
              "dweight {} += dout {}^T @ {} {} has mismatched shapes", dweight.shape.str(), dout.shape.str(),
              inp_name, inp.shape.str());
  }
  a.f32_opt("dbias (bias gradients accumulate in f32)", dbias).len("dbias", dbias, mo.cols, "OC");
}
}  // namespace

void Ops::linear_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias) {
  OpArgs a(*this, "linear_forward");
  check_linear(a, out, inp, weight, bias);
  run("linear_forward", [&] { linear_forward_impl(out, inp, weight, bias); });
}

void Ops::linear_residual_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor residual) {
  OpArgs a(*this, "linear_residual_forward");
  check_linear(a, out, inp, weight, bias);
  a.data("residual", residual)
      .require(residual.numel() == out.numel(), "residual {} must have the shape of out {}", residual.shape.str(),
               out.shape.str())
      .require(residual.ptr != out.ptr, "residual must not be out itself (it is read after out is written); use "
               "linear_forward and add");
  run("linear_residual_forward", [&] { linear_residual_forward_impl(out, inp, weight, bias, residual); });
}

void Ops::linear_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight) {
  OpArgs a(*this, "linear_backward");
  a.data("dout", dout);
  if (dinp.defined()) check_linear_dinp(a, "dinp", dinp, dout, weight);
  check_linear_dweight(a, dweight, dbias, dout, inp, "inp");
  run("linear_backward", [&] { linear_backward_impl(dinp, dweight, dbias, dout, inp, weight); });
}

void Ops::linear_gelu_forward(Tensor out, Tensor pre, Tensor inp, Tensor weight, Tensor bias) {
  OpArgs a(*this, "linear_gelu_forward");
  check_linear(a, out, inp, weight, bias);
  a.data("pre", pre).like("pre", pre, "out", out);
  run("linear_gelu_forward", [&] { linear_gelu_forward_impl(out, pre, inp, weight, bias); });
}

void Ops::linear_backward_gelu(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act, Tensor weight,
                               Tensor pre) {
  OpArgs a(*this, "linear_backward_gelu");
  a.require(dpre.defined(), "dpre is required (use linear_backward for the weights alone)").data("dout", dout);
  check_linear_dinp(a, "dpre", dpre, dout, weight);
  a.data("pre", pre).like("pre", pre, "dpre", dpre);
  check_linear_dweight(a, dweight, dbias, dout, act, "act");
  run("linear_backward_gelu", [&] { linear_backward_gelu_impl(dpre, dweight, dbias, dout, act, weight, pre); });
}

namespace {
// weight (G,OC,IC), bias (G,OC) optional, and group_rows, a host array of G row counts (each >= 0)
// that add up to the M rows of the input.
void check_groups(OpArgs& a, const Tensor& weight, const char* bias_name, const Tensor& bias, int64_t M,
                  const int64_t* group_rows) {
  a.require(weight.ndim() == 3, "weight {} must be (G,OC,IC)", weight.shape.str());
  a.require(!bias.defined() || bias.numel() == weight.size(0) * weight.size(1), "{} {} must be (G,OC) for weight {}",
            bias_name, bias.shape.str(), weight.shape.str());
  a.require(group_rows != nullptr, "group_rows (a host array of G row counts) is required");
  int64_t total = 0;
  for (int64_t g = 0; g < weight.size(0); ++g) {
    a.require(group_rows[g] >= 0, "group {} has {} rows", g, group_rows[g]);
    total += group_rows[g];
  }
  a.require(total == M, "the groups hold {} rows but the input has {}", total, M);
}
}  // namespace

void Ops::grouped_linear_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, const int64_t* group_rows) {
  OpArgs a(*this, "grouped_linear_forward");
  a.data("out", out).data("inp", inp).data("weight", weight).data_opt("bias", bias);
  const Mat mo = mat_of(out), mi = mat_of(inp);
  check_groups(a, weight, "bias", bias, mi.rows, group_rows);
  a.require(mo.rows == mi.rows && mo.cols == weight.size(1) && mi.cols == weight.size(2),
            "out {} = inp {} @ weight {}^T per group has mismatched shapes", out.shape.str(), inp.shape.str(),
            weight.shape.str());
  run("grouped_linear_forward", [&] { grouped_linear_forward_impl(out, inp, weight, bias, group_rows); });
}

void Ops::grouped_linear_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight,
                                  const int64_t* group_rows) {
  OpArgs a(*this, "grouped_linear_backward");
  a.data("dout", dout).data("weight", weight).data_opt("dinp", dinp);
  const Mat mo = mat_of(dout);
  check_groups(a, weight, "dbias", dbias, mo.rows, group_rows);
  const int64_t OC = weight.size(1), IC = weight.size(2);
  a.require(mo.cols == OC, "dout {} must have OC = {} columns", dout.shape.str(), OC);
  a.require(!dinp.defined() || (mat_of(dinp).rows == mo.rows && mat_of(dinp).cols == IC),
            "dinp {} must be (M,IC) = ({}, {})", dinp.shape.str(), mo.rows, IC);
  if (dweight.defined()) {
    a.f32("dweight (weight gradients accumulate in f32)", dweight).data("inp", inp);
    a.require(dweight.shape == weight.shape, "dweight {} must match weight {}", dweight.shape.str(),
              weight.shape.str());
    a.require(mat_of(inp).rows == mo.rows && mat_of(inp).cols == IC, "inp {} must be (M,IC) = ({}, {})",
              inp.shape.str(), mo.rows, IC);
  }
  a.f32_opt("dbias (bias gradients accumulate in f32)", dbias);
  run("grouped_linear_backward",
      [&] { grouped_linear_backward_impl(dinp, dweight, dbias, dout, inp, weight, group_rows); });
}

}  // namespace mpigpt
