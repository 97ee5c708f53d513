// The host emulator's stand-in for cuda_pipeline_primitives.h (docs/testing.md): the asynchronous
// global -> shared copies (cp.async) of sm_80 and later.
#pragma once
#include <cstddef>

#include "cuda_runtime.h"

namespace emu {
void pipeline_copy(void* dst, const void* src, size_t bytes);
void pipeline_commit();
void pipeline_wait_prior(size_t prior);
}  // namespace emu

// A copy takes its source bytes when it is issued and fills its destination with 0xff bytes (NaNs):
// the data arrives only when the issuing thread's __pipeline_wait_prior completes its batch, so a
// kernel that reads a tile before waiting (or before the block barrier that makes other threads'
// copies visible) reads NaNs and fails.
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size_and_align, size_t zfill = 0) {
  emu::pipeline_copy(dst, src, size_and_align - zfill);
  if (zfill) std::memset(static_cast<char*>(dst) + (size_and_align - zfill), 0, zfill);
}
inline void __pipeline_commit() { emu::pipeline_commit(); }
inline void __pipeline_wait_prior(size_t prior) { emu::pipeline_wait_prior(prior); }
