#!/usr/bin/env bash
# CTest (cli/bench_gpu_search): scripts/bench_gpu.sh's search for the largest micro-batch, run with a
# stand-in for `mpigpt bench` that fits up to micro-batch 16 without recompute and 32 with full
# recompute and otherwise fails as mpigpt does when the GPU is out of memory. The stand-in's message
# is the one lib/kernels/cuda/cuda_ops.cu prints, read from the source, so that the script and the
# program cannot drift apart again (the script once looked for "out of device memory" and treated
# every real out-of-memory failure as a crash). Also: doubling up from below, halving down from
# above, MAX_MB, and that any other failure ends its search with an error, keeping the figures of
# the largest micro-batch that ran before it, while the script goes on with the next setting and
# config and exits 1. And the PyTorch comparison, with a stand-in for scripts/torch_bench.py that
# fits up to TORCH_LIMIT: the configuration it is given is the one mpigpt resolved, the ratio and
# MFU, halving both where PyTorch does not fit, and unequal FLOPs or a python without torch failing.
set -euo pipefail
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail() { echo "bench_gpu check: $*" >&2; exit 1; }

msg=$(grep -o 'out of GPU memory on device' "$SRC/lib/kernels/cuda/cuda_ops.cu" | head -1 || true)
[ -n "$msg" ] ||
  fail "cuda_ops.cu no longer prints 'out of GPU memory on device': update bench_gpu.sh's grep and this check"

cat >"$T/fake" <<FAKE
#!/usr/bin/env bash
# mpigpt bench stand-in: arguments as scripts/bench_gpu.sh passes them.
mb=0 rc=none prof=0 attn=builtin
while [ \$# -gt 0 ]; do
  case \$1 in
    --training.micro_batch) mb=\$2; shift ;;
    --engine.attention_backend) attn=\$2; shift ;;
    --engine.recompute) rc=\$2; shift ;;
    --profile-ops) prof=1 ;;
  esac
  shift
done
if [ -n "\${CRASH_AT:-}" ] && [ "\$mb" = "\$CRASH_AT" ]; then
  echo "mpigpt: error: CUDA error: an illegal memory access"
  exit 1
fi
limit=16
[ "\$rc" = full ] && limit=32
if [ "\$mb" -gt "\$limit" ]; then
  echo "mpigpt: error: $msg 0: requested 1 bytes (1 B), but only 0 bytes (0 B) of 1 GiB are free"
  exit 1
fi
printf 'mpigpt bench: 1 rank(s), resolved configuration:\n# every option\n[training]\n'
printf 'micro_batch = %s                 # sequences per micro-batch\n\n[model]\nhidden = 64\n' "\$mb"
echo "mpigpt: a warning between the configuration and the figures"
echo "bench: 1 steps after 0 warm-up: median 1.0 ms/step (min 1.0, max 1.0), \$((1000 * mb)) tok/s, 1.0 GFLOP/s model FLOPs"
echo "bench: \$((2 * mb)).0 GFLOP per step; the GPU's dense bf16 peak 989 TFLOP/s per rank puts the floor at 1 ms/step"
echo "bench: achieved 100 TFLOP/s per rank, MFU 10.0% (engine.recompute = \$rc, micro-batch \$mb, attention \$attn)"
[ \$prof = 1 ] && echo "bench: op attention_backward   1.000 ms  50.0%     12 calls"
exit 0
FAKE
chmod +x "$T/fake"
cat >"$T/python" <<'FAKE'
#!/usr/bin/env bash
# A python with torch_bench.py's stand-in: `-c "import torch"`, or SCRIPT --config FILE ...
[ "$1" = -c ] && exit "${NO_TORCH:-0}"
[ "$(basename "$1")" = torch_bench.py ] && [ "$2" = --config ] || { echo "unexpected arguments $*"; exit 1; }
mb=$(sed -n 's/^micro_batch = \([0-9]*\) .*/\1/p' "$3")
[ -n "$mb" ] && [ "$(sed -n 's/^hidden = //p' "$3")" = 64 ] || { echo "not mpigpt's configuration:"; cat "$3"; exit 1; }
if [ "$mb" -gt "${TORCH_LIMIT:-1024}" ]; then echo "torch: out of GPU memory at micro-batch $mb"; exit 3; fi
echo "torch: 1 steps after 0 warm-up: median 2.0 ms/step (min 2.0, max 2.0), $((500 * mb)) tok/s"
echo "torch: $((2 * mb + ${TORCH_EXTRA_FLOPS:-0})).0 GFLOP per step (counted from the modules built)"
FAKE
chmod +x "$T/python"

