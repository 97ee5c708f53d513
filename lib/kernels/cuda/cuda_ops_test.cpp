// GPU test (CTest label gpu; exits 77, reported as skipped, without a GPU): the CUDA backend's memory,
// copy, f32 <-> bf16 conversion and element-wise ops, the caching allocator's steady state and the
// out-of-memory message.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/cuda_ops.h"
#endif

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

uint16_t bf16_bits(float x) {  // the bf16 that round_bf16(x) stands for
  const float r = round_bf16(x);
  uint32_t u;
  std::memcpy(&u, &r, 4);
  return uint16_t(u >> 16);
}

// Values that exercise the rounding: ties to even both ways, carries into the exponent, subnormals,
// the largest finite float (rounds to inf), signed zero, infinities; then random normals.
std::vector<float> rounding_cases(size_t random_count) {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 1.0f + 0x1p-8f /* tie -> 1 */, 1.0f + 3 * 0x1p-8f /* tie -> up */,
                          1.0f + 0x1p-8f + 0x1p-20f /* just above the tie */, 0x1.ffp0f /* carry -> 2 */,
                          0x1p-130f /* subnormal */, -0x1.234p-140f, 3.0e38f, std::numeric_limits<float>::max(),
                          kInf, -kInf, 0.1f, 1.0f / 3.0f, 65504.0f, 1e-30f};
  auto r = random_normal(random_count, 5, 0, 3.0f);
  v.insert(v.end(), r.begin(), r.end());
  return v;
}

}  // namespace

TEST_CASE("cuda ops: name, stream, zero-filled allocation (also of a reused block)") {
  auto ops = cuda_ops_or_skip();
  CHECK(ops->device() == Device::CUDA);
  CHECK(ops->name().find("cuda") == 0);
  CHECK(ops->name().find("sm_") != std::string::npos);
  CHECK(ops->stream() != nullptr);
  for (size_t bytes : {size_t(4), size_t(1000), size_t(3) << 20}) {
    CAPTURE(bytes);
    void* p = ops->allocate(bytes);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0);
    const int64_t n = int64_t(bytes / 4);
    Tensor t(p, {n}, DType::F32, Device::CUDA);
    ops->fill(t, 7.0f);  // dirty it, give it back, and take the same block again
    ops->release(p);
    void* q = ops->allocate(bytes);
    CHECK(q == p);  // the cache hands back the block just released
    auto host = to_host(*ops, Tensor(q, {n}, DType::F32, Device::CUDA));
    CHECK(std::all_of(host.begin(), host.end(), [](float x) { return x == 0.0f; }));
    ops->release(q);
  }
  void* z = ops->allocate(0);  // a distinct pointer even for nothing
  CHECK(z != nullptr);
  ops->release(z);
  ops->synchronize();
}

TEST_CASE("cuda ops: copies host <-> device <-> device, every direction, f32 and i32 bit-exact") {
  auto ops = cuda_ops_or_skip();
  const int64_t n = 1000003;  // not a multiple of anything: tails of the grid-stride loops
  auto x = random_normal(size_t(n), 1);
  x[0] = kNaN;
  x[1] = -0.0f;
  x[2] = kInf;
  Buffer a(*ops, size_t(n) * 4), b(*ops, size_t(n) * 4);
  Tensor ta = a.tensor({n}), tb = b.tensor({1, n});  // shapes may differ when the element count agrees
  {
    // The host source may be overwritten as soon as copy returns.
    std::vector<float> src = x;
    ops->copy(ta, as_tensor(src, {n}));
    std::fill(src.begin(), src.end(), 42.0f);
  }
  ops->copy(tb, ta);  // device -> device
  std::vector<float> back(static_cast<size_t>(n), 1.0f);
  ops->copy(as_tensor(back, {n}), tb);  // device -> host: readable on return
  CHECK(std::memcmp(back.data(), x.data(), x.size() * 4) == 0);
  // host -> host works too.
  std::vector<float> h2(static_cast<size_t>(n));
  ops->copy(Tensor(h2.data(), {n}, DType::F32, Device::CPU), as_tensor(back, {n}));
  CHECK(std::memcmp(h2.data(), x.data(), x.size() * 4) == 0);

  std::vector<int32_t> idx(777);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = int32_t(i * 2654435761u);
  auto di = to_device(*ops, idx, {777});
  CHECK(to_host_i32(*ops, di.t) == idx);

  std::vector<float> small(5);
  CHECK_THROWS_WITH_AS(ops->copy(as_tensor(small, {5}), ta), doctest::Contains("copy"), Error);
  const Tensor a777(a.data(), {777}, DType::F32, Device::CUDA);
  CHECK_THROWS_WITH_AS(ops->copy(Tensor(idx.data(), {777}, DType::I32, Device::CPU), a777), doctest::Contains("dtype"),
                       Error);
  CHECK_THROWS_AS(ops->copy(Tensor(static_cast<float*>(a.data()) + 1, {100}, DType::F32, Device::CUDA),
                            Tensor(a.data(), {100}, DType::F32, Device::CUDA)),
                  Error);  // overlapping device ranges
}

