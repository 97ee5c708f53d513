#!/usr/bin/env bash
# The one-GPU benchmark (`make bench-gpu`): for each model config and recompute setting, the
# largest micro-batch that fits (start at the config's, double while it fits, halve while it does
# not: only mpigpt's "out of GPU memory" error counts as not fitting; scripts/bench_gpu_check.sh
# tests the search), then its tokens/s, TFLOP/s, MFU and peak memory, and one profiled step per
# model (time per op, largest first). Any other failure ends that search: it is reported on stderr
# with the figures of the largest micro-batch that ran before it, marked as such, the script goes
# on with the next setting and config (so that one crash does not cost the rest of a time-limited
# run), and exits 1 at the end.
#
#   scripts/bench_gpu.sh [CONFIG.ini ...]      (default: inputs/*_gpu.ini)
#   MPIGPT=path/to/mpigpt  STEPS=10  WARMUP=3  RECOMPUTE="none full"  MAX_MB=1024  LOG=bench_gpu.log
#   (MAX_MB caps the doubling: the default lets memory decide, as the benchmark asks; a smaller
#   cap shortens the search, e.g. MAX_MB=64 where each command's time is limited)
#   ARGS="--engine.attention_backend builtin"   (more options for every run)
#   PYTORCH=python3   the python with torch (2.4 or newer) for the comparison; unset and without torch,
#   the comparison is skipped with a note, set and without torch, it fails ("" skips it)
set -uo pipefail
MPIGPT=${MPIGPT:-build/mpigpt}  # may be a command line, e.g. "bundle/run mpigpt"
read -ra MPIGPT_CMD <<<"$MPIGPT"
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
RECOMPUTE=${RECOMPUTE:-"none full"}
MAX_MB=${MAX_MB:-1024}
LOG=${LOG:-bench_gpu.log}
read -ra EXTRA_ARGS <<<"${ARGS:-}"
read -ra PYTORCH_CMD <<<"${PYTORCH-python3}"
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(inputs/gpt2_124m_gpu.ini inputs/gpt2_350m_gpu.ini inputs/gpt2_1p3b_gpu.ini
                                     inputs/llama_1b_gpu.ini)
: >"$LOG"

failed=0
# One bench run; its output goes to $out. Returns 0 (ran), 1 (out of GPU memory), 2 (another failure:
# reported, and the script's exit status becomes 1).
run_bench() {  # config micro_batch recompute [extra args]
  local cfg=$1 mb=$2 rc=$3
  shift 3
  out=$("${MPIGPT_CMD[@]}" bench --config "$cfg" --training.micro_batch "$mb" --training.global_batch "$mb" \
        --engine.recompute "$rc" --bench-steps "$STEPS" --bench-warmup "$WARMUP" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} \
        "$@" 2>&1)
  local status=$?
  { echo "== $cfg micro_batch $mb recompute $rc${*:+ $*}"; echo "$out"; } >>"$LOG"
  [ $status -eq 0 ] && return 0
  if grep -q "out of GPU memory" <<<"$out"; then return 1; fi
  echo "bench_gpu: $cfg micro_batch $mb recompute $rc${*:+ $*} failed (not for memory):" >&2
  tail -5 <<<"$out" >&2
  failed=1
  return 2
}

