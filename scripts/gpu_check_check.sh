#!/usr/bin/env bash
# CTest (cli/gpu_check_kernel_probes): scripts/gpu_check.sh's probes of the optional attention
# kernels, run against a stand-in bundle whose `run` logs every command and plays each kernel's
# fate (WG for the warpgroup kernels, DNN for cuDNN's: ok, fault or hang) in every command that
# would run it: its unit test or cases, a setting naming it or auto, a list naming it.
# - Both pass: every setting runs as given, each probe once, the unit cases of both and of auto.
# - One or both fault or hang: each such probe is reported failed (exit 1, or 124 after
#   PROBE_TIMEOUT), the script exits non-zero, and no later command meets those kernels: settings
#   naming them alone are left out, lists and auto lose them (KERNELS, TRAIN, the bench's ARGS),
#   and their unit cases and auto's are not run.
# - A GPU of compute capability 8.0 (CC), or no cuDNN library (DNN=absent: a setting naming cudnn
#   alone fails as mpigpt does, auto and lists run without it): no failure; only the settings
#   naming those kernels alone, an error there, are left out.
set -euo pipefail
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail() { echo "gpu_check check: $*" >&2; exit 1; }

# What runs each kind of kernel, as the stand-in and the checks below read a command line.
wg_re='cuda_mma_test|--test-case=[^ ]*wgmma|attention_backend[ =](auto|([a-z]+,)*wgmma)( |,|$)'
dnn_re='cudnn_sdpa_test|--test-case=[^ ]*cudnn|attention_backend[ =](auto|([a-z]+,)*cudnn)( |,|$)'
mkdir -p "$T/bundle"
cat >"$T/bundle/run" <<FAKE
#!/usr/bin/env bash
# bundle/run stand-in: one line per command in \$CALLS, then the command's part.
ARGV="\$*"
echo "\$ARGV" >>"\$CALLS"
wg_re='$wg_re' dnn_re='$dnn_re'
cc=\${CC:-9.0}
case "\$*" in "nvidia-smi --query-gpu=compute_cap"*) echo "\$cc"; exit 0 ;; esac
fate() {
  case \$1 in
    fault) echo "mpigpt: error: CUDA error: an illegal instruction was encountered"; exit 1 ;;
    hang) exec sleep 60 ;;
    absent) if [[ " \$ARGV " =~ attention_backend[\ =]cudnn\  ]]; then
              echo "mpigpt: error: engine.attention_backend = cudnn: cannot load the cuDNN library libcudnn.so.9"
              exit 1
            fi ;;
  esac
}
if [ "\$cc" != 9.0 ]; then
  if [[ " \$* " =~ attention_backend[\ =]wgmma\  ]]; then
    echo "mpigpt: error: engine.attention_backend = wgmma needs a GPU that runs sm_90a code"
    exit 1
  fi
elif [[ "\$*" =~ \$wg_re ]]; then
  fate "\$WG"
fi
[[ "\$*" =~ \$dnn_re ]] && fate "\$DNN"
case "\$1 \${2:-}" in
  "mpigpt bench-attention"*) echo "bench-attention: forward 1.000 ms (1 TFLOP/s), backward 2.000 ms (1 TFLOP/s)" ;;
  "mpigpt bench"*) echo "bench: achieved 100 TFLOP/s per rank, MFU 10.1% (fake)" ;;
esac
exit 0
FAKE
chmod +x "$T/bundle/run"

