// Counter-based random numbers (Philox4x32-10): the value at (seed, stream, index) is a pure
// function of those three, so a weight element is initialised from its position in the global,
// unsharded tensor (DESIGN principle 3) and every layout holds exactly the single-rank values.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

namespace mpigpt {

// Philox4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// 64-bit FNV-1a of a string: turns a parameter's global name into its RNG stream.
uint64_t stream_of(std::string_view name);

// Uniform in (0, 1) and standard normal at one point of the (seed, stream, index) space.
double uniform_at(uint64_t seed, uint64_t stream, uint64_t index);
float normal_at(uint64_t seed, uint64_t stream, uint64_t index);
// 64 random bits at one point (for shuffles).
uint64_t bits_at(uint64_t seed, uint64_t stream, uint64_t index);

}  // namespace mpigpt
