// Whether two implementations of one op agree on an output, judged on the host: where the CUDA
// backend times alternative kernels on a call's own data, it keeps only those whose results agree
// with its reference kernel's (engine.attention_backend = auto, cuda_attention_causal.cu).
//
// The test is scale-free, so that it judges activations of any magnitude and gradients of 1e-6
// alike: element i agrees when |got_i - want_i| <= tol * (|want_i| + rms(want)), the rms taken over
// the finite elements of want. A non-finite element agrees only with the same non-finite value
// (NaN with NaN, inf with inf of the same sign).
#pragma once
#include <cstddef>
#include <string>

#include "lib/core/tensor.h"

namespace mpigpt {

struct Agreement {
  bool ok = true;
  size_t n = 0;              // elements compared
  size_t disagreeing = 0;    // elements outside the bound
  size_t worst = 0;          // the element with the largest error over its bound
  double want = 0, got = 0;  // its two values
  double ratio = 0;          // its error over its bound (> 1: it disagrees)
  double rms = 0;            // rms of want's finite elements
  // "agrees (worst element 3: 0.25 against 0.2501, 0.04x the bound)" or "... 17 of 4096 elements disagree ...".
  std::string str() const;
};

// want and got: n host elements of dtype dt (F32 or BF16, as stored).
Agreement agreement(const void* want, const void* got, size_t n, DType dt, double tol);

}  // namespace mpigpt
