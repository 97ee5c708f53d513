#!/usr/bin/env bash
# The one-GPU benchmark (`make bench-gpu`): for each model config and recompute setting, the
# largest micro-batch that fits (start at the config's, double while it fits, halve while it does
# not: only mpigpt's "out of GPU memory" error counts as not fitting, any other failure stops the
# script; scripts/bench_gpu_check.sh tests the search), then its tokens/s, TFLOP/s, MFU and peak
# memory, and one profiled step per model (time per op, largest first).
#
#   scripts/bench_gpu.sh [CONFIG.ini ...]      (default: inputs/*_gpu.ini)
#   MPIGPT=path/to/mpigpt  STEPS=10  WARMUP=3  RECOMPUTE="none full"  MAX_MB=1024  LOG=bench_gpu.log
#   (MAX_MB caps the doubling: the default lets memory decide, as the benchmark asks; a smaller
#   cap shortens the search, e.g. MAX_MB=64 where each command's time is limited)
#   ARGS="--engine.attention_backend auto"   (more options for every run)
set -uo pipefail
MPIGPT=${MPIGPT:-build/mpigpt}  # may be a command line, e.g. "bundle/run mpigpt"
read -ra MPIGPT_CMD <<<"$MPIGPT"
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
RECOMPUTE=${RECOMPUTE:-"none full"}
MAX_MB=${MAX_MB:-1024}
LOG=${LOG:-bench_gpu.log}
read -ra EXTRA_ARGS <<<"${ARGS:-}"
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(inputs/gpt2_124m_gpu.ini inputs/gpt2_350m_gpu.ini inputs/gpt2_1p3b_gpu.ini
                                     inputs/llama_1b_gpu.ini)
: >"$LOG"

# One bench run; its output goes to $out. Returns 0 (ran), 1 (out of GPU memory), exits otherwise.
run_bench() {  # config micro_batch recompute [extra args]
  local cfg=$1 mb=$2 rc=$3
  shift 3
  out=$("${MPIGPT_CMD[@]}" bench --config "$cfg" --training.micro_batch "$mb" --training.global_batch "$mb" \
        --engine.recompute "$rc" --bench-steps "$STEPS" --bench-warmup "$WARMUP" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} \
        "$@" 2>&1)
  local status=$?
  { echo "== $cfg micro_batch $mb recompute $rc $*"; echo "$out"; } >>"$LOG"
  [ $status -eq 0 ] && return 0
  if grep -q "out of GPU memory" <<<"$out"; then return 1; fi
  echo "bench_gpu: $cfg micro_batch $mb recompute $rc failed (not for memory):" >&2
  tail -5 <<<"$out" >&2
  exit 1
}

for cfg in "${configs[@]}"; do
  start=$(sed -n 's/^micro_batch *= *\([0-9]*\).*/\1/p' "$cfg" | head -1)
  best_none=""
  for rc in $RECOMPUTE; do
    mb=${start:-1} best="" best_out=""
    if run_bench "$cfg" "$mb" "$rc"; then
      best=$mb best_out=$out
      while [ $((mb * 2)) -le "$MAX_MB" ] && run_bench "$cfg" $((mb * 2)) "$rc"; do
        mb=$((mb * 2)) best=$mb best_out=$out
      done
    else
      while [ "$mb" -gt 1 ]; do
        mb=$((mb / 2))
        if run_bench "$cfg" "$mb" "$rc"; then best=$mb best_out=$out; break; fi
      done
    fi
    if [ -z "$best" ]; then
      echo "$cfg recompute $rc: even micro-batch 1 does not fit"
      continue
    fi
    [ "$rc" = none ] && best_none=$best
    echo "$cfg recompute $rc: largest micro-batch $best"
    grep -E "^.*bench: " <<<"$best_out" | sed 's/^/  /'
  done
  if [ -n "$best_none" ]; then  # the per-op breakdown of one step at the largest micro-batch without recompute
    run_bench "$cfg" "$best_none" none --profile-ops || true
    echo "$cfg per-op time of one profiled step (micro-batch $best_none):"
    grep -E "bench: op " <<<"$out" | sed 's/^/  /'
  fi
done
# Every run ran or did not fit (a failure otherwise exits above); the status is not the last grep's.
exit 0
