// What cuDNN's fused attention graphs compute, checked without a GPU: a host interpreter evaluates them
// as cuDNN holds them, against the CPU backend, on any machine with cuDNN's library. Whether cuDNN's
// fused engines run exactly what the graphs say is for the GPU (cudnn_sdpa_test.cpp).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "lib/core/error.h"
#include "lib/kernels/cuda/cuda_attention_testing.h"
#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/ops.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/cudnn_sdpa.h"
#endif

using namespace mpigpt;
using namespace mpigpt::testing;

#ifdef MPIGPT_WITH_CUDA
namespace {

using cuda::SdpaGraphOp;
using cuda::SdpaGraphTensor;
using Idx = std::array<int64_t, 4>;

int64_t offset(const SdpaGraphTensor& t, const Idx& i) {
  return i[0] * t.strides[0] + i[1] * t.strides[1] + i[2] * t.strides[2] + i[3] * t.strides[3];
}
// Elements from a tensor's first to its last (its storage, addressed through its strides).
int64_t extent(const SdpaGraphTensor& t) {
  int64_t e = 1;
  for (int d = 0; d < 4; ++d) e += (t.dims[d] - 1) * t.strides[d];
  return e;
}

// The index into x for index i of a tensor shaped like y, over y's first `dims` dims (the others
// are taken as they are): a dim of x of size 1 broadcasts; fewer heads than y's (dim 1) is
// grouped-query attention, consecutive heads sharing one. Serves an operand x of a result y, and a
// reduction's result x of its input y.
Idx operand_index(const SdpaGraphTensor& x, const SdpaGraphTensor& y, Idx i, int dims = 4) {
  for (int d = 0; d < dims; ++d) {
    if (x.dims[d] == y.dims[d])
      continue;
    else if (x.dims[d] == 1)
      i[d] = 0;
    else if (d == 1 && y.dims[1] % x.dims[1] == 0)
      i[d] /= y.dims[1] / x.dims[1];
    else
      fail("graph interpreter: tensor {} (dim {} of {}) does not broadcast to tensor {} ({})", x.uid, d, x.dims[d],
           y.uid, y.dims[d]);
  }
  return i;
}

template <class F>
void for_each(const std::array<int64_t, 4>& dims, const F& f) {
  Idx i{};
  for (i[0] = 0; i[0] < dims[0]; ++i[0])
    for (i[1] = 0; i[1] < dims[1]; ++i[1])
      for (i[2] = 0; i[2] < dims[2]; ++i[2])
        for (i[3] = 0; i[3] < dims[3]; ++i[3]) f(i);
}

// A value as a tensor of dtype holds it.
float stored(const std::string& dtype, double v) {
  if (dtype == "FLOAT") return float(v);
  if (dtype == "BFLOAT16") return round_bf16(float(v));
  if (dtype == "BOOLEAN") return v != 0 ? 1.f : 0.f;
  if (dtype == "INT32") {
    if (v != std::floor(v)) fail("graph interpreter: {} stored in an INT32 tensor", v);
    return float(v);
  }
  fail("graph interpreter: tensors of {} are not interpreted", dtype);
}

// Evaluates a described graph on the host. User tensors are bound to host arrays of floats (their
// first element; bf16 ones hold bf16 values) and by-value tensors to scalars; virtual tensors get
// storage of their own when first written. Anything the interpreter does not know fails loudly.
// Its reading of cuDNN's operations: a result rounds to bf16 wherever its tensor is bf16; matmuls
// batch over the first two dims, and an operand with fewer heads serves consecutive groups of them
// (grouped-query attention as cuDNN and the builtin kernels define it); a reshape is the same storage
// seen through other strides and held in another dtype (cuDNN's transposes). So a wrong stride,
// scale, mask, statistic or gradient formula in the graphs fails the tests below.
class Interpreter {
 public:
  // A user tensor's first element is v[first]; its strides must stay within v.
  void bind(int64_t uid, std::vector<float>& v, int64_t first = 0) {
    user_[uid] = {v.data() + first, int64_t(v.size()) - first};
  }
  void scalar(int64_t uid, float v) { scalars_[uid] = v; }

