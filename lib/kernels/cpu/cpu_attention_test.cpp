// Tests of the CPU backend's RoPE and causal GQA attention against double loops and finite differences.
#include <doctest/doctest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Geometry {
  int64_t B, T;
  int NH, NKV, HD;
  int64_t R() const { return int64_t(NH + 2 * NKV) * HD; }
  int64_t qkv_numel() const { return B * T * R(); }
  int64_t out_numel() const { return B * T * NH * HD; }
};

// Causal softmax(q k^T / sqrt(HD)) v per (b, h), query head h reading kv head h / (NH/NKV).
std::vector<double> attention_reference(const std::vector<float>& qkv, const Geometry& g) {
  const int64_t R = g.R(), G = g.NH / g.NKV;
  std::vector<double> out(size_t(g.out_numel()));
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < g.NH; ++h) {
      const int64_t kh = h / G;
      auto at = [&](int64_t t, int64_t head, int64_t d) {
        return double(qkv[size_t((b * g.T + t) * R + head * g.HD + d)]);
      };
      for (int64_t i = 0; i < g.T; ++i) {
        std::vector<double> s(size_t(i + 1));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double dotp = 0;
          for (int64_t d = 0; d < g.HD; ++d) dotp += at(i, h, d) * at(j, g.NH + kh, d);
          s[size_t(j)] = dotp / std::sqrt(double(g.HD));
          mx = std::max(mx, s[size_t(j)]);
        }
        for (auto& v : s) sum += (v = std::exp(v - mx));
        for (int64_t d = 0; d < g.HD; ++d) {
          double o = 0;
          for (int64_t j = 0; j <= i; ++j) o += s[size_t(j)] / sum * at(j, g.NH + g.NKV + kh, d);
          out[size_t((b * g.T + i) * g.NH * g.HD + h * g.HD + d)] = o;
        }
      }
    }
  return out;
}

std::vector<double> rope_reference(const std::vector<float>& qkv, const std::vector<int32_t>& pos, int NH, int NKV,
                                   int HD, double theta) {
  const int64_t R = int64_t(NH + 2 * NKV) * HD, N = int64_t(pos.size()), half = HD / 2;
  std::vector<double> out(qkv.begin(), qkv.end());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < NH + NKV; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double a = pos[size_t(n)] * std::pow(theta, -2.0 * double(i) / HD);
        const size_t i1 = size_t(n * R + h * HD + i), i2 = i1 + size_t(half);
        out[i1] = qkv[i1] * std::cos(a) - qkv[i2] * std::sin(a);
        out[i2] = qkv[i2] * std::cos(a) + qkv[i1] * std::sin(a);
      }
  return out;
}
}  // namespace

TEST_CASE("cpu rope: forward against the rotation in double, backward is its transpose") {
  auto ops = make_cpu_ops();
  const int NH = 4, NKV = 2, HD = 8;
  const int64_t N = 7, R = (NH + 2 * NKV) * HD;
  const float theta = 10000.0f;
  std::vector<int32_t> pos = {0, 1, 5, 17, 300, 4095, 2};  // context-parallel chunks need not be contiguous
  const auto x0 = random_normal(size_t(N * R), 121, 0);
  auto x = x0;
  ops->rope_forward(as_tensor(x, {N, R}), as_tensor(pos, {N}), NH, NKV, HD, theta);
  const auto want = rope_reference(x0, pos, NH, NKV, HD, theta);
  // cos/sin rounded to fp32 (6e-8) times O(1) inputs; the angles themselves are exact (double).
  auto r = allclose(x, want, 5e-7, 5e-7);
  CHECK_MESSAGE(r.ok, r.str());
  bool v_untouched = true;  // value heads are not rotated: bitwise the input
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = (NH + NKV) * HD; c < R; ++c) v_untouched &= x[size_t(n * R + c)] == x0[size_t(n * R + c)];
  CHECK(v_untouched);

  // The rotation is linear: the finite-difference gradient of <rope(x), W> is exact up to rounding
  // (step 0.5), and rope_backward(W) must equal it.
  const auto w = random_normal(size_t(N * R), 121, 1);
  auto xin = x0;
  auto loss = [&] {
    auto y = xin;
    ops->rope_forward(as_tensor(y, {N, R}), as_tensor(pos, {N}), NH, NKV, HD, theta);
    return dot(y, w);
  };
  const auto nx = numerical_gradient(loss, xin, 0.5);
  auto dx = w;
  ops->rope_backward(as_tensor(dx, {N, R}), as_tensor(pos, {N}), NH, NKV, HD, theta);
  r = allclose(dx, nx, 1e-5, 1e-5);
  CHECK_MESSAGE(r.ok, r.str());
  // backward undoes forward
  ops->rope_backward(as_tensor(x, {N, R}), as_tensor(pos, {N}), NH, NKV, HD, theta);
  r = allclose(x, x0, 5e-7, 5e-7);
  CHECK_MESSAGE(r.ok, "round trip: ", r.str());

  CHECK_THROWS_WITH_AS(ops->rope_forward(as_tensor(x, {N, R}), as_tensor(pos, {N}), NH, NKV, HD + 1, theta),
                       doctest::Contains("rope_forward"), Error);
}

