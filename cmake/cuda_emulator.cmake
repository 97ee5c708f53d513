# The host emulator of the CUDA backend (docs/testing.md): the kernels of lib/kernels/cuda/*.cu,
# rewritten for C++ by lib/kernels/cuda/emulator/rewrite_launches.py and compiled for the CPU
# against stand-in CUDA headers (lib/kernels/cuda/emulator/include), run the GPU tests
# (lib/kernels/cuda/*_test.cpp against the CPU backend, parallel/cuda/*_test.cpp) on any machine,
# with or without nvcc. One CTest entry per test file, `emulated/<file>`, label `emulated`; and the
# whole program on them (mpigpt_emulated), which trains the CUDA regression layouts. Not covered:
# cuBLASLt and NCCL themselves (a reference implementation and a stand-in over MPI take their
# places), and anything about speed.
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
mpigpt_cpp_sources(emu_cpu ${PROJECT_SOURCE_DIR}/lib/kernels)
add_library(mpigpt_kernels_emulated STATIC ${emu_generated} ${emu_cpu} ${EMU_SRC}/emulator.cpp
            ${EMU_SRC}/emulator_runtime.cpp ${EMU_SRC}/reference_cublaslt.cpp)
target_include_directories(mpigpt_kernels_emulated BEFORE PUBLIC ${EMU_GEN}/include ${EMU_SRC}/include)
target_include_directories(mpigpt_kernels_emulated PRIVATE ${OPENBLAS_INCLUDE_DIR})
target_compile_definitions(mpigpt_kernels_emulated PUBLIC MPIGPT_WITH_CUDA=1 MPIGPT_CUDA_ARCHS="90")
target_link_libraries(mpigpt_kernels_emulated PUBLIC mpigpt_core ${OPENBLAS_LIBRARY})
# The rewritten kernels are C++ now: the emulator's cuda_runtime.h comes first in every one, and the
# compiler ignores their #pragma unroll (and, since #line names the .cu file, takes their
# anonymous-namespace types for a header's).
# They are also checked for misaligned accesses (UBSan's alignment check, fatal): a vector load or
# store (uint4, float4, a 16-byte Pack) from an address the GPU would fault on
# (cudaErrorMisalignedAddress) stops the test here, where x86 would not mind.
set_source_files_properties(${emu_generated} PROPERTIES COMPILE_OPTIONS
  "-include;cuda_runtime.h;-Wno-unknown-pragmas;-Wno-subobject-linkage;-fsanitize=alignment;-fno-sanitize-recover=alignment")
target_link_options(mpigpt_kernels_emulated INTERFACE -fsanitize=alignment)

# The whole program on the emulated kernels: mpigpt_emulated is `mpigpt` built again with the
# layers above the kernels (parallel, model, optim, io, train, app) compiled against the
# emulator's headers, so that training with engine.backend = cuda runs on any machine. The
# regression tests below train the CUDA layouts with it, over staged MPI and over the NCCL
# stand-in.
set(emu_layer_srcs)
foreach(dir parallel lib/model lib/optim io lib/train)
  mpigpt_cpp_sources(srcs ${PROJECT_SOURCE_DIR}/${dir})
  list(APPEND emu_layer_srcs ${srcs})
endforeach()
add_library(mpigpt_layers_emulated STATIC ${emu_layer_srcs})
target_include_directories(mpigpt_layers_emulated PUBLIC ${PROJECT_SOURCE_DIR} ${HDF5_C_INCLUDE_DIRS})
target_link_libraries(mpigpt_layers_emulated PUBLIC mpigpt_kernels_emulated MPI::MPI_C Boost::program_options
                      nlohmann_json::nlohmann_json ICU::uc ${HDF5_C_LIBRARIES} ${CMAKE_DL_LIBS})
mpigpt_cpp_sources(emu_app_srcs ${PROJECT_SOURCE_DIR}/app)
add_executable(mpigpt_emulated ${emu_app_srcs})
target_link_libraries(mpigpt_emulated PRIVATE mpigpt_layers_emulated)