  void run(const std::vector<SdpaGraphOp>& ops) {
    for (size_t n = 0; n < ops.size(); ++n) {
      const SdpaGraphOp& op = ops[n];
      INFO("operation " << n + 1 << ": " << op.kind << " " << op.mode);
      if (op.kind == "matmul")
        matmul(op);
      else if (op.kind == "pointwise")
        pointwise(op);
      else if (op.kind == "reduction")
        reduction(op);
      else if (op.kind == "reshape")
        reshape(op);
      else
        fail("graph interpreter: unknown operation {}", op.kind);
    }
  }

 private:
  // A tensor's values: a by-value scalar, or storage read and written through the strides.
  struct View {
    const SdpaGraphTensor* t;
    float* base = nullptr;
    float value = 0;
    float operator[](const Idx& i) const { return base ? base[offset(*t, i)] : value; }
  };
  View in(const SdpaGraphTensor& t) {
    if (t.by_value) {
      auto it = scalars_.find(t.uid);
      if (it == scalars_.end()) fail("graph interpreter: scalar {} is not bound", t.uid);
      return {&t, nullptr, it->second};
    }
    if (!t.is_virtual) {
      auto it = user_.find(t.uid);
      if (it == user_.end()) fail("graph interpreter: user tensor {} is not bound", t.uid);
      const auto [first, available] = it->second;
      if (extent(t) > available)
        fail("graph interpreter: user tensor {} spans {} elements, its buffer {}", t.uid, extent(t), available);
      return {&t, first};
    }
    auto it = virtual_.find(t.uid);
    if (it == virtual_.end()) fail("graph interpreter: virtual tensor {} is read before it is written", t.uid);
    return {&t, it->second.data()};
  }
  float* out(const SdpaGraphTensor& t) {
    if (t.by_value) fail("graph interpreter: by-value tensor {} written", t.uid);
    if (!t.is_virtual) return in(t).base;
    auto& v = virtual_[t.uid];
    v.assign(size_t(extent(t)), std::numeric_limits<float>::quiet_NaN());
    return v.data();
  }

  void require_fp32(const SdpaGraphOp& op) const {
    if (op.precision != "FLOAT") fail("graph interpreter: {} computed in {}", op.kind, op.precision);
  }

  // y = x b over the two last dims, batched (and broadcast) over the first two; fp32 accumulation
  // (here exact), the result stored in y's dtype.
  void matmul(const SdpaGraphOp& op) {
    require_fp32(op);
    const SdpaGraphTensor &a = op.x, &b = *op.b, &c = op.y;
    if (a.dims[3] != b.dims[2] || a.dims[2] != c.dims[2] || b.dims[3] != c.dims[3])
      fail("graph interpreter: matmul of {} x {} into {} does not fit", a.uid, b.uid, c.uid);
    const View va = in(a), vb = in(b);
    float* y = out(c);
    for_each(c.dims, [&](const Idx& i) {
      // Batched over the first two dims.
      Idx ia = operand_index(a, c, {i[0], i[1], i[2], 0}, 2), ib = operand_index(b, c, {i[0], i[1], 0, i[3]}, 2);
      double s = 0;
      for (int64_t k = 0; k < a.dims[3]; ++k) {
        ia[3] = k;
        ib[2] = k;
        s += double(va[ia]) * double(vb[ib]);
      }
      y[offset(c, i)] = stored(c.dtype, s);
    });
  }