TEST_CASE("cpu attention forward matches naive causal GQA attention; saved probabilities are complete") {
  auto ops = make_cpu_ops();
  // GQA with T not a power of two; plain multi-head; T across one and two 64-row blocks.
  for (Geometry g :
       {Geometry{2, 7, 4, 2, 6}, Geometry{1, 5, 3, 3, 4}, Geometry{1, 70, 2, 1, 8}, Geometry{2, 130, 4, 2, 16}}) {
    CAPTURE(g.B);
    CAPTURE(g.T);
    CAPTURE(g.NH);
    CAPTURE(g.NKV);
    auto qkv = random_normal(size_t(g.qkv_numel()), 131, uint64_t(g.T));
    std::vector<float> out(size_t(g.out_numel()), kNaN);
    std::vector<float> saved(size_t(ops->attention_saved_numel(g.B, g.T, g.NH)), kNaN);
    CHECK(saved.size() == size_t(g.B * g.NH * g.T * g.T));
    ops->attention_forward(as_tensor(out, {g.B, g.T, g.NH * g.HD}), as_tensor(saved, {int64_t(saved.size())}),
                           as_tensor(qkv, {g.B, g.T, g.R()}), g.NH, g.NKV, g.HD);
    // Outputs are convex combinations of unit normals: 1e-6 is ~10 ulp.
    auto r = allclose(out, attention_reference(qkv, g), 1e-6, 1e-5);
    CHECK_MESSAGE(r.ok, r.str());
    size_t bad_rows = 0, bad_mask = 0;
    for (int64_t bh = 0; bh < g.B * g.NH; ++bh)
      for (int64_t i = 0; i < g.T; ++i) {
        double s = 0;
        for (int64_t j = 0; j < g.T; ++j) {
          const float p = saved[size_t((bh * g.T + i) * g.T + j)];
          if (j <= i)
            s += p;
          else
            bad_mask += p != 0.0f;
        }
        bad_rows += !(std::abs(s - 1.0) < 1e-6);
      }
    CHECK(bad_rows == 0);
    CHECK(bad_mask == 0);
  }
}