TEST_CASE("cuda ops: f32 <-> bf16 conversion on the device rounds to nearest even, like round_bf16") {
  auto ops = cuda_ops_or_skip();
  auto x = rounding_cases(4096);
  x.push_back(kNaN);
  const int64_t n = int64_t(x.size());
  auto f = to_device(*ops, x, {n});
  auto h = zeros(*ops, {n}, DType::BF16);
  ops->copy(h.t, f.t);  // f32 -> bf16
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  ops->copy(Tensor(bits.data(), {n}, DType::BF16, Device::CPU), h.t);  // raw bf16 to the host
  for (int64_t i = 0; i < n - 1; ++i) {
    CAPTURE(i);
    CAPTURE(x[size_t(i)]);
    CHECK(bits[size_t(i)] == bf16_bits(x[size_t(i)]));
  }
  CHECK((bits.back() & 0x7f80) == 0x7f80);  // NaN stays NaN
  CHECK((bits.back() & 0x007f) != 0);
  // bf16 -> f32 is exact, so the round trip equals round_bf16 bit for bit.
  auto back = to_host(*ops, h.t);
  for (int64_t i = 0; i < n - 1; ++i) {
    const float want = round_bf16(x[size_t(i)]);
    CHECK(std::memcmp(&back[size_t(i)], &want, 4) == 0);
  }
  CHECK(std::isnan(back.back()));
  // bf16 -> bf16 copies are bitwise, host -> device too.
  auto h2 = zeros(*ops, {n}, DType::BF16);
  ops->copy(h2.t, Tensor(bits.data(), {n}, DType::BF16, Device::CPU));
  auto h3 = zeros(*ops, {n}, DType::BF16);
  ops->copy(h3.t, h2.t);
  std::vector<uint16_t> bits3(static_cast<size_t>(n));
  ops->copy(Tensor(bits3.data(), {n}, DType::BF16, Device::CPU), h3.t);
  CHECK(bits3 == bits);
  // Conversion is device-only and never involves i32.
  CHECK_THROWS_WITH_AS(ops->copy(h.t, Tensor(x.data(), {n}, DType::F32, Device::CPU)),
                       doctest::Contains("on the device only"), Error);
  auto i = zeros(*ops, {n}, DType::I32);
  CHECK_THROWS_WITH_AS(ops->copy(i.t, f.t), doctest::Contains("i32"), Error);
}