  void pointwise(const SdpaGraphOp& op) {
    if (op.mode == "CMP_GE") {
      if (op.precision != "BOOLEAN" && op.precision != "FLOAT") fail("graph interpreter: CMP_GE in {}", op.precision);
    } else {
      require_fp32(op);
    }
    const std::string& m = op.mode;
    const bool binary = m == "ADD" || m == "SUB" || m == "MUL" || m == "DIV" || m == "CMP_GE" || m == "BINARY_SELECT";
    if (binary != op.b.has_value() || (m == "BINARY_SELECT") != op.t.has_value())
      fail("graph interpreter: pointwise {} with the wrong operands", m);
    const View x = in(op.x);
    const View b = op.b ? in(*op.b) : View{};
    const View t = op.t ? in(*op.t) : View{};
    const SdpaGraphTensor& yt = op.y;
    float* y = out(yt);
    for_each(yt.dims, [&](const Idx& i) {
      const auto xv = [&] { return double(x[operand_index(op.x, yt, i)]); };
      const auto bv = [&] { return double(b[operand_index(*op.b, yt, i)]); };
      double r;
      if (m == "ADD")
        r = xv() + bv();
      else if (m == "SUB")
        r = xv() - bv();
      else if (m == "MUL")
        r = xv() * bv();
      else if (m == "DIV")
        r = xv() / bv();
      else if (m == "EXP")
        r = std::exp(xv());
      else if (m == "LOG")
        r = std::log(xv());
      else if (m == "IDENTITY")
        r = xv();
      else if (m == "CMP_GE")
        r = xv() >= bv();
      else if (m == "GEN_INDEX")
        r = double(i[size_t(op.axis)]);
      else if (m == "BINARY_SELECT")
        r = t[operand_index(*op.t, yt, i)] != 0 ? xv() : bv();
      else
        fail("graph interpreter: pointwise {} is not interpreted", m);
      y[offset(yt, i)] = stored(yt.dtype, r);
    });
  }

  // y = reduce(x) over x's dims where y has size 1, and over each group of consecutive heads where y
  // has fewer (the grouped-query fold).
  void reduction(const SdpaGraphOp& op) {
    require_fp32(op);
    const SdpaGraphTensor &xt = op.x, &yt = op.y;
    const bool sum = op.mode == "ADD";
    if (!sum && op.mode != "MAX") fail("graph interpreter: reduction {} is not interpreted", op.mode);
    std::map<int64_t, double> acc;  // by y's offset
    const View x = in(xt);
    for_each(xt.dims, [&](const Idx& i) {
      const double v = x[i];
      auto [it, fresh] = acc.emplace(offset(yt, operand_index(yt, xt, i)), v);
      if (!fresh) it->second = sum ? it->second + v : std::max(it->second, v);
    });
    float* y = out(yt);
    for (const auto& [o, v] : acc) y[o] = stored(yt.dtype, v);
  }

  // The same storage seen through y's strides (a transpose) and held in y's dtype.
  void reshape(const SdpaGraphOp& op) {
    const View x = in(op.x);
    if (!x.base) fail("graph interpreter: reshape of a scalar");
    if (!op.y.is_virtual) fail("graph interpreter: reshape into user tensor {}", op.y.uid);
    if (extent(op.y) > extent(op.x))
      fail("graph interpreter: reshape of {} into {} reaches past it", op.x.uid, op.y.uid);
    std::vector<float> copy(x.base, x.base + extent(op.x));
    for (float& v : copy) v = stored(op.y.dtype, v);
    virtual_[op.y.uid] = std::move(copy);
  }

