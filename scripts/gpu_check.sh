#!/usr/bin/env bash
# Everything that needs a GPU, run from a bundle (make bundle) on a GPU node, each part's log in
# OUT_DIR: `unit` the gpu unit tests (every CUDA op against the CPU op, NCCL on one rank, two
# ranks sharing the GPU over staged MPI), `regression` the loss curves with CUDA compute (fp32
# layouts and 50 bf16 steps against the CPU curves, as regression/regression.cmake's gpu tests),
# `bench` scripts/bench_gpu.sh.
#
#   scripts/gpu_check.sh BUNDLE_DIR OUT_DIR [unit] [regression] [bench]     (default: all three)
#   DATA=PREFIX   the regression's dataset (PREFIX.bin/.idx, e.g. a copy of build/regression/data/
#                 fortunes: the node has no fortune files to prepare it from)
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BUNDLE_DIR OUT_DIR [unit] [regression] [bench]" >&2; exit 2; }
mkdir -p "$2"
B=$(cd "$1" && pwd) OUT=$(cd "$2" && pwd)
shift 2
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(unit regression bench)
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
status=0
step() {  # name command...: runs it, its output to OUT/name.log, and reports the exit status
  local name=$1
  shift
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "gpu_check: $name exit $rc ($((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || status=1
}
"$B/run" nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
for part in "${parts[@]}"; do
  case $part in
    unit)
      step unit "$B/run" mpigpt_tests "--source-file=*/cuda/*_test.cpp" "--source-file-exclude=*_np2_test.cpp" \
        --no-version=true
      step unit_np2 "$B/run" mpirun -np 2 --oversubscribe --bind-to none mpigpt_tests \
        "--source-file=*/cuda/*_np2_test.cpp" --no-version=true ;;
    regression)
      [ -n "${DATA:-}" ] || { echo "gpu_check: regression needs DATA=PREFIX" >&2; status=1; continue; }
      common=(--binary "$B/bin/mpigpt" --mpirun "mpirun --oversubscribe --bind-to none" --data "$DATA"
              --require-gpu --with-one-rank)
      shared="--engine.backend cuda --engine.comm mpi --engine.allow_device_sharing true"
      step regression_fp32 "$B/run" python3 "$SRC/regression/run.py" "${common[@]}" --out "$OUT/reg_fp32" \
        --layouts "^(dp2|tp2|pp2|cp2|moe-ep2)$" --families gpt2,llama,gpt2-moe,llama-moe --layout-args "$shared"
      step regression_bf16 "$B/run" python3 "$SRC/regression/run.py" "${common[@]}" --out "$OUT/reg_bf16" \
        --layouts "^(moe-ep2|tp2-dp2-distopt)$" --families gpt2,gpt2-moe,llama-moe --steps 50 --skip-reference \
        --tol 2e-2 --layout-args "$shared --training.precision bf16" ;;
    bench)
      step bench env MPIGPT="$B/run mpigpt" LOG="$OUT/bench_runs.log" "$SRC/scripts/bench_gpu.sh" \
        "$SRC"/inputs/{gpt2_124m,gpt2_350m,gpt2_1p3b,llama_1b}_gpu.ini ;;
    *) echo "gpu_check: unknown part $part (unit, regression, bench)" >&2; exit 2 ;;
  esac
done
exit $status
