// The mixture-of-experts layer with bf16 activations and expert weights on the CUDA backend (CTest
// label gpu) against the f32 CPU layer on the same bf16-representable inputs.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/testing.h"
#include "lib/model/moe.h"
#include "lib/model/moe_testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

double rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double(x) * double(x);
  return std::sqrt(s / double(std::max<size_t>(v.size(), 1)));
}
// got within 16u of want, relative to each element and to the vector's scale (rms). Each element
// sums products of rows that were rounded to bf16 two or three times on the way (hidden units,
// activations, the gate-weighted rows), each rounding u/2 of its own magnitude: an error of about
// 2u of the result's rms per element, and the worst of the ~10^4 elements of a weight gradient is
// about four times that (measured: 8u at worst, the SwiGLU proj gradient; 2-5u elsewhere).
void check_bf16(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  const auto r = allclose(got, want, 16 * kBf16U * rms(want), 16 * kBf16U);
  CHECK_MESSAGE(r.ok, what, ": ", r.str());
}

// The device copy of the host weights: the router in f32, everything else in bf16 (the host
// values are already bf16-representable, so nothing rounds). keep holds the buffers.
MoeWeights device_weights(Ops& ops, MoeHostWeights& h, std::vector<DeviceTensor>& keep, bool grads) {
  const MoeWeights v = h.views();
  auto dev = [&](const Tensor& t, std::vector<float>& src, DType dt) {
    if (!t.defined()) return Tensor();
    keep.push_back(grads ? zeros(ops, t.shape, DType::F32) : to_device(ops, src, t.shape, dt));
    return keep.back().t;
  };
  const DType dt = grads ? DType::F32 : DType::BF16;
  MoeWeights w;
  w.router = dev(v.router, h.router, DType::F32);
  w.fc = dev(v.fc, h.fc, dt);
  w.fc_bias = dev(v.fc_bias, h.fcb, dt);
  w.proj = dev(v.proj, h.proj, dt);
  w.proj_bias = dev(v.proj_bias, h.projb, dt);
  w.shared_fc = dev(v.shared_fc, h.sfc, dt);
  w.shared_fc_bias = dev(v.shared_fc_bias, h.sfcb, dt);
  w.shared_proj = dev(v.shared_proj, h.sproj, dt);
  w.shared_proj_bias = dev(v.shared_proj_bias, h.sprojb, dt);
  return w;
}

}  // namespace

// The router runs in f32 from the f32 master router (MoeLayer::router_input), so the routing must
// be the CPU's to f32 rounding: the same top-k experts, gates and aux/z losses within 1e-5. The
// expert rows go through bf16 roundings (hidden units, activations, outputs), so outputs and
// gradients agree within a small multiple of the bf16 unit roundoff.
TEST_CASE("bf16 moe layer: f32 routing as on the CPU, outputs and gradients within bf16 bounds") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const int64_t T = 64, C = 32;
  MoeConfig c;
  c.num_experts = 8;
  c.top_k = 2;
  c.hidden = 48;
  c.shared_hidden = 16;
  c.aux_loss_coeff = 0.01f;
  c.z_loss_coeff = 0.001f;
  for (auto act : {MoeConfig::Activation::Gelu, MoeConfig::Activation::Swiglu}) {
    c.activation = act;
    c.norm_topk_prob = act == MoeConfig::Activation::Swiglu;
    CAPTURE(int(act));
    MoeHostWeights w(c, C, 71), g(c, C, 0);
    for (auto [name, v] : w.all())  // bf16 compute weights: the router stays f32
      if (std::string(name) != "router") *v = rounded_bf16(*v);
    std::vector<float> x = rounded_bf16(random_normal(size_t(T * C), 72));
    std::vector<float> dy = rounded_bf16(random_normal(size_t(T * C), 73));

    // The f32 reference on the CPU.
    MoeLayer ref(c, *cpu, C);
    MoeActs ra;
    std::vector<float> y_ref(size_t(T * C)), dx_ref(size_t(T * C));
    const MoeLosses L_ref = ref.forward(ra, as_tensor(y_ref, {T, C}), as_tensor(x, {T, C}), nullptr, w.views());
    MoeWeights gv = g.views();
    ref.backward(as_tensor(dx_ref, {T, C}), ra, as_tensor(dy, {T, C}), w.views(), gv, 1.0f);

    // bf16 rows on the GPU.
    std::vector<DeviceTensor> keep;
    const MoeWeights dw = device_weights(*ops, w, keep, false), dg = device_weights(*ops, w, keep, true);
    DeviceTensor dx_in = to_device(*ops, x, {T, C}, DType::BF16), ddy = to_device(*ops, dy, {T, C}, DType::BF16);
    DeviceTensor dy_out = zeros(*ops, {T, C}, DType::BF16), ddx = zeros(*ops, {T, C}, DType::BF16);
    MoeLayer layer(c, *ops, C);
    MoeActs a;
    const MoeLosses L = layer.forward(a, dy_out.t, dx_in.t, nullptr, dw);
    layer.backward(ddx.t, a, ddy.t, dw, dg, 1.0f);

    CHECK(to_host_i32(*ops, a.topk_t) == to_host_i32(*cpu, ra.topk_t));
    const auto gates = allclose(to_host(*ops, a.gates_t), to_host(*cpu, ra.gates_t), 1e-6, 1e-5);
    CHECK_MESSAGE(gates.ok, "gates: ", gates.str());
    CHECK(L.aux == doctest::Approx(L_ref.aux).epsilon(1e-5));
    CHECK(L.z == doctest::Approx(L_ref.z).epsilon(1e-5));
    CHECK(L.load_imbalance == L_ref.load_imbalance);

    check_bf16(to_host(*ops, dy_out.t), y_ref, "y");
    check_bf16(to_host(*ops, ddx.t), dx_ref, "dx");
    check_bf16(to_host(*ops, dg.router), g.router, "router gradient");
    check_bf16(to_host(*ops, dg.fc), g.fc, "fc gradient");
    check_bf16(to_host(*ops, dg.proj), g.proj, "proj gradient");
    check_bf16(to_host(*ops, dg.shared_fc), g.sfc, "shared fc gradient");
    if (c.bias) check_bf16(to_host(*ops, dg.proj_bias), g.projb, "proj bias gradient");
  }
}