  std::map<int64_t, std::pair<float*, int64_t>> user_;  // first element, elements from it on
  std::map<int64_t, float> scalars_;
  std::map<int64_t, std::vector<float>> virtual_;
};

// Every test case here needs cuDNN's library (not a GPU): without it (the host emulator has none)
// they report skipped.
void require_cudnn() {
  const std::string why = cuda::cudnn_sdpa_unavailable();
  if (why.empty()) return;
  MESSAGE("no cuDNN: " << why << ": the graphs were not checked");
  std::exit(77);
}

// The host arrays of one call, by cuda::SdpaBuffer (bf16 ones hold bf16 values).
struct Buffers {
  using Array = std::vector<float>*;
  Array qkv = nullptr, out = nullptr, lse = nullptr, dout = nullptr, dqkv = nullptr, rowdot = nullptr,
        dq_accum = nullptr;
};

// The user tensors of a described graph (its variant pack's keys), by-value scalars included.
std::set<int64_t> user_tensors(const std::vector<SdpaGraphOp>& ops) {
  std::set<int64_t> uids;
  auto add = [&](const SdpaGraphTensor& t) {
    if (!t.is_virtual) uids.insert(t.uid);
  };
  for (const SdpaGraphOp& op : ops) {
    add(op.x);
    add(op.y);
    if (op.b) add(*op.b);
    if (op.t) add(*op.t);
  }
  return uids;
}

// Binds the graph's user tensors where the GPU execution finds them (cudnn_sdpa_bindings, from
// which CudnnSdpa makes its variant packs), after checking that they are exactly the graph's.
void bind(Interpreter& run, const std::vector<SdpaGraphOp>& ops, const cuda::SdpaShape& shape, bool backward,
          const Buffers& b) {
  std::set<int64_t> bound;
  for (const cuda::SdpaBinding& e : cuda::cudnn_sdpa_bindings(shape, backward)) {
    REQUIRE_MESSAGE(bound.insert(e.uid).second, "tensor ", e.uid, " bound twice");
    std::vector<float>* v = nullptr;
    switch (e.buffer) {
      case cuda::SdpaBuffer::Qkv: v = b.qkv; break;
      case cuda::SdpaBuffer::Out: v = b.out; break;
      case cuda::SdpaBuffer::Lse: v = b.lse; break;
      case cuda::SdpaBuffer::DOut: v = b.dout; break;
      case cuda::SdpaBuffer::DQkv: v = b.dqkv; break;
      case cuda::SdpaBuffer::RowDot: v = b.rowdot; break;
      case cuda::SdpaBuffer::DQAccum: v = b.dq_accum; break;
      case cuda::SdpaBuffer::Scalar: run.scalar(e.uid, e.value); continue;
    }
    REQUIRE_MESSAGE(v, "tensor ", e.uid, " is bound to a buffer the ", backward ? "backward" : "forward",
                    " does not have");
    run.bind(e.uid, *v, e.first);
  }
  CHECK(bound == user_tensors(ops));
}

// The forward graph's outputs on the interpreter.
struct Forward {
  std::vector<float> out, lse;
};
Forward run_forward(const std::vector<SdpaGraphOp>& ops, const Geometry& g, std::vector<float>& qkv) {
  Forward f{std::vector<float>(size_t(g.B * g.T * g.C()), std::numeric_limits<float>::quiet_NaN()),
            std::vector<float>(size_t(g.B * g.NH * g.T), std::numeric_limits<float>::quiet_NaN())};
  Interpreter run;
  Buffers b;
  b.qkv = &qkv;
  b.out = &f.out;
  b.lse = &f.lse;
  bind(run, ops, {g.B, g.T, g.NH, g.NKV, g.HD}, false, b);
  run.run(ops);
  return f;
}

// The backward graph's dqkv on the interpreter, from the forward's out and lse; every element
// must be written (NaN-filled before).
std::vector<float> run_backward(const std::vector<SdpaGraphOp>& ops, const Geometry& g, std::vector<float>& qkv,
                                Forward& f, std::vector<float>& dout) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> dqkv(qkv.size(), nan), rowdot(size_t(g.B * g.NH * g.T), nan);
  std::vector<float> dq_accum(size_t(g.B * g.NH * g.T * g.HD), nan);
  Interpreter run;
  bind(run, ops, {g.B, g.T, g.NH, g.NKV, g.HD}, true, {&qkv, &f.out, &f.lse, &dout, &dqkv, &rowdot, &dq_accum});
  run.run(ops);
  return dqkv;
}

const std::vector<Geometry> kShapes = {
    {2, 48, 4, 4, 32}, {1, 40, 6, 2, 64}, {2, 33, 4, 1, 16}, {1, 24, 2, 2, 128}};

}  // namespace