TEST_CASE("cpu attention backward matches finite differences; overwrites dqkv; deterministic") {
  auto ops = make_cpu_ops();
  // Full finite differences on the small shapes, 200 sampled elements on the multi-block ones.
  for (Geometry g :
       {Geometry{2, 7, 4, 2, 6}, Geometry{1, 5, 3, 3, 4}, Geometry{1, 70, 2, 1, 8}, Geometry{1, 130, 4, 2, 8}}) {
    CAPTURE(g.B);
    CAPTURE(g.T);
    CAPTURE(g.NH);
    CAPTURE(g.NKV);
    const Shape sqkv{g.B, g.T, g.R()}, sout{g.B, g.T, g.NH * g.HD};
    auto qkv = random_normal(size_t(g.qkv_numel()), 141, uint64_t(g.T));
    const auto w = random_normal(size_t(g.out_numel()), 142, uint64_t(g.T));
    std::vector<float> out(size_t(g.out_numel())), saved(size_t(ops->attention_saved_numel(g.B, g.T, g.NH)));
    const Tensor tsaved = as_tensor(saved, {int64_t(saved.size())});
    auto loss = [&] {
      ops->attention_forward(as_tensor(out, sout), tsaved, as_tensor(qkv, sqkv), g.NH, g.NKV, g.HD);
      return dot(out, w);
    };
    // Softmax attention on unit-normal inputs (scores O(1)): with eps = 1e-2 the truncation
    // eps^2 |f'''| / 6 is ~1e-5 and the rounding noise (up to T*HD outputs moved by one key
    // element, each ~1e-7) over 2 eps is ~1e-5; 2e-4 abs + 1e-3 rel is ~10x that. A wrong term
    // (missing scale, GQA head mix-up, mask leak) is off by O(0.1).
    const bool sample = g.qkv_numel() > 1000;
    const auto idx = sample ? sample_indices(size_t(g.qkv_numel()), 200, 143) : std::vector<size_t>{};
    const auto num = sample ? numerical_gradient_at(loss, qkv.data(), idx, 1e-2) : numerical_gradient(loss, qkv, 1e-2);
    loss();  // saved probabilities of the unperturbed input
    std::vector<float> dqkv(qkv.size(), kNaN);
    auto backward = [&] {
      ops->attention_backward(as_tensor(dqkv, sqkv), as_tensor(const_cast<std::vector<float>&>(w), sout),
                              as_tensor(qkv, sqkv), as_tensor(out, sout), tsaved, g.NH, g.NKV, g.HD);
    };
    backward();
    std::vector<float> got;
    if (sample)
      for (size_t i : idx) got.push_back(dqkv[i]);
    else
      got = dqkv;
    auto r = allclose(got, num, 2e-4, 1e-3);
    CHECK_MESSAGE(r.ok, r.str());
    CHECK(max_abs(num) > 0.1);  // the check is not vacuous

    const auto first = dqkv;
    std::fill(dqkv.begin(), dqkv.end(), 123.0f);  // overwritten, not accumulated
    backward();
    CHECK(dqkv == first);
  }
}

TEST_CASE("cpu attention on a threaded size: bitwise the same twice and with one thread") {
  auto ops = make_cpu_ops();
  const Geometry g{2, 64, 4, 2, 32};  // large enough for the (batch, head) tasks to be threaded
  const Shape sqkv{g.B, g.T, g.R()}, sout{g.B, g.T, g.NH * g.HD};
  auto qkv = random_normal(size_t(g.qkv_numel()), 171, 0), dout = random_normal(size_t(g.out_numel()), 171, 1);
  std::vector<float> saved(size_t(ops->attention_saved_numel(g.B, g.T, g.NH)));
  auto run = [&](int threads) {
    const int saved_threads = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> out(size_t(g.out_numel())), dqkv(qkv.size());
    const Tensor ts = as_tensor(saved, {int64_t(saved.size())});
    ops->attention_forward(as_tensor(out, sout), ts, as_tensor(qkv, sqkv), g.NH, g.NKV, g.HD);
    ops->attention_backward(as_tensor(dqkv, sqkv), as_tensor(dout, sout), as_tensor(qkv, sqkv), as_tensor(out, sout),
                            ts, g.NH, g.NKV, g.HD);
    omp_set_num_threads(saved_threads);
    out.insert(out.end(), dqkv.begin(), dqkv.end());
    return out;
  };
  const auto a = run(2), b = run(2), c = run(1);
  CHECK(a == b);
  CHECK(a == c);
  auto r = allclose(std::vector<float>(a.begin(), a.begin() + g.out_numel()), attention_reference(qkv, g), 1e-6, 1e-5);
  CHECK_MESSAGE(r.ok, r.str());
}

TEST_CASE("cpu attention rejects inconsistent shapes") {
  auto ops = make_cpu_ops();
  std::vector<float> qkv(2 * 3 * 16), out(2 * 3 * 8), saved(2 * 2 * 9);
  CHECK_THROWS_WITH_AS(ops->attention_forward(as_tensor(out, {2, 3, 8}), as_tensor(saved, {36}),
                                              as_tensor(qkv, {2, 3, 16}), 2, 2, 4),  // R would be 24
                       doctest::Contains("attention_forward"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_forward(as_tensor(out, {2, 3, 8}), as_tensor(saved, {36}),
                                              as_tensor(qkv, {2, 3, 16}), 3, 2, 4),  // NH % NKV != 0
                       doctest::Contains("NH"), Error);
  CHECK_THROWS_WITH_AS(ops->attention_forward(as_tensor(out, {2, 3, 8}), as_tensor(saved, {36}).flat_slice(0, 35),
                                              as_tensor(qkv, {2, 3, 16}), 2, 1, 4),
                       doctest::Contains("saved"), Error);
}
