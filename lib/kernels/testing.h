// Header-only helpers for numerical tests (kernels, layers, whole models): deterministic random
// fills, tensors over std::vector storage, difference measures with a readable report, and central
// finite differences of a scalar loss. No test framework is included: callers assert on the results.
#pragma once
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lib/core/rng.h"
#include "lib/core/tensor.h"

namespace mpigpt::testing {

// ---- deterministic random data --------------------------------------------------------------

// x[i] = mean + stddev * normal_at(seed, stream, i): the same values on every machine and run.
inline void fill_normal(float* x, size_t n, uint64_t seed, uint64_t stream = 0, float stddev = 1.0f,
                        float mean = 0.0f) {
  for (size_t i = 0; i < n; ++i) x[i] = mean + stddev * normal_at(seed, stream, i);
}
inline void fill_normal(std::vector<float>& x, uint64_t seed, uint64_t stream = 0, float stddev = 1.0f,
                        float mean = 0.0f) {
  fill_normal(x.data(), x.size(), seed, stream, stddev, mean);
}
// A host f32 tensor (the CPU backend's memory, or any host view).
inline void fill_normal(const Tensor& t, uint64_t seed, uint64_t stream = 0, float stddev = 1.0f, float mean = 0.0f) {
  fill_normal(t.f32(), size_t(t.numel()), seed, stream, stddev, mean);
}
inline std::vector<float> random_normal(size_t n, uint64_t seed, uint64_t stream = 0, float stddev = 1.0f,
                                        float mean = 0.0f) {
  std::vector<float> x(n);
  fill_normal(x, seed, stream, stddev, mean);
  return x;
}

// ---- tensors over vectors -------------------------------------------------------------------

inline Tensor as_tensor(std::vector<float>& v, Shape s) {
  MPIGPT_CHECK(size_t(s.numel()) == v.size(), "as_tensor: shape {} needs {} elements, vector has {}", s.str(),
               s.numel(), v.size());
  return Tensor(v.data(), s, DType::F32, Device::CPU);
}
inline Tensor as_tensor(std::vector<int32_t>& v, Shape s) {
  MPIGPT_CHECK(size_t(s.numel()) == v.size(), "as_tensor: shape {} needs {} elements, vector has {}", s.str(),
               s.numel(), v.size());
  return Tensor(v.data(), s, DType::I32, Device::CPU);
}

// ---- differences ----------------------------------------------------------------------------

template <class A, class B>
double max_abs_diff(const A* a, const B* b, size_t n) {
  double m = 0.0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}
template <class A, class B>
double max_abs_diff(const std::vector<A>& a, const std::vector<B>& b) {
  MPIGPT_CHECK(a.size() == b.size(), "max_abs_diff: sizes {} and {} differ", a.size(), b.size());
  return max_abs_diff(a.data(), b.data(), a.size());
}
// max |a-b| / max(|a|, |b|, floor): the floor keeps near-zero pairs from dominating.
template <class A, class B>
double max_rel_diff(const A* a, const B* b, size_t n, double floor = 1e-6) {
  double m = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double x = double(a[i]), y = double(b[i]);
    m = std::max(m, std::abs(x - y) / std::max({std::abs(x), std::abs(y), floor}));
  }
  return m;
}
template <class A, class B>
double max_rel_diff(const std::vector<A>& a, const std::vector<B>& b, double floor = 1e-6) {
  MPIGPT_CHECK(a.size() == b.size(), "max_rel_diff: sizes {} and {} differ", a.size(), b.size());
  return max_rel_diff(a.data(), b.data(), a.size(), floor);
}
inline double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (double v : x) m = std::max(m, std::abs(v));
  return m;
}

