#!/usr/bin/env bash
# `make bench-plan`: the CPU measurements the planner's time model is checked against
# (lib/plan/time_model_test.cpp, docs/planner.md): this machine's profile, then each layout's step.
#
#   scripts/bench_plan_cpu.sh ["RANKS OPTIONS..." ...]   (layouts; default: the 23 below)
#   MPIGPT=build/mpigpt  MPIRUN="mpirun ..."  ROUNDS=3  STEPS=8  WARMUP=2  OUT=build/bench_plan
# The rounds go over all layouts in turn (so that the machine's drift spreads over every layout);
# each layout's figure is the median of its rounds, each round's the bench's median ms/step. Run it
# with nothing else on the machine: other jobs on the same cores make the figures meaningless.
set -euo pipefail
MPIGPT=${MPIGPT:-build/mpigpt}
MPIRUN=${MPIRUN:-mpirun}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-2}
OUT=${OUT:-build/bench_plan}
MODEL=(--config "$(dirname "$0")/../inputs/gpt2_parallel_bench.ini" --model.vocab_size 8192)
# Ranks, then options: every dimension the planner chooses (tp, sp, cp, pp, vpp, dp, micro-batch,
# recompute, distributed optimizer) at 4 and 8 ranks, global batch 16.
LAYOUTS=(
  "4" "4 --engine.distributed_optimizer true" "4 --parallel.tp 2" "4 --parallel.tp 4" "4 --parallel.pp 4"
  "4 --parallel.pp 4 --parallel.vpp 2" "4 --parallel.pp 2" "4 --parallel.tp 2 --parallel.pp 2" "4 --parallel.cp 2"
  "4 --parallel.tp 2 --parallel.sequence_parallel true" "4 --parallel.cp 4" "8" "8 --parallel.pp 2"
  "8 --parallel.tp 2 --parallel.pp 2 --engine.distributed_optimizer true" "8 --parallel.pp 8"
  "8 --parallel.tp 4 --parallel.pp 2" "4 --training.micro_batch 1" "4 --training.micro_batch 4"
  "4 --engine.recompute full" "4 --parallel.tp 2 --parallel.sequence_parallel true --engine.recompute selective"
  "4 --parallel.pp 4 --training.micro_batch 1" "8 --training.micro_batch 1 --engine.recompute full"
  "8 --parallel.pp 2 --engine.recompute selective"
)
[ $# -eq 0 ] || LAYOUTS=("$@")
mkdir -p "$OUT"
rm -f "$OUT"/layout*.ms
read -ra RUN <<<"$MPIRUN"

echo "== profile: $OUT/cpu_2core.json"
"${RUN[@]}" -np 2 -x OMP_NUM_THREADS=1 "$MPIGPT" bench "${MODEL[@]}" --bench-steps 4 --bench-warmup 1 \
  --profile-out "$OUT/cpu_2core.json" >"$OUT/profile.log"

for ((r = 0; r < ROUNDS; r++)); do
  for i in "${!LAYOUTS[@]}"; do
    set -- ${LAYOUTS[$i]}
    np=$1
    shift
    ms=$("${RUN[@]}" -np "$np" -x OMP_NUM_THREADS=1 "$MPIGPT" bench "${MODEL[@]}" --bench-steps "$STEPS" \
      --bench-warmup "$WARMUP" "$@" | sed -n 's/.*median \([0-9.]*\) ms\/step.*/\1/p')
    [ -n "$ms" ] || { echo "bench-plan: no step time from np $np $*" >&2; exit 1; }
    echo "$ms" >>"$OUT/layout$i.ms"
    echo "round $((r + 1)): np $np $*: $ms ms"
  done
done

echo "== ranks | options | median ms/step (rounds)"
for i in "${!LAYOUTS[@]}"; do
  set -- ${LAYOUTS[$i]}
  np=$1
  shift
  rounds=$(paste -sd' ' "$OUT/layout$i.ms")
  median=$(sort -g "$OUT/layout$i.ms" | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}')
  echo "bench-plan: $np | $* | $median ($rounds)"
done