run() {  # case WG DNN [VAR=value...] -- parts...: gpu_check.sh's output; its exit status in $T/<case>.rc
  local name=$1 wg=$2 dnn=$3
  shift 3
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  : >"$T/$name.calls"
  set +e
  env CALLS="$T/$name.calls" WG="$wg" DNN="$dnn" PROBE_TIMEOUT=3 STEP_TIMEOUT=30 MODELS=gpt2_124m STEPS=1 \
    WARMUP=0 MAX_MB=1 RECOMPUTE=none "${envs[@]}" "$SRC/scripts/gpu_check.sh" "$T/bundle" "$T/$name.out" "$@" 2>&1
  echo $? >"$T/$name.rc"
  set -e
}
expect() {  # output pattern
  grep -qE -- "$2" <<<"$1" || { echo "$1" >&2; fail "expected a line matching '$2'"; }
}
count() {  # file pattern: the lines matching
  grep -cE -- "$2" "$1" || true
}
train="builtin,wgmma,cudnn builtin auto wgmma cudnn"
kernels="builtin cudnn wgmma wgmma_wg2 auto"  # gpu_check.sh's default KERNELS

# Both probes pass: every setting runs as given, each probe once.
out=$(run ok ok ok ARGS="--engine.attention_backend auto" -- unit attention bench)
[ "$(cat "$T/ok.rc")" = 0 ] || { echo "$out" >&2; fail "gpu_check.sh failed with passing probes"; }
for k in wgmma cudnn; do
  expect "$out" "gpu_check: ${k}_probe exit 0"
  [ "$(count "$T/ok.calls" "bench-attention .*--training.micro_batch 2 .*attention_backend $k$")" = 2 ] ||
    fail "the $k probe did not run the kernels once at each of the two shapes"
done
for t in cuda_mma_test cudnn_sdpa_test; do
  [ "$(count "$T/ok.calls" $t)" = 1 ] || fail "$t ran $(count "$T/ok.calls" $t) times"
done
expect "$out" "gpu_check: unit_optional exit 0"
[ "$(count "$T/ok.calls" "test-case=[*]wgmma[*],cudnn attention[*],[*]attention auto[*] ")" = 1 ] ||
  fail "unit_optional did not run the cases of both kernels and of auto"
optional="exclude=[*]wgmma[*],cudnn attention[*],[*]attention auto[*] "
[ "$(count "$T/ok.calls" "^mpigpt_tests [^ ]*/cuda/[*]_test.cpp .*$optional")" = 1 ] ||
  fail "the unit step before the probes did not leave out the cases of the optional kernels"
for s in "attention_backend wgmma$" "attention_backend cudnn$" "attention_backend auto$" \
  "bench .*--engine.attention_backend auto"; do
  [ "$(count "$T/ok.calls" "$s")" -ge 1 ] || fail "no command matching '$s' with passing probes"
done
if grep -q "runs as" <<<"$out"; then fail "a setting changed with passing probes: $out"; fi
# MODELS (gpt2_124m in every run here) picks the bench's configs too, so that it can be split.
[ "$(count "$T/ok.calls" "^mpigpt bench --config [^ ]*/inputs/gpt2_124m_gpu.ini ")" -ge 1 ] &&
  [ "$(count "$T/ok.calls" "^mpigpt bench --config [^ ]*/inputs/(gpt2_350m|gpt2_1p3b|llama_1b)_gpu")" = 0 ] ||
  fail "the bench did not run MODELS' configs alone"