# The GPU tests: those of the kernels (lib/kernels/cuda), of the model in bf16 (lib/model/cuda), of
# its training steps (lib/train/cuda) and of the communication on device tensors (parallel/cuda:
# NCCL on one rank over the stand-in below, two ranks sharing a device over staged MPI), in one
# binary on the emulated layers (mpigpt_layers_emulated, after the program's sources).
file(GLOB emu_tests CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/lib/kernels/cuda/*_test.cpp
     ${PROJECT_SOURCE_DIR}/lib/model/cuda/*_test.cpp ${PROJECT_SOURCE_DIR}/lib/train/cuda/*_test.cpp
     ${PROJECT_SOURCE_DIR}/parallel/cuda/*_test.cpp)
# Not the check of cuDNN's attention graphs on the host: it needs cuDNN's library, which the
# emulated layers never load, and no device.
list(FILTER emu_tests EXCLUDE REGEX "/cudnn_sdpa_graph_test\\.cpp$")
add_executable(mpigpt_emulated_tests ${PROJECT_SOURCE_DIR}/cmake/test_main.cpp ${emu_tests})
target_link_libraries(mpigpt_emulated_tests PRIVATE mpigpt_layers_emulated doctest::doctest)
# Checks that hold for the reference cuBLASLt alone (emulator/reference_cublaslt.cpp: every epilogue
# for every consistent product), where a real one may decline.
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
    ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1;LD_LIBRARY_PATH=${EMU_GEN}/nccl")
endforeach()

# Its NCCL: libnccl.so.2 over MPI (emulator/nccl_mpi.cpp), in a folder of its own that the tests
# put first on LD_LIBRARY_PATH, where parallel/nccl_loader.cpp's dlopen finds it. It calls back
# into the program's emulator (emu::set_async_hooks), which the program therefore exports.
add_library(mpigpt_emulated_nccl SHARED ${EMU_SRC}/nccl_mpi.cpp)
target_include_directories(mpigpt_emulated_nccl PRIVATE ${EMU_SRC}/include)
target_link_libraries(mpigpt_emulated_nccl PRIVATE MPI::MPI_C)
set_target_properties(mpigpt_emulated_nccl PROPERTIES OUTPUT_NAME nccl SOVERSION 2
                      LIBRARY_OUTPUT_DIRECTORY ${EMU_GEN}/nccl)
set_target_properties(mpigpt_emulated mpigpt_emulated_tests PROPERTIES ENABLE_EXPORTS ON)
add_dependencies(mpigpt_emulated mpigpt_emulated_nccl)
add_dependencies(mpigpt_emulated_tests mpigpt_emulated_nccl)

# The CUDA loss-curve regression (regression/regression.cmake) on mpigpt_emulated, a few steps each:
#  - emulated/regression/loss_curves_cuda: fp32, one rank and tp2 / pp2 / dp2 / cp2 / ep2 with
#    engine.comm = mpi, against the CPU curves with the CPU suite's tolerance (3 steps);
#  - emulated/regression/loss_curve_cuda_bf16: GPT-2 in bf16 mixed precision against the fp32 CPU
#    curve within 2e-2 (10 steps), with one head of 64 channels, so that the bf16 tensor-core
#    attention runs in training too (the regression model's heads have 16);
#  - emulated/regression/loss_curves_cuda_bf16_moe: both MoE families in bf16 (f32 router), one
#    rank, ep2, and ep2 x expert_tp2 x tp2 with the allgather dispatcher and the distributed
#    optimizer, against the fp32 CPU curve within 2e-2 (4 steps);
#  - emulated/regression/loss_curves_nccl: fp32 over engine.comm = nccl (the stand-in), one
#    emulated device per rank, for the layouts that use every NCCL path (p2p pipelines and rings,
#    all-to-all, tp/sp/dp collectives, the distributed optimizer's overlapped buckets), 2 steps;
#    loss_curves_nccl_split: some of them with the communicators split from the world's.
if(DEFINED REGRESSION_DIR)  # tiny_hd64.ini: regression/regression.cmake
  set(emu_run ${MPIGPT_PYTHON3} ${PROJECT_SOURCE_DIR}/regression/run.py --binary $<TARGET_FILE:mpigpt_emulated>
      --data ${REGRESSION_DIR}/data/fortunes --mpirun "${REGRESSION_MPIRUN}" --with-one-rank
      --timeout ${MPIGPT_RUN_TIMEOUT})
  add_test(NAME emulated/regression/loss_curves_cuda COMMAND ${emu_run} --out ${REGRESSION_DIR}/emulated --steps 3
           --layouts "^(dp2|tp2|pp2|cp2|moe-ep2)$" --families gpt2,llama,gpt2-moe,llama-moe
           --layout-args "${REGRESSION_CUDA_ARGS}")
  add_test(NAME emulated/regression/loss_curve_cuda_bf16 COMMAND ${emu_run} --out ${REGRESSION_DIR}/emulated_bf16
           --config ${REGRESSION_DIR}/tiny_hd64.ini --steps 10 --layouts "^$" --families gpt2 --skip-reference
           --tol 2e-2 --layout-args "--engine.backend cuda --engine.comm mpi --training.precision bf16")
  add_test(NAME emulated/regression/loss_curves_cuda_bf16_moe COMMAND ${emu_run}
           --out ${REGRESSION_DIR}/emulated_bf16_moe --steps 4 --layouts "^(moe-ep2|moe-ep2-etp2-tp2-sp-allgather-distopt)$" --families gpt2-moe,llama-moe
           --skip-reference --tol 2e-2 --layout-args "${REGRESSION_CUDA_ARGS} --training.precision bf16")
  add_test(NAME emulated/regression/loss_curves_nccl COMMAND ${emu_run} --out ${REGRESSION_DIR}/emulated_nccl --steps 2
           --layouts "^(dp2|tp2|pp2-vpp2|tp2-sp|cp2|cp2-allgather|tp2-pp2-dp2-distopt-overlap|dp4-distopt-buckets|moe-ep2|moe-cp2-tp2-sp-distopt)$"
           --families gpt2,llama,gpt2-moe,llama-moe
           --layout-args "--engine.backend cuda --engine.comm nccl")
  # The same over communicators split from the world's (engine.nccl_init = split) for the layouts
  # that make every kind of group and link: 8 ranks of tp, pp and dp; interleaved pipelines and
  # the context-parallel ring (point-to-point links); expert parallelism (expert groups).
  add_test(NAME emulated/regression/loss_curves_nccl_split COMMAND ${emu_run} --out ${REGRESSION_DIR}/emulated_nccl_split
           --steps 2 --layouts "^(pp2-vpp2|cp2|tp2-pp2-dp2-distopt-overlap|moe-ep2|moe-cp2-tp2-sp-distopt)$"
           --families gpt2,gpt2-moe --layout-args "--engine.backend cuda --engine.comm nccl --engine.nccl_init split")
  set_tests_properties(emulated/regression/loss_curves_cuda emulated/regression/loss_curve_cuda_bf16
                       emulated/regression/loss_curves_cuda_bf16_moe
                       emulated/regression/loss_curves_nccl emulated/regression/loss_curves_nccl_split PROPERTIES
    FIXTURES_REQUIRED regression_data LABELS "emulated;regression" TIMEOUT 900 PROCESSORS 2
    ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1")
  # NCCL wants a device per rank: eight emulated ones, and the stand-in library first on the path.
  set_property(TEST emulated/regression/loss_curves_nccl emulated/regression/loss_curves_nccl_split APPEND
               PROPERTY ENVIRONMENT "LD_LIBRARY_PATH=${EMU_GEN}/nccl" "MPIGPT_EMULATED_DEVICES=8")
endif()

# `mpigpt bench-attention` on the emulated CUDA backend, bf16 with head dim 64: the default runs the
# builtin tensor-core kernels (the emulator has no cuDNN) and says why.
add_test(NAME emulated/bench_attention COMMAND $<TARGET_FILE:mpigpt_emulated> bench-attention --model.num_layers 1
         --model.hidden 128 --model.num_heads 2 --model.seq_len 96 --training.micro_batch 2 --training.global_batch 2
         --engine.backend cuda --training.precision bf16 --bench-steps 1 --bench-warmup 0)
set_tests_properties(emulated/bench_attention PROPERTIES
  LABELS emulated ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1"
  PASS_REGULAR_EXPRESSION "attention: the builtin kernels \\(bf16 on tensor cores.*: this mpigpt was built without cuDNN.*bench-attention: forward [0-9.]+ ms .*backward [0-9.]+ ms")

# Which GPU runs what, and a GPU too small, on emulated devices (emulator.cpp: MPIGPT_EMULATED_CC,
# MPIGPT_EMULATED_MEMORY_MIB). The emulated program carries code for sm_90, as a build for CMake's
# architecture 90 does. On two ranks:
#  - an sm_80 GPU cannot load that code: every rank stops, naming its GPU, what the binary carries
#    and the CMake setting to rebuild with;
#  - one GPU for the two ranks of the node: every rank stops, naming the counts and the launch
#    options that fit (the real cli/cuda_device_np2 meets this only on a one-GPU machine);
#  - a 64 MiB GPU: every rank stops at the first allocation that does not fit, naming the bytes
#    asked for and free and the settings that need less.
set(emu_tiny_cuda --model.num_layers 2 --model.hidden 32 --model.num_heads 2 --model.seq_len 32
    --training.micro_batch 2 --training.global_batch 4 --engine.backend cuda --engine.comm mpi --bench-steps 1
    --bench-warmup 0)
string(JOIN " " emu_tiny_cuda ${emu_tiny_cuda})
string(JOIN " " emu_mpirun ${MPIGPT_MPIRUN})
set(emu_bin $<TARGET_FILE:mpigpt_emulated>)
# emu_cli_test(name ok|fail REGEX COMMAND): cmake/expect.sh on a command of the emulated program
# (two emulated devices; a name ending in _np2 takes two processors). A regex writes a message's
# ";" as "." (CMake splits arguments at semicolons).
function(emu_cli_test name mode regex cmd)
  add_test(NAME emulated/cli/${name} COMMAND ${PROJECT_SOURCE_DIR}/cmake/expect.sh ${mode} ${regex} -- ${cmd})
  set_tests_properties(emulated/cli/${name} PROPERTIES LABELS emulated TIMEOUT 120
    ENVIRONMENT "${MPIGPT_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1;MPIGPT_EMULATED_DEVICES=2")
  if(name MATCHES "_np2$")
    set_tests_properties(emulated/cli/${name} PROPERTIES PROCESSORS 2)
  endif()
endfunction()
emu_cli_test(cuda_arch_np2 fail
  "GPU [01] \\(GPU of compute capability 8\\.0 \\(emulated\\)\\) is sm_80, but this mpigpt was built with CUDA code for sm_90 only. reconfigure with -DCMAKE_CUDA_ARCHITECTURES=80"
  "MPIGPT_EMULATED_CC=8.0 ${emu_mpirun} -np 2 ${emu_bin} bench ${emu_tiny_cuda}")
emu_cli_test(cuda_ranks_over_devices_np2 fail
  "2 ranks run on host .* but it has 1 CUDA device\\(s\\): one rank per GPU. launch at most 1 ranks per node"
  "MPIGPT_EMULATED_DEVICES=1 ${emu_mpirun} -np 2 ${emu_bin} bench ${emu_tiny_cuda}")
emu_cli_test(cuda_out_of_memory_np2 fail
  "out of GPU memory on device [01]: requested [0-9]+ bytes .*, but only [0-9]+ bytes .* of 64\\.0 MiB are free.*Lower training\\.micro_batch, or set engine\\.recompute"
  "MPIGPT_EMULATED_MEMORY_MIB=64 ${emu_mpirun} -np 2 ${emu_bin} bench ${emu_tiny_cuda}")
# Resuming a bf16 run of the CUDA backend with the distributed optimizer (fp32 masters and Adam
# moments sharded over two ranks) is exact: the gradient norms and losses of the iterations after
# the checkpoint equal those of the run that never stopped, to the last digit of the metrics file.
if(DEFINED REGRESSION_DIR)
  set(emu_resume_dir ${PROJECT_BINARY_DIR}/cli_tests/emulated_resume)
  set(emu_resume_run "${emu_mpirun} -np 2 ${emu_bin} train --model.num_layers 2 --model.hidden 64 --model.num_heads 1 --model.seq_len 64 --training.micro_batch 2 --training.global_batch 8 --training.log_interval 1 --training.lr 1e-3 --training.warmup_iters 2 --engine.backend cuda --engine.comm mpi --engine.allow_device_sharing true --training.precision bf16 --engine.distributed_optimizer true --data.path ${REGRESSION_DIR}/data/fortunes --training.train_iters 4")
  set(emu_resume_after "grep -o '\"grad_norm\":[^,]*,\"iter\":[34],\"loss\":[^,]*'")
  emu_cli_test(cuda_bf16_resume_np2 ok "^resume: iterations 3 and 4 equal$"
    "rm -rf ${emu_resume_dir} && mkdir -p ${emu_resume_dir} && cd ${emu_resume_dir} && ${emu_resume_run} --checkpoint.save a --checkpoint.save_interval 2 --training.metrics_file a.jsonl && ${emu_resume_run} --checkpoint.load a/iter_0000002 --training.metrics_file b.jsonl && ${emu_resume_after} a.jsonl > a.txt && ${emu_resume_after} b.jsonl > b.txt && cat a.txt b.txt && test $(wc -l < a.txt) = 2 && diff a.txt b.txt && echo 'resume: iterations 3 and 4 equal'")
  set_tests_properties(emulated/cli/cuda_bf16_resume_np2 PROPERTIES FIXTURES_REQUIRED regression_data)
endif()
