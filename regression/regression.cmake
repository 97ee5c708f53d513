# Loss-curve regression (regression/README.md): a fixture that prepares the fortunes dataset in
# the build tree, and the test that trains every layout of layouts.json and compares its loss
# curve with the single-rank one. Label `regression`; `ctest -L regression` runs only these,
# `ctest -LE regression` everything else. Included from the top-level CMakeLists.txt after
# cmake/tests.cmake, whose MPIGPT_MPIRUN and MPIGPT_TEST_ENV it uses.

# MPIGPT_PYTHON3 comes from cmake/tests.cmake (any python3 runs the comparison; only curves.png
# needs matplotlib).
if(NOT MPIGPT_PYTHON3)
  message(STATUS "mpigpt: no python3, the loss-curve regression test is not registered")
  return()
endif()

set(REGRESSION_DIR ${PROJECT_BINARY_DIR}/regression)
set(REGRESSION_RUN ${MPIGPT_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/run.py --binary $<TARGET_FILE:mpigpt>
    --out ${REGRESSION_DIR} --data ${REGRESSION_DIR}/data/fortunes --timeout ${MPIGPT_RUN_TIMEOUT})
string(JOIN " " REGRESSION_MPIRUN ${MPIGPT_MPIRUN})

# The regression model with one head of 64 channels (regression/tiny.ini has 4 heads of 16), so that
# bf16 training runs the tensor-core and cuDNN attention rather than the fp32-FMA kernels, and 128
# tokens (cuDNN 9.15 and older run the backward only for a multiple of 128); scripts/gpu_check.sh
# makes the same file.
set(tiny_ini ${CMAKE_CURRENT_LIST_DIR}/tiny.ini)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${tiny_ini})
file(READ ${tiny_ini} tiny)
string(REPLACE "num_heads = 4" "num_heads = 1" tiny_hd64 "${tiny}")
string(REPLACE "seq_len = 32" "seq_len = 128" tiny_hd64 "${tiny_hd64}")
if(NOT tiny_hd64 MATCHES "num_heads = 1" OR NOT tiny_hd64 MATCHES "seq_len = 128")
  message(FATAL_ERROR "regression.cmake: regression/tiny.ini no longer says 'num_heads = 4' and 'seq_len = 32'")
endif()
file(WRITE ${REGRESSION_DIR}/tiny_hd64.ini "${tiny_hd64}")

add_test(NAME regression/prepare_data COMMAND ${REGRESSION_RUN} --prepare-only)
set_tests_properties(regression/prepare_data PROPERTIES
  FIXTURES_SETUP regression_data LABELS regression TIMEOUT 120 ENVIRONMENT "${MPIGPT_TEST_ENV}")

# Up to 8 ranks train one after another; PROCESSORS 2 keeps `ctest -j` from running other tests
# beside it on the two cores.
add_test(NAME regression/loss_curves COMMAND ${REGRESSION_RUN} --mpirun "${REGRESSION_MPIRUN}")
set_tests_properties(regression/loss_curves PROPERTIES
  FIXTURES_REQUIRED regression_data LABELS regression TIMEOUT 600 PROCESSORS 2
  ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1")

# The same curves with CUDA compute (label gpu; skipped, exit 77, without a GPU). Every rank of a
# layout shares the one GPU over engine.comm = mpi (NCCL refuses two ranks on one device):
#  - regression/loss_curves_cuda: fp32 on the GPU, one rank and tp2 / pp2 / dp2 / cp2 / ep2, against
#    the CPU single-rank curves with the CPU suite's tolerance (1e-4 per step);
#  - regression/loss_curve_cuda_bf16: 50 steps of GPT-2 (dense, and both MoE families on one rank,
#    ep2, and tp2 x dp2 with the distributed optimizer, whose parameter gather moves the bf16
#    weights) in bf16 mixed precision on one GPU against the fp32 CPU curve of the same run, within
#    2e-2 per step (bf16 rounds activations and the compute weights to 8 bits of mantissa, ~4e-3
#    relative; the curve may drift a few times that);
#  - regression/loss_curve_cuda_bf16_hd64 and _hd64_cudnn: 50 steps of GPT-2 with one head of 64
#    channels, one rank, bf16, with engine.attention_backend = builtin (the mma.sync tensor-core
#    kernels) and cudnn (cuDNN's fused attention), against the fp32 CPU curve within 2e-2.
set(REGRESSION_CUDA_ARGS "--engine.backend cuda --engine.comm mpi --engine.allow_device_sharing true")
add_test(NAME regression/loss_curves_cuda COMMAND ${REGRESSION_RUN} --mpirun "${REGRESSION_MPIRUN}"
         --out ${REGRESSION_DIR}/cuda --require-gpu --with-one-rank --layouts "^(dp2|tp2|pp2|cp2|moe-ep2)$"
         --families gpt2,llama,qwen2,gpt2-moe,llama-moe --layout-args "${REGRESSION_CUDA_ARGS}")
add_test(NAME regression/loss_curve_cuda_bf16 COMMAND ${REGRESSION_RUN} --mpirun "${REGRESSION_MPIRUN}"
         --out ${REGRESSION_DIR}/cuda_bf16 --require-gpu --with-one-rank --layouts "^(moe-ep2|tp2-dp2-distopt)$"
         --families gpt2,gpt2-moe,llama-moe --steps 50 --skip-reference --tol 2e-2
         --layout-args "${REGRESSION_CUDA_ARGS} --training.precision bf16")
foreach(backend builtin cudnn)
  set(name regression/loss_curve_cuda_bf16_hd64)
  if(NOT backend STREQUAL builtin)
    string(APPEND name _${backend})
  endif()
  add_test(NAME ${name} COMMAND ${REGRESSION_RUN} --mpirun "${REGRESSION_MPIRUN}" --out ${REGRESSION_DIR}/cuda_bf16_hd64_${backend}
           --config ${REGRESSION_DIR}/tiny_hd64.ini --require-gpu --with-one-rank --layouts "^$" --families gpt2
           --steps 50 --skip-reference --tol 2e-2
           --layout-args "${REGRESSION_CUDA_ARGS} --training.precision bf16 --engine.attention_backend ${backend}")
  list(APPEND regression_gpu_tests ${name})
endforeach()
set_tests_properties(regression/loss_curves_cuda regression/loss_curve_cuda_bf16 ${regression_gpu_tests} PROPERTIES
  FIXTURES_REQUIRED regression_data LABELS "gpu;regression" SKIP_RETURN_CODE 77 TIMEOUT 600 PROCESSORS 2
  ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1")