# PyTorch's step at mpigpt's shape: the configuration mpigpt resolved (its INI lines of $out), sets
# $torch_out. Returns as run_bench (out of memory: 1).
run_torch() {  # config micro_batch
  awk '/resolved configuration:$/ {on = 1; next} /^bench: / {on = 0} on && /^(\[|#|$|[a-z_0-9]+ = )/' \
    <<<"$out" >"$TMP/resolved.ini"
  torch_out=$("${PYTORCH_CMD[@]}" "$SRC/scripts/torch_bench.py" --config "$TMP/resolved.ini" --steps "$STEPS" \
              --warmup "$WARMUP" 2>&1)
  local status=$?
  { echo "== PyTorch: $1 micro_batch $2"; echo "$torch_out"; } >>"$LOG"
  [ $status -eq 0 ] && return 0
  [ $status -eq 3 ] && return 1
  echo "bench_gpu: PyTorch at $1 micro_batch $2 failed:" >&2
  tail -5 <<<"$torch_out" >&2
  failed=1
  return 2
}
# mpigpt's figures ($out) beside PyTorch's ($torch_out): tokens/s, MFU (PyTorch's at mpigpt's FLOP
# count, which it must match) and the ratio.
compare() {  # config micro_batch
  local ours theirs mfu gflop tgflop
  ours=$(sed -n 's/^bench: .* steps after .*, \([0-9.]*\) tok\/s.*/\1/p' <<<"$out")
  mfu=$(sed -n 's/^bench: achieved .* MFU \([0-9.]*\)%.*/\1/p' <<<"$out")
  gflop=$(sed -n 's/^bench: \([0-9.]*\) GFLOP per step.*/\1/p' <<<"$out")
  theirs=$(sed -n 's/^torch: .* steps after .*, \([0-9.]*\) tok\/s$/\1/p' <<<"$torch_out")
  tgflop=$(sed -n 's/^torch: \([0-9.]*\) GFLOP per step.*/\1/p' <<<"$torch_out")
  if [ -z "$ours" ] || [ -z "$theirs" ] || [ "$gflop" != "$tgflop" ]; then
    echo "bench_gpu: $1 micro-batch $2: no comparison: mpigpt ${ours:-?} tok/s at ${gflop:-?} GFLOP per step," \
         "PyTorch ${theirs:-?} tok/s at ${tgflop:-?} (the FLOPs must be equal)" >&2
    failed=1
    return
  fi
  awk -v c="$1" -v mb="$2" -v a="$ours" -v b="$theirs" -v m="${mfu:-0}" 'BEGIN {
    printf "%s vs PyTorch at micro-batch %d: mpigpt %.0f tok/s (MFU %.1f%%), PyTorch %.0f tok/s (MFU %.1f%%), " \
           "mpigpt / PyTorch %.2fx\n", c, mb, a, m, b, m * b / a, a / b }'
  grep -E "^torch: " <<<"$torch_out" | sed 's/^/  /'
}
# The comparison at mpigpt's largest micro-batch without recompute ($out holds that run); halving
# both where PyTorch does not fit.
pytorch_side() {  # config micro_batch
  local cfg=$1 mb=$2
  while :; do
    run_torch "$cfg" "$mb"
    case $? in
      0) compare "$cfg" "$mb"; return ;;
      2) return ;;
    esac
    [ "$mb" -gt 1 ] || { echo "$cfg: PyTorch does not fit even micro-batch 1"; return; }
    mb=$((mb / 2))
    echo "$cfg: PyTorch out of GPU memory at micro-batch $((mb * 2)); both again at $mb"
    run_bench "$cfg" "$mb" none || return
  done
}
has_torch=0
if [ ${#PYTORCH_CMD[@]} -gt 0 ]; then
  if "${PYTORCH_CMD[@]}" -c "import torch" 2>/dev/null; then
    has_torch=1
  elif [ -n "${PYTORCH:-}" ]; then
    echo "bench_gpu: PYTORCH=$PYTORCH cannot import torch: no PyTorch comparison" >&2
    failed=1
  else
    echo "bench_gpu: python3 has no torch: no PyTorch comparison (PYTORCH=... names a python that has it)"
  fi
fi

for cfg in "${configs[@]}"; do
  start=$(sed -n 's/^micro_batch *= *\([0-9]*\).*/\1/p' "$cfg" | head -1)
  best_none=""
  for rc in $RECOMPUTE; do
    mb=${start:-1} best="" best_out="" crashed=""
    run_bench "$cfg" "$mb" "$rc"
    case $? in
      0) best=$mb best_out=$out
         while [ $((mb * 2)) -le "$MAX_MB" ]; do
           run_bench "$cfg" $((mb * 2)) "$rc"
           case $? in
             0) mb=$((mb * 2)) best=$mb best_out=$out ;;
             1) break ;;
             *) crashed=$((mb * 2)); break ;;
           esac
         done ;;
      1) while [ "$mb" -gt 1 ]; do
           mb=$((mb / 2))
           run_bench "$cfg" "$mb" "$rc"
           case $? in
             0) best=$mb best_out=$out; break ;;
             2) crashed=$mb; break ;;
           esac
         done ;;
      *) crashed=$mb ;;
    esac
    if [ -n "$crashed" ]; then
      echo "$cfg recompute $rc: search stopped by a failure (not for memory) at micro-batch $crashed"
      [ -n "$best" ] || continue
      echo "$cfg recompute $rc: largest micro-batch that ran before the failure $best"
    elif [ -z "$best" ]; then
      echo "$cfg recompute $rc: even micro-batch 1 does not fit"
      continue
    else
      echo "$cfg recompute $rc: largest micro-batch $best"
    fi
    [ "$rc" = none ] && best_none=$best
    grep -E "^bench: " <<<"$best_out" | sed 's/^/  /'
    if [ "$rc" = none ] && [ $has_torch = 1 ]; then
      out=$best_out
      pytorch_side "$cfg" "$best"
    fi
  done
  if [ -n "$best_none" ] && run_bench "$cfg" "$best_none" none --profile-ops; then
    # the per-op breakdown of one step at the largest micro-batch without recompute
    echo "$cfg per-op time of one profiled step (micro-batch $best_none):"
    grep -E "bench: op " <<<"$out" | sed 's/^/  /'
  fi
done
[ $failed = 0 ] || echo "bench_gpu: some runs failed (not for memory): stderr above, every run's output in $LOG" >&2
exit $failed
