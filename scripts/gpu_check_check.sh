#!/usr/bin/env bash
# CTest (cli/gpu_check_steps): scripts/gpu_check.sh against a stand-in bundle whose `run` logs every
# command and fails (FAIL) or hangs (HANG) the commands matching a pattern: every part runs its
# commands, a failing or hanging step is reported and the rest still runs, and the exit status says so.
set -euo pipefail
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail() { echo "gpu_check check: $*" >&2; exit 1; }
mkdir -p "$T/bundle"
cat >"$T/bundle/run" <<'FAKE'
#!/usr/bin/env bash
echo "$*" >>"$CALLS"
if [ -n "${FAIL:-}" ] && [[ "$*" =~ $FAIL ]]; then echo "mpigpt: error: planted"; exit 1; fi
if [ -n "${HANG:-}" ] && [[ "$*" =~ $HANG ]]; then exec sleep 60; fi
case "$1 ${2:-}" in
  "mpigpt bench"*) echo "bench: 1 steps after 0 warm-up: median 1.0 ms/step (min 1.0, max 1.0), 100 tok/s, 1 GFLOP/s"
                   echo "bench: 1.0 GFLOP per step (stand-in)"
                   echo "bench: achieved 100 TFLOP/s per rank, MFU 10.1% (stand-in)" ;;
  "python3 "*/torch_bench.py) echo "torch: 1 steps after 0 warm-up: median 2.0 ms/step (min 2.0, max 2.0), 50 tok/s"
                              echo "torch: 1.0 GFLOP per step (stand-in)" ;;
  "mpirun -np"*) for a in "$@"; do [ "$prev" = --training.metrics_file ] && echo '"grad_norm":1,"iter":3,"loss":2
"grad_norm":1,"iter":4,"loss":2' >"$a"; prev=$a; done ;;
esac
exit 0
FAKE
chmod +x "$T/bundle/run"
run() {  # case [VAR=value...] -- parts...: gpu_check.sh's output; its exit status in $T/<case>.rc
  local name=$1 envs=()
  shift
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  set +e
  env CALLS="$T/$name.calls" DATA=/nowhere MODELS="gpt2_124m llama_1b" STEPS=1 WARMUP=0 MAX_MB=1 RECOMPUTE=none \
    "${envs[@]}" "$SRC/scripts/gpu_check.sh" "$T/bundle" "$T/$name.out" "$@" 2>&1
  echo $? >"$T/$name.rc"
  set -e
}
expect() { grep -qE -- "$2" <<<"$1" || { echo "$1" >&2; fail "expected a line matching '$2'"; }; }
count() { grep -cE -- "$2" "$1" || true; }

out=$(run all PYTHON="$T/bundle/run python3" -- unit regression bench attention hf)
[ "$(cat "$T/all.rc")" = 0 ] || { echo "$out" >&2; fail "gpu_check.sh failed with every command passing"; }
for s in unit unit_np2 regression_fp32 regression_bf16 resume_bf16 regression_bf16_hd64_builtin \
  regression_bf16_hd64_cudnn bench kernels_llama_1b_cudnn attention_gpt2_124m_builtin hf; do
  expect "$out" "^gpu_check: $s exit 0 "
done
[ "$(count "$T/all.calls" "^mpigpt_tests --source-file=[*]/cuda/[*]_test.cpp")" = 1 ] || fail "unit ran no gpu tests"
[ "$(count "$T/all.calls" "--checkpoint.(save|load) ")" = 2 ] || fail "the resume check did not save and resume"
[ "$(count "$T/all.calls" "^mpigpt bench --config [^ ]*/inputs/(gpt2_124m|llama_1b)_gpu.ini ")" -ge 2 ] &&
  [ "$(count "$T/all.calls" "^mpigpt bench --config [^ ]*/inputs/gpt2_(350m|1p3b)_gpu")" = 0 ] ||
  fail "the bench did not run MODELS' configs alone"
[ "$(count "$T/all.calls" "^python3 [^ ]*/scripts/torch_bench.py --config ")" = 2 ] &&
  expect "$(cat "$T/all.out/bench.log")" "llama_1b_gpu.ini vs PyTorch at micro-batch 32: .* mpigpt / PyTorch 2.00x$" ||
  fail "the bench did not compare each model with PyTorch in PYTHON"
[ "$(count "$T/all.calls" "bench-attention .*llama_1b_gpu.ini --training.micro_batch 32 .*backend cudnn$")" = 1 ] ||
  fail "attention did not time cuDNN at Llama 1B's micro-batch"
[ "$(count "$T/all.calls" "^python3 [^ ]*/scripts/hf_check.py --mpigpt [^ ]*/run mpigpt --data /nowhere ")" = 1 ] ||
  fail "hf did not run scripts/hf_check.py with PYTHON on the bundle's mpigpt and DATA"

# A failing step and a hanging one: both reported, every later step still runs, exit 1.
out=$(run bad FAIL="_np2_test" HANG="hd64.ini" STEP_TIMEOUT=2 -- unit regression)
[ "$(cat "$T/bad.rc")" = 1 ] || { echo "$out" >&2; fail "gpu_check.sh did not fail"; }
expect "$out" "^gpu_check: unit_np2 exit 1 "
expect "$out" "^gpu_check: regression_bf16_hd64_builtin exit 124 "
expect "$out" "^gpu_check: regression_bf16_hd64_cudnn exit 124 "
expect "$out" "^gpu_check: resume_bf16 exit 0 "

out=$(run nodata DATA= -- regression hf)
[ "$(cat "$T/nodata.rc")" = 1 ] || fail "regression and hf without DATA did not fail"
expect "$out" "regression needs DATA=PREFIX"
expect "$out" "hf needs DATA=PREFIX"
echo "gpu_check check: ok"