# A probe fails or hangs: the rest runs without those kernels. Cases: WG DNN, what TRAIN, the
# default KERNELS and ARGS run as, and the unit cases left.
check_failed() {  # wg dnn train_as kernels_as args_as cases
  local name=$1-$2 re first k
  t0=$SECONDS
  out=$(run "$name" "$1" "$2" ARGS="--bench-steps 1 --engine.attention_backend=builtin,wgmma,cudnn" TRAIN="$train" \
        -- unit attention bench)
  [ "$(cat "$T/$name.rc")" = 1 ] || { echo "$out" >&2; fail "WG=$1 DNN=$2: gpu_check.sh did not fail"; }
  [ $((SECONDS - t0)) -lt 25 ] || fail "WG=$1 DNN=$2 took $((SECONDS - t0)) s: a probe's timeout did not hold"
  for k in wgmma cudnn; do
    if [ $k = wgmma ]; then state=$1 re=$wg_re first=cuda_mma_test; else state=$2 re=$dnn_re first=cudnn_sdpa_test; fi
    case $state in
      ok) expect "$out" "gpu_check: ${k}_probe exit 0" ;;
      fault | hang)
        [ "$state" = hang ] && rc=124 || rc=1
        expect "$out" "gpu_check: ${k}_probe exit $rc"
        # The probe's first command is the only one that met the failed kernels.
        calls=$(grep -E -- "$re" "$T/$name.calls" || true)
        [ "$(wc -l <<<"$calls")" = 1 ] && [[ $calls == *$first* ]] ||
          fail "WG=$1 DNN=$2: commands that run $k after its probe failed: $calls" ;;
    esac
  done
  expect "$out" "'$train' runs as '$3'"
  expect "$out" "'$kernels' runs as '$4'"
  [ "$(count "$T/$name.calls" "^mpigpt bench .*--engine.attention_backend=$5( |$)")" -ge 1 ] ||
    fail "WG=$1 DNN=$2: the bench's ARGS did not run as $5"
  if [ -n "$6" ]; then
    [ "$(count "$T/$name.calls" "test-case-exclude=[*]auto[*] --test-case=$6 ")" = 1 ] ||
      fail "WG=$1 DNN=$2: unit_optional did not run the cases $6 alone"
  else
    expect "$out" "gpu_check: unit_optional not run"
  fi
}
check_failed fault ok "builtin,cudnn builtin cudnn" "builtin cudnn builtin,cudnn" "builtin,cudnn" "cudnn attention[*]"
check_failed hang ok "builtin,cudnn builtin cudnn" "builtin cudnn builtin,cudnn" "builtin,cudnn" "cudnn attention[*]"
check_failed ok fault "builtin,wgmma builtin wgmma" "builtin wgmma wgmma_wg2 builtin,wgmma" "builtin,wgmma" \
  "[*]wgmma[*]"
check_failed hang fault "builtin" "builtin" "builtin" ""

# No sm_90a (compute capability 8.0): nothing to probe for wgmma, nothing failed; auto and lists run
# as given, and the unit cases with them (they skip the warpgroup kernels themselves).
out=$(run absent hang ok CC=8.0 ARGS="--engine.attention_backend auto" TRAIN="$train" -- unit attention bench)
[ "$(cat "$T/absent.rc")" = 0 ] || { echo "$out" >&2; fail "gpu_check.sh failed on a GPU without sm_90a"; }
expect "$out" "compute capability is 8.0, not 9.0: no warpgroup"
[ "$(count "$T/absent.calls" "cuda_mma_test")" = 0 ] || fail "the wgmma probe ran on a GPU without sm_90a"
expect "$out" "gpu_check: unit_optional exit 0"
expect "$out" "'$train' runs as 'builtin,wgmma,cudnn builtin auto cudnn'"
expect "$out" "'$kernels' runs as 'builtin cudnn auto'"
[ "$(count "$T/absent.calls" "bench .*--engine.attention_backend auto$")" -ge 1 ] ||
  fail "the bench's ARGS changed on a GPU without sm_90a"

# No cuDNN library: its probe finds it absent, nothing failed; auto and lists run as given.
out=$(run nodnn ok absent ARGS="--engine.attention_backend auto" TRAIN="$train" -- unit attention bench)
[ "$(cat "$T/nodnn.rc")" = 0 ] || { echo "$out" >&2; fail "gpu_check.sh failed without cuDNN"; }
expect "$out" "gpu_check: cudnn is absent here"
expect "$out" "gpu_check: unit_optional exit 0"
expect "$out" "'$train' runs as 'builtin,wgmma,cudnn builtin auto wgmma'"
expect "$out" "'$kernels' runs as 'builtin wgmma wgmma_wg2 auto'"
[ "$(count "$T/nodnn.calls" "test-case=[*]wgmma[*],cudnn attention[*],[*]attention auto[*] ")" = 1 ] ||
  fail "unit_optional did not run every case without cuDNN"
echo "gpu_check check: ok"
