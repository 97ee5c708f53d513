// The tensor-core primitives of cuda_mma.cuh on one 16 x 16 x 16 problem, for a GPU test that compares
// them with exact products: a mismatch between the documented fragment layouts and the hardware shows
// up there by name, not as a wrong attention. Plain C++ (the test binary is not compiled by nvcc).
#pragma once

namespace mpigpt::cuda {

// One warp computes d = A B and e = bf16(d) C (16 x 16 each, row-major): a, b, c bf16 and d, e f32
// device pointers. b_transposed: b holds B^T, read with the non-transposing ldmatrix (load_b_nk);
// otherwise B, read with the transposing one (load_b_kn), as c always is. Runs on the default
// stream and waits for it; the caller finishes its own streams' writes of the inputs first.
void mma_primitives_check(const void* a, const void* b, const void* c, float* d, float* e, bool b_transposed);

}  // namespace mpigpt::cuda
