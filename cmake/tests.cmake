# The test suite: every `*_test.cpp` beside the code goes into one doctest binary (one link for
# the whole suite keeps the build short on two cores), and each file becomes its own CTest entry
# selected with doctest's --source-file filter. A file named `<name>_np<N>_test.cpp` runs under
# `mpirun -np N`; all others run as one process. Command-line tests live in app/cli_tests.cmake.
file(GLOB_RECURSE test_srcs CONFIGURE_DEPENDS
     ${PROJECT_SOURCE_DIR}/lib/*_test.cpp ${PROJECT_SOURCE_DIR}/parallel/*_test.cpp
     ${PROJECT_SOURCE_DIR}/io/*_test.cpp ${PROJECT_SOURCE_DIR}/app/*_test.cpp)
# While developing one part, `-DMPIGPT_TEST_FILTER=io/` builds only the matching test files and
# `-DMPIGPT_TEST_LIBS=mpigpt_io` links only the libraries they need.
set(MPIGPT_TEST_FILTER "" CACHE STRING "regex: only test files whose path matches")
set(MPIGPT_TEST_LIBS mpigpt_train mpigpt_plan CACHE STRING "libraries the test binary links")
if(MPIGPT_TEST_FILTER)
  list(FILTER test_srcs INCLUDE REGEX "${MPIGPT_TEST_FILTER}")
endif()
add_executable(mpigpt_tests ${PROJECT_SOURCE_DIR}/cmake/test_main.cpp ${test_srcs})
target_link_libraries(mpigpt_tests PRIVATE ${MPIGPT_TEST_LIBS} MPI::MPI_C doctest::doctest)
target_include_directories(mpigpt_tests PRIVATE ${OPENBLAS_INCLUDE_DIR})
target_compile_definitions(mpigpt_tests PRIVATE
  MPIGPT_TEST_DATA_DIR="${PROJECT_SOURCE_DIR}/inputs"
  MPIGPT_BINARY="$<TARGET_FILE:mpigpt>")
# The toolkit's stub of the CUDA driver, with which the cuDNN test plans attention on a machine
# without a driver (lib/kernels/cuda/cudnn_sdpa_test.cpp).
if(MPIGPT_HAVE_CUDA AND EXISTS ${CUDAToolkit_LIBRARY_DIR}/stubs/libcuda.so)
  target_compile_definitions(mpigpt_tests PRIVATE MPIGPT_CUDA_DRIVER_STUB="${CUDAToolkit_LIBRARY_DIR}/stubs/libcuda.so")
endif()
if(NOT MPIGPT_TEST_FILTER)
  add_dependencies(mpigpt_tests mpigpt)  # the command-line tests run the real binary
endif()

# Root may run mpirun only when it says so; more ranks than cores need --oversubscribe. The ranks
# of one node talk over shared memory only (pml ob1, btl self,vader): no rank opens a TCP port
# (cli/rank_listeners_np2; docs/user-guide.md "One machine").
set(MPIGPT_MPIRUN ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe --bind-to none
    --mca pml ob1 --mca btl self,vader --mca oob_tcp_if_include lo
    CACHE STRING "mpirun command line used by multi-rank tests")
set(MPIGPT_TEST_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1)
# MPIGPT_RUN_TIMEOUT: seconds before regression/run.py counts one training run as hung.
if(MPIGPT_SANITIZE)
  # No leak check: Open MPI's plugins leave allocations at exit and are unloaded before the check
  # runs, so their reports name no module and cannot be told from ours or suppressed.
  list(APPEND MPIGPT_TEST_ENV ASAN_OPTIONS=detect_leaks=0:strict_string_checks=1 UBSAN_OPTIONS=print_stacktrace=1)
  set(MPIGPT_RUN_TIMEOUT 600)  # instrumented code runs the emulated bf16 curve several times slower
else()
  set(MPIGPT_RUN_TIMEOUT 120)
endif()

foreach(src ${test_srcs})
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${src})
  string(REGEX REPLACE "_test\\.cpp$" "" name ${rel})
  if(name MATCHES "_np([0-9]+)$")
    set(np ${CMAKE_MATCH_1})
    add_test(NAME ${name} COMMAND ${MPIGPT_MPIRUN} -np ${np} $<TARGET_FILE:mpigpt_tests>
             --source-file=*${rel} --no-version=true)
    set_tests_properties(${name} PROPERTIES PROCESSORS 2
      ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1")
  else()
    add_test(NAME ${name} COMMAND $<TARGET_FILE:mpigpt_tests> --source-file=*${rel} --no-version=true)
    set_tests_properties(${name} PROPERTIES ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=2")
  endif()
  if(name MATCHES "/cuda/")
    set_tests_properties(${name} PROPERTIES LABELS gpu SKIP_RETURN_CODE 77)
  endif()
endforeach()

# The Debian interpreter first: matplotlib and numpy come from Debian packages (make deps), which
# a pyenv or virtualenv python3 earlier on PATH does not see. The plot and regression tests use it.
find_program(MPIGPT_PYTHON3 python3 PATHS /usr/bin NO_DEFAULT_PATH)
find_program(MPIGPT_PYTHON3 python3)
if(EXISTS ${PROJECT_SOURCE_DIR}/app/cli_tests.cmake AND NOT MPIGPT_TEST_FILTER)
  include(${PROJECT_SOURCE_DIR}/app/cli_tests.cmake)
endif()
