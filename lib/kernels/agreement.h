// Whether two implementations of one op agree on an output, judged on the host: where the CUDA
// backend times alternative kernels on a call's own data, it keeps only those whose results agree
// with its reference kernel's (engine.attention_backend = auto, cuda_attention_causal.cu).
//
// The test is scale-free, so that it judges activations of any magnitude and gradients of 1e-6
// alike, and it has two parts:
//  - each element: |got_i - want_i| <= element * (|want_i| + scale_i), where scale_i is the larger
//    of the rms of want over i's group (the `group` consecutive elements holding i, say one head's
//    vector; 0: the whole output) and the rms of all of want. The group's rms holds an element to
//    the size of its neighbours where they are larger than the output's typical size (the first
//    tokens' gradients, a peaked head), the global one where they are smaller (a gradient that is
//    exactly zero in exact arithmetic is rounding noise in both implementations);
//  - the whole: ||got - want||_2 <= norm * ||want||_2, which catches an error spread thinly over
//    many elements (a scale a few per cent off) that each stay within their element bound.
// The rms are taken over want's finite elements, the norms over the elements finite in both; a
// non-finite element agrees only with the same non-finite value (NaN with NaN, inf with inf of the
// same sign). The work is shared by the OpenMP threads in fixed chunks, added in order: the result
// does not depend on their number.
#pragma once
#include <cstddef>
#include <string>

#include "lib/core/tensor.h"

namespace mpigpt {

struct AgreementBounds {
  double element = 0, norm = 0;
  size_t group = 0;  // elements per group of the element bound's scale; 0: the whole output
};

struct Agreement {
  bool ok = true;
  size_t n = 0;              // elements compared
  size_t disagreeing = 0;    // elements outside their bound
  size_t worst = 0;          // the element with the largest error over its bound
  double want = 0, got = 0;  // its two values
  double ratio = 0;          // its error over its bound (> 1: it disagrees)
  double rms = 0;            // rms of want's finite elements
  double norm_ratio = 0;     // ||got - want|| / ||want||
  double norm_bound = 0;     // the bound it was held to
  // "agrees (difference 0.3% of the norm; worst element 3: 0.25 against 0.2501, 0.04x its bound)",
  // "17 of 4096 elements disagree (...)" or "differs by 2.1% of the norm, over the bound 1% (...)".
  std::string str() const;
};

// want and got: n host elements of dtype dt (F32 or BF16, as stored).
Agreement agreement(const void* want, const void* got, size_t n, DType dt, const AgreementBounds& bounds);

}  // namespace mpigpt
