# The host emulator of the CUDA backend (docs/testing.md): the kernels of lib/kernels/cuda/*.cu,
# rewritten for C++ by lib/kernels/cuda/emulator/rewrite_launches.py and compiled for the CPU
# against stand-in CUDA headers (lib/kernels/cuda/emulator/include), run the GPU tests of
# lib/kernels/cuda/*_test.cpp against the CPU backend on any machine, with or without nvcc. One
# CTest entry per test file, `emulated/<file>`, label `emulated`. Not covered: cuBLASLt itself (a
# reference implementation stands in), NCCL, and anything about speed.
find_program(MPIGPT_EMULATOR_PYTHON3 python3)
if(NOT MPIGPT_EMULATOR_PYTHON3)
  message(STATUS "mpigpt: no python3, the emulated CUDA tests are not registered")
  return()
endif()

set(EMU_SRC ${PROJECT_SOURCE_DIR}/lib/kernels/cuda/emulator)
set(EMU_GEN ${PROJECT_BINARY_DIR}/emulated)
file(GLOB emu_cu CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/lib/kernels/cuda/*.cu
     ${PROJECT_SOURCE_DIR}/lib/kernels/cuda/*.cuh)
set(emu_generated)
foreach(f ${emu_cu})
  get_filename_component(name ${f} NAME)
  if(name MATCHES "\\.cu$")
    string(REGEX REPLACE "\\.cu$" ".cpp" name ${name})
    set(out ${EMU_GEN}/src/${name})
  else()  # headers keep their include path, ahead of the originals
    set(out ${EMU_GEN}/include/lib/kernels/cuda/${name})
  endif()
  add_custom_command(OUTPUT ${out}
    COMMAND ${MPIGPT_EMULATOR_PYTHON3} ${EMU_SRC}/rewrite_launches.py ${f} ${out}
    DEPENDS ${f} ${EMU_SRC}/rewrite_launches.py VERBATIM)
  list(APPEND emu_generated ${out})
endforeach()

# The CPU backend is compiled again here: the mpigpt_kernels archive of a CUDA build holds the
# real CUDA objects, whose symbols the emulated ones replace.
file(GLOB emu_cpu CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/lib/kernels/*.cpp ${PROJECT_SOURCE_DIR}/lib/kernels/cpu/*.cpp)
list(FILTER emu_cpu EXCLUDE REGEX "_test\\.cpp$")
add_library(mpigpt_kernels_emulated STATIC ${emu_generated} ${emu_cpu} ${EMU_SRC}/emulator.cpp
            ${EMU_SRC}/reference_cublaslt.cpp)
target_include_directories(mpigpt_kernels_emulated BEFORE PUBLIC ${EMU_GEN}/include ${EMU_SRC}/include)
target_include_directories(mpigpt_kernels_emulated PRIVATE ${OPENBLAS_INCLUDE_DIR})
target_compile_definitions(mpigpt_kernels_emulated PUBLIC MPIGPT_WITH_CUDA=1 MPIGPT_CUDA_ARCHS="90")
target_link_libraries(mpigpt_kernels_emulated PUBLIC mpigpt_core ${OPENBLAS_LIBRARY})
# The rewritten kernels are C++ now: the emulator's cuda_runtime.h comes first in every one, and the
# compiler ignores their #pragma unroll (and, since #line names the .cu file, takes their
# anonymous-namespace types for a header's).
set_source_files_properties(${emu_generated} PROPERTIES COMPILE_OPTIONS "-include;cuda_runtime.h;-Wno-unknown-pragmas;-Wno-subobject-linkage")

file(GLOB emu_tests CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/lib/kernels/cuda/*_test.cpp)
add_executable(mpigpt_emulated_tests ${PROJECT_SOURCE_DIR}/cmake/test_main.cpp ${emu_tests})
target_link_libraries(mpigpt_emulated_tests PRIVATE mpigpt_kernels_emulated MPI::MPI_C doctest::doctest)
foreach(src ${emu_tests})
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${src})
  string(REGEX REPLACE "_test\\.cpp$" "" name ${rel})
  add_test(NAME emulated/${name} COMMAND $<TARGET_FILE:mpigpt_emulated_tests> --source-file=*${rel} --no-version=true)
  set_tests_properties(emulated/${name} PROPERTIES LABELS emulated
    ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1")
endforeach()