// The allclose test |got - want| <= atol + rtol * |want| over all elements, with what a failure
// message needs: how many elements fail and the worst one (largest error over its bound).
struct CloseReport {
  bool ok = true;
  size_t failures = 0, worst = 0, n = 0;
  double got = 0.0, want = 0.0, max_abs_err = 0.0, worst_ratio = 0.0;
  std::string str() const {
    return fmt::format(
        "{} of {} elements outside tolerance; worst [{}]: got {:.8g}, want {:.8g} ({:.3g}x the "
        "bound); max abs err {:.3g}",
        failures, n, worst, got, want, worst_ratio, max_abs_err);
  }
};
template <class A, class B>
CloseReport allclose(const A* got, const B* want, size_t n, double atol, double rtol) {
  CloseReport r;
  r.n = n;
  for (size_t i = 0; i < n; ++i) {
    const double g = double(got[i]), w = double(want[i]), err = std::abs(g - w);
    const double ratio = err == 0.0 ? 0.0 : err / (atol + rtol * std::abs(w));
    r.max_abs_err = std::max(r.max_abs_err, err);
    if (!(ratio <= 1.0)) ++r.failures;  // NaN fails too
    if (!(ratio <= r.worst_ratio)) {
      r.worst_ratio = ratio;
      r.worst = i;
      r.got = g;
      r.want = w;
    }
  }
  r.ok = r.failures == 0;
  return r;
}
template <class A, class B>
CloseReport allclose(const std::vector<A>& got, const std::vector<B>& want, double atol, double rtol) {
  MPIGPT_CHECK(got.size() == want.size(), "allclose: sizes {} and {} differ", got.size(), want.size());
  return allclose(got.data(), want.data(), got.size(), atol, rtol);
}

// ---- finite differences ---------------------------------------------------------------------

// sum_i a[i] * b[i] in double: the usual scalar loss <out, W> for a gradient check, whose
// gradient with respect to out is W.
template <class A, class B>
double dot(const A* a, const B* b, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}
template <class A, class B>
double dot(const std::vector<A>& a, const std::vector<B>& b) {
  MPIGPT_CHECK(a.size() == b.size(), "dot: sizes {} and {} differ", a.size(), b.size());
  return dot(a.data(), b.data(), a.size());
}

// Central differences d loss / d param[i] for i < n: each element is perturbed in place by +-eps
// (then restored bit for bit) and loss() re-evaluated. The step actually taken is the float
// rounding of param +- eps, and that is what is divided by, so eps need not be representable.
// Cost: 2n evaluations of loss().
inline std::vector<double> numerical_gradient(const std::function<double()>& loss, float* param, size_t n,
                                              double eps = 1e-3) {
  std::vector<double> grad(n);
  for (size_t i = 0; i < n; ++i) {
    const float orig = param[i];
    const float up = float(double(orig) + eps), down = float(double(orig) - eps);
    MPIGPT_CHECK(up != down, "numerical_gradient: eps {} vanishes next to param[{}] = {}", eps, i, orig);
    param[i] = up;
    const double lp = loss();
    param[i] = down;
    const double lm = loss();
    param[i] = orig;
    grad[i] = (lp - lm) / (double(up) - double(down));
  }
  return grad;
}
inline std::vector<double> numerical_gradient(const std::function<double()>& loss, std::vector<float>& param,
                                              double eps = 1e-3) {
  return numerical_gradient(loss, param.data(), param.size(), eps);
}
// The same at chosen elements only (large parameters): result[k] is d loss / d param[indices[k]].
inline std::vector<double> numerical_gradient_at(const std::function<double()>& loss, float* param,
                                                 const std::vector<size_t>& indices, double eps = 1e-3) {
  std::vector<double> grad;
  grad.reserve(indices.size());
  for (size_t i : indices) grad.push_back(numerical_gradient(loss, param + i, 1, eps)[0]);
  return grad;
}
// Deterministic sample of count distinct-ish indices in [0, n) (for numerical_gradient_at).
inline std::vector<size_t> sample_indices(size_t n, size_t count, uint64_t seed) {
  std::vector<size_t> idx;
  for (size_t k = 0; k < count && n > 0; ++k) idx.push_back(size_t(bits_at(seed, 0, k) % n));
  return idx;
}

}  // namespace mpigpt::testing
