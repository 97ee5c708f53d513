// GPU test (CTest label gpu; skipped without a GPU): the tensor-core primitives of cuda_mma.cuh
// (ldmatrix with and without .trans, mma.sync m16n8k16, an accumulator reused as the next
// product's operand) against exact products; and Hopper's warpgroup products (cuda_wgmma.cuh) the
// same way, on GPUs that run sm_90a code. The inputs are small integers, so every product and
// sum is exact in bf16 and fp32 and the results must match exactly: any fragment-layout mistake
// moves elements and fails here, before it could pass for rounding in the attention tests. A failing
// warpgroup product is also named: the test says which misreading of the descriptor layouts (LBO
// and SBO swapped, the transpose flag misread) gives the GPU's result.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/cuda_mma_check.h"
#include "lib/kernels/cuda/cuda_wgmma_check.h"
#endif

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// n values in [-r, r] (16 x 16 in [-3, 3] unless told).
std::vector<float> small_integers(uint64_t seed, size_t n = 256, int r = 3) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& f : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    f = float(int(x % uint64_t(2 * r + 1)) - r);
  }
  return v;
}

std::vector<float> product(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> c(256, 0.f);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j)
      for (int k = 0; k < 16; ++k) c[size_t(i * 16 + j)] += a[size_t(i * 16 + k)] * b[size_t(k * 16 + j)];
  return c;
}

// A host model of how a warpgroup product reads a 16-bit operand from shared memory through a
// descriptor without swizzling (PTX ISA, "matrix descriptor"): element (mn, k) of a K-major
// operand at byte start + 16 (mn % 8) + 2 (k % 8) + SBO (mn / 8) + LBO (k / 8), of an MN-major one
// at start + 2 (mn % 8) + 16 (k % 8) + SBO (mn / 8) + LBO (k / 8). When the GPU's products are not
// the exact ones, the test computes them under each of a few readings (the documented one, LBO and
// SBO swapped, the other major-ness) and names those that match the GPU's bit for bit: the layout
// mistake, found in the one run that shows it.
struct Reading {
  const char* name;
  bool mn_major;
  size_t lbo, sbo;  // bytes
};

// x rounded to bf16 (to nearest, ties to even; x finite).
float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// A tile of rows x cols values (row-major) as cuda_wgmma.cuh stores it: 8 x 8 core matrices of 128
// contiguous bytes, the cores of a group of 8 rows side by side, the row groups one after another.
std::vector<float> canonical_image(const std::vector<float>& m, int rows, int cols) {
  std::vector<float> image(m.size());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      image[size_t((r / 8) * 8 * cols + (c / 8) * 64 + (r % 8) * 8 + c % 8)] = m[size_t(r * cols + c)];
  return image;
}

float read_operand(const std::vector<float>& image, size_t start, const Reading& r, int mn, int k) {
  const size_t at = start + size_t(mn / 8) * r.sbo + size_t(k / 8) * r.lbo +
                    (r.mn_major ? 16 * size_t(k % 8) + 2 * size_t(mn % 8) : 16 * size_t(mn % 8) + 2 * size_t(k % 8));
  return at / 2 < image.size() ? image[at / 2] : std::numeric_limits<float>::quiet_NaN();
}

// out (64 x 64) = sum over k-steps s < steps of A_s B_s, where A_s (64 x 16) is a(i, kk, s) and B_s
// (16 x 64) is read from image through reading r at byte start_b(s), B's rows being the K index.
template <class A>
std::vector<float> modelled_product(A a, const std::vector<float>& image, const Reading& r, int steps,
                                    size_t step_bytes) {
  std::vector<float> out(64 * 64, 0.f);
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j) {
      float sum = 0.f;
      for (int s = 0; s < steps; ++s)
        for (int kk = 0; kk < 16; ++kk) sum += a(i, kk, s) * read_operand(image, s * step_bytes, r, j, kk);
      out[size_t(i * 64 + j)] = sum;
    }
  return out;
}

