#!/usr/bin/env bash
# CTest (cli/bench_gpu_search): scripts/bench_gpu.sh's search for the largest micro-batch, run with a
# stand-in for `mpigpt bench` that fits up to micro-batch 16 without recompute and 32 with full
# recompute and otherwise fails as mpigpt does when the GPU is out of memory. The stand-in's message
# is the one lib/kernels/cuda/cuda_ops.cu prints, read from the source, so that the script and the
# program cannot drift apart again (the script once looked for "out of device memory" and treated
# every real out-of-memory failure as a crash). Also: doubling up from below, halving down from
# above, MAX_MB, and that any other failure ends its search with an error, keeping the figures of
# the largest micro-batch that ran before it, while the script goes on with the next setting and
# config and exits 1.
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
echo "bench: achieved 100 TFLOP/s per rank, MFU 10.1% (engine.recompute = \$rc, micro-batch \$mb, attention \$attn)"
[ \$prof = 1 ] && echo "bench: op attention_backward   1.000 ms  50.0%     12 calls"
exit 0
FAKE
chmod +x "$T/fake"

run() {  # start_micro_batch...: bench_gpu.sh's output, one config per starting micro-batch
  local start configs=()
  for start; do
    printf '[training]\nmicro_batch = %s\nglobal_batch = %s\n' "$start" "$start" >"$T/c$start.ini"
    configs+=("$T/c$start.ini")
  done
  MPIGPT="$T/fake" LOG="$T/log" STEPS=1 WARMUP=0 MAX_MB=64 "$SRC/scripts/bench_gpu.sh" "${configs[@]}"
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
done
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
