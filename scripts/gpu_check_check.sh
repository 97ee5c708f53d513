#!/usr/bin/env bash
# CTest (cli/gpu_check_wgmma_probe): scripts/gpu_check.sh's warpgroup probe, run against a stand-in
# bundle whose `run` logs every command and plays the warpgroup kernels' fate (WG=ok, fault or
# hang) in every command that would run them: the primitives' test, a wgmma or auto setting, a
# list naming wgmma, the unit cases of the warpgroup kernels. With WG=ok every setting runs as
# given and the probe runs once. With a fault or a hang the probe is reported failed (exit 1, or
# 124 after PROBE_TIMEOUT), the script exits non-zero, and no later command runs the warpgroup
# kernels: wgmma and wgmma_wg2 are left out, auto becomes builtin,cudnn, lists lose wgmma (in
# KERNELS, TRAIN and the bench's ARGS), and the unit cases of the warpgroup kernels are not run.
# On a GPU of compute capability 8.0 (CC) there is no probe and no failure: only the explicit
# wgmma settings, an error there, are left out.
set -euo pipefail
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail() { echo "gpu_check check: $*" >&2; exit 1; }

mkdir -p "$T/bundle"
cat >"$T/bundle/run" <<'FAKE'
#!/usr/bin/env bash
# bundle/run stand-in: one line per command in $CALLS, then the command's part.
echo "$*" >>"$CALLS"
cc=${CC:-9.0}
case "$*" in "nvidia-smi --query-gpu=compute_cap"*) echo "$cc"; exit 0 ;; esac
if [ "$cc" != 9.0 ]; then
  if [[ " $* " =~ attention_backend[\ =]wgmma\  ]]; then
    echo "mpigpt: error: engine.attention_backend = wgmma needs a GPU that runs sm_90a code"
    exit 1
  fi
elif [[ " $* " =~ cuda_mma_test|--test-case=[*]wgmma|attention_backend[\ =](auto|([a-z]+,)*wgmma)[\ ,] ]]; then
  case $WG in
    fault) echo "mpigpt: error: CUDA error: an illegal instruction was encountered"; exit 1 ;;
    hang) exec sleep 60 ;;
  esac
fi
case "$1 ${2:-}" in
  "mpigpt bench-attention"*) echo "bench-attention: forward 1.000 ms (1 TFLOP/s), backward 2.000 ms (1 TFLOP/s)" ;;
  "mpigpt bench"*) echo "bench: achieved 100 TFLOP/s per rank, MFU 10.1% (fake)" ;;
esac
exit 0
FAKE
chmod +x "$T/bundle/run"

run() {  # case_name WG [env...] -- parts...: gpu_check.sh's output; its exit status in $T/<case>.rc
  local name=$1 wg=$2
  shift 2
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  : >"$T/$name.calls"
  set +e
  env CALLS="$T/$name.calls" WG="$wg" PROBE_TIMEOUT=3 STEP_TIMEOUT=30 MODELS=gpt2_124m STEPS=1 WARMUP=0 MAX_MB=1 \
    RECOMPUTE=none "${envs[@]}" "$SRC/scripts/gpu_check.sh" "$T/bundle" "$T/$name.out" "$@" 2>&1
  echo $? >"$T/$name.rc"
  set -e
}
expect() {  # output pattern
  grep -qE -- "$2" <<<"$1" || { echo "$1" >&2; fail "expected a line matching '$2'"; }
}
count() {  # file pattern: the lines matching
  grep -cE -- "$2" "$1" || true
}
wg_call='cuda_mma_test|--test-case=[*]wgmma|attention_backend[ =](auto|([a-z]+,)*wgmma)( |,|$)'