// The readings of a tile of cols 16-bit columns: as cuda_wgmma.cuh describes it (K-major, or
// MN-major when mn_major), and the alternatives a misread of the PTX layouts would give.
std::vector<Reading> readings(int cols, bool mn_major) {
  const size_t row_group = 16 * size_t(cols);
  if (!mn_major)
    return {{"K-major as documented (LBO 128, SBO 16 COLS)", false, 128, row_group},
            {"K-major with LBO and SBO swapped", false, row_group, 128},
            {"read MN-major (the transpose flag misread)", true, row_group, 128},
            {"read MN-major with LBO and SBO swapped", true, 128, row_group}};
  return {{"MN-major as documented (LBO 16 COLS, SBO 128)", true, row_group, 128},
          {"MN-major with LBO and SBO swapped", true, 128, row_group},
          {"read K-major (the transpose flag misread)", false, 128, row_group},
          {"read K-major with LBO and SBO swapped", false, row_group, 128}};
}

// What the GPU's result got matches: the names of the candidates equal to it, or where it first
// differs from the expected result.
std::string diagnose(const std::vector<float>& got, const std::vector<float>& expected,
                     const std::vector<std::pair<std::string, std::vector<float>>>& candidates) {
  std::string matches;
  for (const auto& [name, values] : candidates)
    if (values == got) matches += (matches.empty() ? "" : "; ") + name;
  if (!matches.empty()) return "the GPU's products match: " + matches;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != expected[i])
      return "no modelled reading matches; first difference at (" + std::to_string(i / 64) + ", " +
             std::to_string(i % 64) + "): " + std::to_string(got[i]) + " instead of " + std::to_string(expected[i]);
  return "equal to the exact products";
}

// The candidates for d = A X^T (both K-major, two k-steps of 256 bytes): each reading of X, with A
// read as documented and with its LBO and SBO swapped (A is K-major in the SS form).
std::vector<std::pair<std::string, std::vector<float>>> ss_candidates(const std::vector<float>& A,
                                                                      const std::vector<float>& X) {
  const auto a_image = canonical_image(A, 64, 32), x_image = canonical_image(X, 64, 32);
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (const Reading& ra : readings(32, false))
    if (!ra.mn_major)
      for (const Reading& rx : readings(32, false)) {
        auto a = [&](int i, int kk, int s) { return read_operand(a_image, size_t(s) * 256, ra, i, kk); };
        out.emplace_back(std::string("A ") + ra.name + ", X " + rx.name, modelled_product(a, x_image, rx, 2, 256));
      }
  return out;
}

// The candidates for a product whose A comes from registers (taken to be right: A given row-major,
// 64 x 16 steps) and whose B is a canonical tile of cols columns read each way.
std::vector<std::pair<std::string, std::vector<float>>> rs_candidates(const std::vector<float>& A, int a_cols,
                                                                      const std::vector<float>& B, int b_rows,
                                                                      int b_cols, bool mn_major, int steps,
                                                                      size_t step_bytes) {
  const auto image = canonical_image(B, b_rows, b_cols);
  auto a = [&](int i, int kk, int s) { return A[size_t(i * a_cols + 16 * s + kk)]; };
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (const Reading& r : readings(b_cols, mn_major))
    out.emplace_back(std::string("B ") + r.name, modelled_product(a, image, r, steps, step_bytes));
  return out;
}

}  // namespace

TEST_CASE("cuda mma primitives: ldmatrix and mma.sync fragments give exact products") {
  auto ops = cuda_ops_or_skip();
#ifdef MPIGPT_WITH_CUDA
  const auto A = small_integers(1), B = small_integers(2), C = small_integers(3);
  std::vector<float> Bt(256);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 16; ++n) Bt[size_t(n * 16 + k)] = B[size_t(k * 16 + n)];
  const auto D = product(A, B), E = product(D, C);  // |D| <= 144: exact in bf16
  auto dA = to_device(*ops, A, {16, 16}, DType::BF16), dB = to_device(*ops, B, {16, 16}, DType::BF16),
       dBt = to_device(*ops, Bt, {16, 16}, DType::BF16), dC = to_device(*ops, C, {16, 16}, DType::BF16);
  for (bool transposed : {false, true}) {
    CAPTURE(transposed);
    auto d = zeros(*ops, {16, 16}), e = zeros(*ops, {16, 16});
    ops->synchronize();
    cuda::mma_primitives_check(dA.t.ptr, transposed ? dBt.t.ptr : dB.t.ptr, dC.t.ptr,
                               static_cast<float*>(d.t.ptr), static_cast<float*>(e.t.ptr), transposed);
    const auto hd = to_host(*ops, d.t), he = to_host(*ops, e.t);
    int bad_d = 0, bad_e = 0;
    for (size_t i = 0; i < 256; ++i) {
      bad_d += hd[i] != D[i];
      bad_e += he[i] != E[i];
    }
    CHECK(bad_d == 0);
    CHECK(bad_e == 0);
  }