run() {  # start_micro_batch...: bench_gpu.sh's output, one config per starting micro-batch
  local start configs=()
  for start; do
    printf '[training]\nmicro_batch = %s\nglobal_batch = %s\n' "$start" "$start" >"$T/c$start.ini"
    configs+=("$T/c$start.ini")
  done
  MPIGPT="$T/fake" LOG="$T/log" STEPS=1 WARMUP=0 MAX_MB=64 PYTORCH=${PYTORCH-$T/python} \
    "$SRC/scripts/bench_gpu.sh" "${configs[@]}"
}
expect() {  # output pattern
  grep -qE "$2" <<<"$1" || { echo "$1" >&2; fail "expected a line matching '$2'"; }
}
for start in 4 64; do  # doubling up from 4, halving down from 64
  out=$(run $start) || fail "bench_gpu.sh failed from micro-batch $start: $out"
  expect "$out" "recompute none: largest micro-batch 16$"
  expect "$out" "recompute full: largest micro-batch 32$"
  expect "$out" "per-op time of one profiled step \(micro-batch 16\)"
  expect "$out" "bench: op attention_backward"
  expect "$out" "c$start.ini vs PyTorch at micro-batch 16: mpigpt 16000 tok/s \(MFU 10.0%\), PyTorch 8000 tok/s \(MFU 5.0%\), mpigpt / PyTorch 2.00x$"
  expect "$out" "^  torch: 32.0 GFLOP per step"
done
# PyTorch out of memory at mpigpt's largest micro-batch: both again at half, until it fits.
out=$(TORCH_LIMIT=4 run 4) || fail "bench_gpu.sh with PyTorch out of memory failed: $out"
expect "$out" "PyTorch out of GPU memory at micro-batch 16; both again at 8$"
expect "$out" "PyTorch out of GPU memory at micro-batch 8; both again at 4$"
expect "$out" "vs PyTorch at micro-batch 4: mpigpt 4000 tok/s \(MFU 10.0%\), PyTorch 2000 tok/s"
# Unequal FLOPs: no ratio, exit 1.
if out=$(TORCH_EXTRA_FLOPS=1 run 4 2>&1); then fail "unequal FLOPs did not fail bench_gpu.sh: $out"; fi
expect "$out" "no comparison: mpigpt 16000 tok/s at 32.0 GFLOP per step, PyTorch 8000 tok/s at 33.0"
if grep -q "vs PyTorch" <<<"$out"; then fail "a ratio at unequal FLOPs: $out"; fi
# A PYTORCH without torch fails; PYTORCH="" skips the comparison.
if out=$(NO_TORCH=1 run 4 2>&1); then fail "a PYTORCH without torch did not fail bench_gpu.sh: $out"; fi
expect "$out" "cannot import torch: no PyTorch comparison"
out=$(PYTORCH="" run 4) || fail "bench_gpu.sh with PYTORCH=\"\" failed: $out"
if grep -q "PyTorch" <<<"$out"; then fail "PYTORCH=\"\" still compared: $out"; fi
# ARGS reaches every run.
out=$(ARGS="--engine.attention_backend cudnn" run 4) || fail "bench_gpu.sh with ARGS failed: $out"
expect "$out" "micro-batch 16, attention cudnn\)"
# A failure other than memory: reported, the search keeps what ran before it, the rest runs, exit 1.
if out=$(CRASH_AT=8 run 4 2>&1); then fail "a failure other than memory did not fail bench_gpu.sh: $out"; fi
expect "$out" "micro_batch 8 recompute none failed \(not for memory\)"
expect "$out" "c4.ini recompute none: search stopped by a failure \(not for memory\) at micro-batch 8$"
expect "$out" "c4.ini recompute none: largest micro-batch that ran before the failure 4$"
expect "$out" "micro-batch 4, attention builtin\)"
expect "$out" "c4.ini recompute full: largest micro-batch that ran before the failure 4$"
expect "$out" "per-op time of one profiled step \(micro-batch 4\)"
expect "$out" "some runs failed"
# ... also at the first micro-batch tried, and the next config is still benched (halving past the crash's).
if out=$(CRASH_AT=8 run 8 32 2>&1); then fail "a failure at the first micro-batch did not fail bench_gpu.sh: $out"; fi
expect "$out" "c8.ini recompute none: search stopped by a failure \(not for memory\) at micro-batch 8$"
expect "$out" "c8.ini recompute full: search stopped by a failure \(not for memory\) at micro-batch 8$"
if grep -qE "c8.ini (recompute .*: largest|per-op)" <<<"$out"; then fail "figures for a config that never ran: $out"; fi
expect "$out" "c32.ini recompute none: largest micro-batch 16$"
expect "$out" "c32.ini recompute full: largest micro-batch 32$"
expect "$out" "c32.ini per-op time of one profiled step \(micro-batch 16\)"
echo "bench_gpu check: ok"
