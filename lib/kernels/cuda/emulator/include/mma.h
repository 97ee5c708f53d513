// The host emulator's stand-in for mma.h (docs/testing.md): nvcuda::wmma for 16x16x16 tiles of
// bf16 with fp32 accumulators, the shapes cuda_attention_tc.cu uses. A fragment's layout is opaque
// on the GPU, so here each lane holds 8 elements of the tile at scrambled positions
// (tile_position): a kernel that relied on any particular fragment layout would fail its tests.
// load/store/fill touch only the calling lane's elements; mma_sync is warp-collective: every lane
// publishes its fragments, and computes its own elements of D = A B + C (products of bf16 values
// are exact in fp32, summed in fp32 in k order).
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_runtime.h"

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator has 16x16x16 tiles only");
  static constexpr int num_elements = 8;
  T x[8];
};

// Element i of a lane's fragment is tile element tile_position(lane, i) (row-major index into the
// 16 x 16 tile: (m,k) for A, (k,n) for B, (m,n) for the accumulator); 37 is odd, so this is a
// permutation of 0..255 that scatters each lane's elements over the tile.
inline int tile_position(int lane, int i) { return ((lane * 8 + i) * 37) & 255; }

// CUDA's rules for the memory side of a load or store: a 256-bit aligned pointer and a leading
// dimension of a multiple of 16 bytes; anything else is a bug the GPU may not report.
template <class T>
void check_memory(const T* p, unsigned ld, const char* op) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ld * sizeof(T)) % 16 != 0) {
    fprintf(stderr, "cuda emulator: wmma::%s with pointer %p (needs 32-byte alignment) and ld %u (needs a multiple "
            "of 16 bytes)\n", op, static_cast<const void*>(p), ld);
    abort();
  }
}

template <class Use, class T, class L>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ld) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load names its memory layout");
  check_memory(p, ld, "load_matrix_sync");
  const int lane = emu::lane();
  for (int i = 0; i < 8; ++i) {
    const int pos = tile_position(lane, i), r = pos / 16, c = pos % 16;
    f.x[i] = std::is_same_v<L, row_major> ? p[size_t(r) * ld + c] : p[size_t(c) * ld + r];
  }
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ld, layout_t l) {
  check_memory(p, ld, "load_matrix_sync");
  const int lane = emu::lane();
  for (int i = 0; i < 8; ++i) {
    const int pos = tile_position(lane, i), r = pos / 16, c = pos % 16;
    f.x[i] = l == mem_row_major ? p[size_t(r) * ld + c] : p[size_t(c) * ld + r];
  }
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ld, layout_t l) {
  check_memory(p, ld, "store_matrix_sync");
  const int lane = emu::lane();
  for (int i = 0; i < 8; ++i) {
    const int pos = tile_position(lane, i), r = pos / 16, c = pos % 16;
    (l == mem_row_major ? p[size_t(r) * ld + c] : p[size_t(c) * ld + r]) = f.x[i];
  }
}
template <class Use, class T, class L>
void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, float v) {
  for (auto& x : f.x) x = T(v);
}
template <class Use, class L>
void fill_fragment(fragment<Use, 16, 16, 16, __nv_bfloat16, L>& f, float v) {
  for (auto& x : f.x) x = __float2bfloat16_rn(v);
}

template <class LA, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
              const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  struct Lane {
    __nv_bfloat16 a[8], b[8];
    float c[8];
  };
  Lane mine, all[32];
  for (int i = 0; i < 8; ++i) {
    mine.a[i] = a.x[i];
    mine.b[i] = b.x[i];
    mine.c[i] = c.x[i];
  }
  emu::warp_allgather(&mine, all, sizeof(Lane));
  float A[256], B[256], C[256];  // the whole tiles, row-major
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 8; ++i) {
      const int pos = tile_position(l, i);
      A[pos] = __bfloat162float(all[l].a[i]);
      B[pos] = __bfloat162float(all[l].b[i]);
      C[pos] = all[l].c[i];
    }
  const int lane = emu::lane();
  for (int i = 0; i < 8; ++i) {
    const int pos = tile_position(lane, i), r = pos / 16, n = pos % 16;
    float s = C[pos];
    for (int k = 0; k < 16; ++k) s += A[r * 16 + k] * B[k * 16 + n];
    d.x[i] = s;
  }
}

}  // namespace nvcuda::wmma