#endif
}

TEST_CASE("cuda wgmma primitives: canonical tiles, descriptors and warpgroup fragments give exact products") {
  auto ops = cuda_ops_or_skip();
#ifdef MPIGPT_WITH_CUDA
  if (!cuda::attention_wgmma_available()) {
    MESSAGE("this GPU does not run sm_90a code (wgmma): nothing to check");
    return;
  }
  // d = A X^T (64 x 32 by 32 x 64), e = d Y (64 x 64 by 64 x 64). Values in [-2, 2]: |d| <= 128 is
  // exact in bf16 (e's operand), |e| <= 16384 in fp32.
  const auto A = small_integers(4, 64 * 32, 2), X = small_integers(5, 64 * 32, 2), Y = small_integers(6, 64 * 64, 2);
  std::vector<float> D(64 * 64, 0.f), E(64 * 64, 0.f);
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j)
      for (int k = 0; k < 32; ++k) D[size_t(i * 64 + j)] += A[size_t(i * 32 + k)] * X[size_t(j * 32 + k)];
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j)
      for (int k = 0; k < 64; ++k) E[size_t(i * 64 + j)] += D[size_t(i * 64 + k)] * Y[size_t(k * 64 + j)];
  auto dA = to_device(*ops, A, {64, 32}, DType::BF16), dX = to_device(*ops, X, {64, 32}, DType::BF16),
       dY = to_device(*ops, Y, {64, 64}, DType::BF16);
  auto d = zeros(*ops, {64, 64}), e = zeros(*ops, {64, 64}), f = zeros(*ops, {64, 64});
  ops->synchronize();
  cuda::wgmma_primitives_check(dA.t.ptr, dX.t.ptr, dY.t.ptr, static_cast<float*>(d.t.ptr),
                               static_cast<float*>(e.t.ptr), static_cast<float*>(f.t.ptr));
  const auto hd = to_host(*ops, d.t), he = to_host(*ops, e.t), hf = to_host(*ops, f.t);

  // The model of the hardware's reads that names a mistake: its documented readings give the exact
  // products, and a result made under another reading is named as that one (readings that would
  // reach past the tile give NaN and match nothing, so the two checked here stay inside it).
  const auto ss = ss_candidates(A, X), rs_mn = rs_candidates(D, 64, Y, 64, 64, true, 4, 2048),
             rs_k = rs_candidates(A, 32, X, 64, 32, false, 2, 256);
  REQUIRE(ss[0].second == D);
  REQUIRE(rs_mn[0].second == E);
  REQUIRE(rs_k[0].second == D);
  CHECK(diagnose(ss[5].second, D, ss) == "the GPU's products match: " + ss[5].first);
  CHECK(diagnose(rs_mn[3].second, E, rs_mn) == "the GPU's products match: " + rs_mn[3].first);

  INFO("d (SS, both K-major): ", diagnose(hd, D, ss));
  // e's A is the GPU's own d in bf16: named from that, a wrong d does not hide how Y was read.
  std::vector<float> hd_bf16(hd.size());
  for (size_t i = 0; i < hd.size(); ++i) hd_bf16[i] = bf16_round(hd[i]);
  INFO("e (RS from an accumulator, B MN-major): ",
       diagnose(he, E, rs_candidates(hd_bf16, 64, Y, 64, 64, true, 4, 2048)));
  INFO("f (RS from load_a_regs, B K-major): ", diagnose(hf, D, rs_k));
  int bad_d = 0, bad_e = 0, bad_f = 0;
  for (size_t i = 0; i < hd.size(); ++i) {
    bad_d += hd[i] != D[i];
    bad_e += he[i] != E[i];
    bad_f += hf[i] != D[i];
  }
  CHECK(bad_d == 0);  // SS, both operands K-major
  CHECK(bad_e == 0);  // RS from an accumulator, B MN-major
  CHECK(bad_f == 0);  // RS from load_a_regs, B K-major
#endif
}
