// The host emulator's stand-in for cuda_bf16.h (docs/testing.md): bfloat16 as 16 bits with
// round-to-nearest-even conversion from float (NaN stays NaN), as __float2bfloat16_rn does.
#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 {
  uint16_t x;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  __nv_bfloat16 r;
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) {
    r.x = uint16_t((u >> 16) | 0x40);
    return r;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  r.x = uint16_t(u >> 16);
  return r;
}
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = uint32_t(b.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
struct float2;
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