TEST_CASE("cudnn attention graphs, as cuDNN holds them, compute causal attention (host interpreter)") {
  require_cudnn();
  auto cpu = make_cpu_ops();
  const Tolerance tol = tolerance(DType::BF16);
  for (const Geometry& g : kShapes) {
    CAPTURE(g.B);
    CAPTURE(g.T);
    CAPTURE(g.NH);
    CAPTURE(g.NKV);
    CAPTURE(g.HD);
    const cuda::SdpaShape shape{g.B, g.T, g.NH, g.NKV, g.HD};
    const auto fwd_ops = cuda::cudnn_sdpa_describe_graph(shape, false);
    const auto bwd_ops = cuda::cudnn_sdpa_describe_graph(shape, true);
    CHECK(fwd_ops.size() == 14);
    CHECK(bwd_ops.size() == (g.NKV == g.NH ? 22u : 24u));
    const Shape sqkv{g.B, g.T, g.R()}, sout{g.B, g.T, g.C()};
    auto qkv = rounded_bf16(random_normal(size_t(g.B * g.T * g.R()), 311, uint64_t(g.T * 1000 + g.HD)));
    auto dout = rounded_bf16(random_normal(size_t(g.B * g.T * g.C()), 312, uint64_t(g.T * 1000 + g.HD)));

    // The CPU backend's forward and backward of the same (bf16-valued) inputs.
    std::vector<float> out_cpu(size_t(g.B * g.T * g.C())), dqkv_cpu(qkv.size());
    std::vector<float> saved_cpu(size_t(cpu->attention_saved_numel(g.B, g.T, g.NH)));
    const Tensor saved = as_tensor(saved_cpu, {int64_t(saved_cpu.size())});
    cpu->attention_forward(as_tensor(out_cpu, sout), saved, as_tensor(qkv, sqkv), g.NH, g.NKV, g.HD);
    cpu->attention_backward(as_tensor(dqkv_cpu, sqkv), as_tensor(dout, sout), as_tensor(qkv, sqkv),
                            as_tensor(out_cpu, sout), saved, g.NH, g.NKV, g.HD);

    Forward f = run_forward(fwd_ops, g, qkv);
    auto r = allclose(f.out, out_cpu, tol.out, tol.out);
    CHECK_MESSAGE(r.ok, "out: ", r.str());
    r = allclose(f.lse, reference_lse(qkv, g), 1e-4, 1e-5);
    CHECK_MESSAGE(r.ok, "lse: ", r.str());

    // The backward from the forward's out and lse.
    const std::vector<float> dqkv = run_backward(bwd_ops, g, qkv, f, dout);
    r = allclose(dqkv, dqkv_cpu, tol.grad, tol.grad);
    CHECK_MESSAGE(r.ok, "dqkv: ", r.str());
  }
}

TEST_CASE("cudnn attention graphs: the interpreter tells a wrong mask from the right one") {
  require_cudnn();
  // The check above is only as good as the interpreter's reading of each operation: with the causal
  // comparison's operands swapped (key >= query: every query sees the keys after it), the same
  // forward must give another output.
  const Geometry g{1, 32, 2, 2, 32};
  auto ops = cuda::cudnn_sdpa_describe_graph({g.B, g.T, g.NH, g.NKV, g.HD}, false);
  auto qkv = rounded_bf16(random_normal(size_t(g.B * g.T * g.R()), 313));
  const Forward right = run_forward(ops, g, qkv);
  int swapped = 0;
  for (SdpaGraphOp& op : ops)
    if (op.mode == "CMP_GE") {
      std::swap(op.x, *op.b);
      ++swapped;
    }
  REQUIRE(swapped == 1);
  const Forward wrong = run_forward(ops, g, qkv);
  CHECK_FALSE(allclose(wrong.out, right.out, 0.1, 0.1).ok);
  CHECK_FALSE(allclose(wrong.lse, right.lse, 0.1, 0.1).ok);
}

#else

TEST_CASE("cudnn attention graphs: built without the CUDA backend") {
  MESSAGE("built without the CUDA backend: skipped");
  std::exit(77);
}

#endif