TEST_CASE("cuda ops: fill, scale and add in f32 and bf16 match the host computation exactly") {
  auto ops = cuda_ops_or_skip();
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(300007)}) {
    CAPTURE(n);
    auto xa = random_normal(size_t(n), 11, 0), xb = random_normal(size_t(n), 11, 1);
    for (DType dt : {DType::F32, DType::BF16}) {
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      const bool bf = dt == DType::BF16;
      auto ra = bf ? rounded_bf16(xa) : xa, rb = bf ? rounded_bf16(xb) : xb;
      auto a = to_device(*ops, xa, {n}, dt), b = to_device(*ops, xb, {n}, dt);
      // fill: the value rounded to the dtype; 0 and -0 included.
      for (float v : {1.5f, 0.1f, 0.0f, -0.0f, -3.0e5f}) {
        auto t = zeros(*ops, {n}, dt);
        ops->fill(t.t, v);
        auto got = to_host(*ops, t.t);
        const float want = bf ? round_bf16(v) : v;
        CHECK(std::memcmp(&got[0], &want, 4) == 0);
        CHECK(std::memcmp(&got[size_t(n - 1)], &want, 4) == 0);
      }
      // scale: one f32 multiply, rounded once to the dtype (the host does the same operation).
      auto s = to_device(*ops, xa, {n}, dt);
      ops->scale(s.t, 0.3f);
      auto got = to_host(*ops, s.t);
      for (int64_t i = 0; i < n; ++i) {
        const float want = bf ? round_bf16(ra[size_t(i)] * 0.3f) : ra[size_t(i)] * 0.3f;
        REQUIRE(got[size_t(i)] == want);
      }
      // add: out = a + b, also in place (out aliases a).
      auto o = zeros(*ops, {n}, dt);
      ops->add(o.t, a.t, b.t);
      got = to_host(*ops, o.t);
      for (int64_t i = 0; i < n; ++i) {
        const float want = bf ? round_bf16(ra[size_t(i)] + rb[size_t(i)]) : ra[size_t(i)] + rb[size_t(i)];
        REQUIRE(got[size_t(i)] == want);
      }
      ops->add(a.t, a.t, b.t);
      CHECK(to_host(*ops, a.t) == got);
    }
  }
  // fill on i32 truncates the value; scale/add refuse i32 and mixed dtypes.
  auto i = zeros(*ops, {33}, DType::I32);
  ops->fill(i.t, 7.9f);
  CHECK(to_host_i32(*ops, i.t) == std::vector<int32_t>(33, 7));
  ops->fill(i.t, -2.0f);
  CHECK(to_host_i32(*ops, i.t) == std::vector<int32_t>(33, -2));
  CHECK_THROWS_WITH_AS(ops->scale(i.t, 2.0f), doctest::Contains("scale"), Error);
  auto f = zeros(*ops, {33}), h = zeros(*ops, {33}, DType::BF16);
  CHECK_THROWS_WITH_AS(ops->add(f.t, f.t, h.t), doctest::Contains("add"), Error);
  std::vector<float> host(33);
  CHECK_THROWS_WITH_AS(ops->add(f.t, f.t, as_tensor(host, {33})), doctest::Contains("host memory"), Error);
}

TEST_CASE("cuda ops: after a warm-up step, a repeated allocate/release pattern does no new cudaMalloc") {
  auto ops = cuda_ops_or_skip();
#ifdef MPIGPT_WITH_CUDA
  auto& cops = dynamic_cast<cuda::CudaOps&>(*ops);
  // A step as the trainer makes one: activations of several sizes kept until "backward", scratch
  // in between, gradient buffers, an op that takes scratch of its own (the bias gradient's
  // partial sums), released in reverse.
  const std::vector<size_t> sizes = {3 << 20, 700 << 10, 12 << 20, 4096, 25 << 20, 1, 9 << 20, 64 << 10};
  auto step = [&] {
    std::vector<Buffer> saved;
    for (size_t s : sizes) {
      saved.emplace_back(*ops, s);
      Buffer scratch(*ops, s / 2 + 100);
      ops->fill(saved.back().tensor({int64_t(s / 4)}), 1.0f);
    }
    auto x = zeros(*ops, {1000, 40}), w = zeros(*ops, {24, 40}), dout = zeros(*ops, {1000, 24});
    auto dx = zeros(*ops, {1000, 40}), dw = zeros(*ops, {24, 40}), db = zeros(*ops, {24});
    ops->linear_backward(dx.t, dw.t, db.t, dout.t, x.t, w.t);
    while (!saved.empty()) saved.pop_back();
    ops->synchronize();
  };
  step();
  const auto warm = cops.allocator().stats();
  for (int i = 0; i < 5; ++i) step();
  const auto after = cops.allocator().stats();
  CHECK(after.raw_allocs == warm.raw_allocs);
  CHECK(after.reserved == warm.reserved);
  CHECK(after.allocations > warm.allocations + 5 * int64_t(sizes.size()));
  CHECK(after.in_use == warm.in_use);
#endif
}

TEST_CASE("cuda ops: running out of device memory names the request, the free memory and the fix") {
  auto ops = cuda_ops_or_skip();
  const size_t huge = size_t(1) << 50;  // 1 PiB: more than any GPU has
  try {
    ops->allocate(huge);
    FAIL("allocating 1 PiB succeeded");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK(msg.find("out of GPU memory") != std::string::npos);
    CHECK(msg.find("requested 1125899906842624 bytes") != std::string::npos);
    CHECK(msg.find("are free") != std::string::npos);
    CHECK(msg.find("training.micro_batch") != std::string::npos);
    CHECK(msg.find("engine.recompute") != std::string::npos);
  }
  // The backend keeps working afterwards.
  auto t = to_device(*ops, std::vector<float>{1, 2, 3}, {3});
  CHECK(to_host(*ops, t.t) == std::vector<float>{1, 2, 3});
}