# The probe passes: every setting runs as given, the probe once.
out=$(run ok ok ARGS="--engine.attention_backend auto" -- unit attention bench)
[ "$(cat "$T/ok.rc")" = 0 ] || { echo "$out" >&2; fail "gpu_check.sh failed with a passing probe"; }
expect "$out" "gpu_check: wgmma_probe exit 0"
[ "$(count "$T/ok.calls" cuda_mma_test)" = 1 ] || fail "the probe ran $(count "$T/ok.calls" cuda_mma_test) times"
expect "$out" "gpu_check: unit_wgmma exit 0"
for s in "attention_backend wgmma$" "attention_backend auto$" "bench .*--engine.attention_backend auto"; do
  [ "$(count "$T/ok.calls" "$s")" -ge 1 ] || fail "no command matching '$s' with a passing probe"
done
[ "$(count "$T/ok.calls" "bench-attention .*--training.micro_batch 2 .*attention_backend wgmma")" = 2 ] ||
  fail "the probe did not run the kernels at both shapes"

# The probe fails (a fault) or hangs: the rest runs without the warpgroup kernels.
for wg in fault hang; do
  t0=$SECONDS
  out=$(run "$wg" "$wg" ARGS="--bench-steps 1 --engine.attention_backend=builtin,wgmma,cudnn" \
        TRAIN="builtin,wgmma,cudnn builtin auto wgmma" -- unit attention bench)
  [ "$(cat "$T/$wg.rc")" = 1 ] || { echo "$out" >&2; fail "WG=$wg: gpu_check.sh did not fail"; }
  rc=1
  [ $wg = hang ] && rc=124
  expect "$out" "gpu_check: wgmma_probe exit $rc"
  [ $((SECONDS - t0)) -lt 25 ] || fail "WG=$wg took $((SECONDS - t0)) s: the probe's timeout did not hold"
  expect "$out" "gpu_check: unit_wgmma not run"
  expect "$out" "'builtin,wgmma,cudnn builtin auto wgmma' runs as 'builtin,cudnn builtin'"
  expect "$out" "'builtin cudnn wgmma wgmma_wg2 auto' runs as 'builtin cudnn builtin,cudnn'"
  # The probe's first command is the only one that met the warpgroup kernels.
  wg_calls=$(grep -E -- "$wg_call" "$T/$wg.calls" || true)
  [ "$(wc -l <<<"$wg_calls")" = 1 ] && [[ $wg_calls == *cuda_mma_test* ]] ||
    fail "WG=$wg: commands that run the warpgroup kernels after the probe failed: $wg_calls"
  [ "$(count "$T/$wg.calls" "bench .*--engine.attention_backend=builtin,cudnn( |$)")" -ge 1 ] ||
    fail "WG=$wg: the bench's ARGS did not lose wgmma"
  [ "$(count "$T/$wg.calls" "bench-attention .*--engine.attention_backend builtin,cudnn$")" = 1 ] ||
    fail "WG=$wg: auto's kernels did not run as builtin,cudnn"
done

# No sm_90a (compute capability 8.0): nothing to probe, nothing failed; auto and lists run as given.
out=$(run absent hang CC=8.0 ARGS="--engine.attention_backend auto" TRAIN="builtin,wgmma,cudnn builtin auto wgmma" \
      -- unit attention bench)
[ "$(cat "$T/absent.rc")" = 0 ] || { echo "$out" >&2; fail "gpu_check.sh failed on a GPU without sm_90a"; }
expect "$out" "compute capability is 8.0, not 9.0: no warpgroup"
[ "$(count "$T/absent.calls" "cuda_mma_test")" = 0 ] || fail "the probe ran on a GPU without sm_90a"
expect "$out" "gpu_check: unit_wgmma exit 0"
expect "$out" "'builtin,wgmma,cudnn builtin auto wgmma' runs as 'builtin,wgmma,cudnn builtin auto'"
expect "$out" "'builtin cudnn wgmma wgmma_wg2 auto' runs as 'builtin cudnn auto'"
[ "$(count "$T/absent.calls" "bench .*--engine.attention_backend auto$")" -ge 1 ] ||
  fail "the bench's ARGS changed on a GPU without sm_90a"
echo "gpu_check check: ok"
