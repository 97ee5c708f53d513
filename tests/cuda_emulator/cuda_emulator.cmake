# The host emulator (docs/testing.md): the CUDA unit tests, on any machine, against the kernels of
# lib/kernels/cuda rewritten as C++ (rewrite_launches.py) and compiled against this folder's headers.
# One CTest entry per test file, `emulated/<file>`, label `emulated`.
find_program(MPIGPT_EMULATOR_PYTHON3 python3)
if(NOT MPIGPT_EMULATOR_PYTHON3)
  message(STATUS "mpigpt: no python3, the emulated CUDA tests are not registered")
  return()
endif()

set(EMU_SRC ${CMAKE_CURRENT_LIST_DIR})
set(EMU_GEN ${PROJECT_BINARY_DIR}/emulated)
file(GLOB emu_cu CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/lib/kernels/cuda/*.cu
     ${PROJECT_SOURCE_DIR}/lib/kernels/cuda/*.cuh)
# The PTX instructions come from the emulator's own cuda_ptx.cuh (include/lib/kernels/cuda).
list(FILTER emu_cu EXCLUDE REGEX "/cuda_ptx\\.cuh$")
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
mpigpt_cpp_sources(emu_cpu ${PROJECT_SOURCE_DIR}/lib/kernels)
add_library(mpigpt_kernels_emulated STATIC ${emu_generated} ${emu_cpu} ${EMU_SRC}/emulator.cpp
            ${EMU_SRC}/emulator_runtime.cpp ${EMU_SRC}/reference_cublaslt.cpp)
target_include_directories(mpigpt_kernels_emulated BEFORE PUBLIC ${EMU_GEN}/include ${EMU_SRC}/include)
target_include_directories(mpigpt_kernels_emulated PRIVATE ${OPENBLAS_INCLUDE_DIR})
target_compile_definitions(mpigpt_kernels_emulated PUBLIC MPIGPT_WITH_CUDA=1 MPIGPT_CUDA_ARCHS="90")
target_link_libraries(mpigpt_kernels_emulated PUBLIC mpigpt_core ${OPENBLAS_LIBRARY})
# The rewritten kernels are C++ now: the emulator's cuda_runtime.h comes first in every one, and the
# compiler ignores their #pragma unroll (and, since #line names the .cu file, takes their
# anonymous-namespace types for a header's). A vector load or store from an address the GPU would
# fault on (cudaErrorMisalignedAddress) stops the test (UBSan's alignment check, fatal).
set_source_files_properties(${emu_generated} PROPERTIES COMPILE_OPTIONS
  "-include;cuda_runtime.h;-Wno-unknown-pragmas;-Wno-subobject-linkage;-fsanitize=alignment;-fno-sanitize-recover=alignment")
target_link_options(mpigpt_kernels_emulated INTERFACE -fsanitize=alignment)

# The layers above the kernels compiled against the emulator's headers (parallel/ calls the CUDA
# runtime for device tensors), for the tests of the model, its training steps and the communication.
set(emu_layer_srcs)
foreach(dir parallel lib/model lib/optim io lib/train)
  mpigpt_cpp_sources(srcs ${PROJECT_SOURCE_DIR}/${dir})
  list(APPEND emu_layer_srcs ${srcs})
endforeach()
add_library(mpigpt_layers_emulated STATIC ${emu_layer_srcs})
target_include_directories(mpigpt_layers_emulated PUBLIC ${PROJECT_SOURCE_DIR} ${HDF5_C_INCLUDE_DIRS})
target_link_libraries(mpigpt_layers_emulated PUBLIC mpigpt_kernels_emulated MPI::MPI_C Boost::program_options
                      nlohmann_json::nlohmann_json ICU::uc ${HDF5_C_LIBRARIES} ${CMAKE_DL_LIBS})

# The GPU tests in one binary: the kernels' (lib/kernels/cuda), the model's in bf16 (lib/model/cuda),
# its training steps' (lib/train/cuda) and the communication of device tensors over staged MPI
# (parallel/cuda). Not cuDNN's graphs (they need cuDNN's library, which the emulator has not) nor
# NCCL's (it needs NCCL): those run where the real libraries are.
file(GLOB emu_tests CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/lib/kernels/cuda/*_test.cpp
     ${PROJECT_SOURCE_DIR}/lib/model/cuda/*_test.cpp ${PROJECT_SOURCE_DIR}/lib/train/cuda/*_test.cpp
     ${PROJECT_SOURCE_DIR}/parallel/cuda/*_test.cpp)
list(FILTER emu_tests EXCLUDE REGEX "/comm_nccl_test\\.cpp$")
add_executable(mpigpt_emulated_tests ${PROJECT_SOURCE_DIR}/cmake/test_main.cpp ${emu_tests})
target_link_libraries(mpigpt_emulated_tests PRIVATE mpigpt_layers_emulated doctest::doctest)
# Checks that hold for the reference cuBLASLt alone (reference_cublaslt.cpp: every epilogue for
# every consistent product), where a real one may decline.
target_compile_definitions(mpigpt_emulated_tests PRIVATE MPIGPT_EMULATED_CUBLASLT=1)
foreach(src ${emu_tests})
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${src})
  string(REGEX REPLACE "_test\\.cpp$" "" name ${rel})
  set(cmd $<TARGET_FILE:mpigpt_emulated_tests> --source-file=*${rel} --no-version=true)
  if(name MATCHES "_np([0-9]+)$")
    add_test(NAME emulated/${name} COMMAND ${MPIGPT_MPIRUN} -np ${CMAKE_MATCH_1} ${cmd})
    set_tests_properties(emulated/${name} PROPERTIES PROCESSORS 2)
  else()
    add_test(NAME emulated/${name} COMMAND ${cmd})
  endif()
  set_tests_properties(emulated/${name} PROPERTIES LABELS emulated
    ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1")
endforeach()
