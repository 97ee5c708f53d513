#!/usr/bin/env bash
# scripts/slurm/train.sbatch under Slurm (a private one-node cluster, scripts/slurm/local_cluster.sh):
# a 2-rank job starts its ranks with srun (PMIx), gets SIGTERM in the middle of training as before
# a time limit (scancel --signal=TERM signals the ranks, not the batch script), saves, requeues
# itself, starts again from the checkpoint and finishes. Prints the job's output, then
# "slurm requeue: ok ..." when all of that happened.
#   slurm_requeue.sh DIR BIN [mpigpt train options...]
set -u
[ $# -ge 2 ] || { echo "usage: $0 DIR BIN [train options...]" >&2; exit 2; }
dir=$1 bin=$2
shift 2
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
rm -rf "$dir" && mkdir -p "$dir"

job_test() {
  local job state i
  job=$(sbatch --parsable --ntasks=2 --output="$dir/job.out" --chdir="$dir" \
    --export=ALL,MPIGPT="$bin",SAVE="$dir/ckpt" "$src/scripts/slurm/train.sbatch" "$@" \
    --training.log_interval 1 --training.metrics_file "$dir/m.jsonl") || return 1
  for i in $(seq 600); do grep -q loss "$dir/m.jsonl" 2>/dev/null && break; sleep 0.1; done
  scancel --signal=TERM "$job"
  for i in $(seq 1200); do
    state=$(scontrol show job "$job" -o 2>/dev/null | grep -o 'JobState=[A-Z_]*')
    case $state in *=COMPLETED | *=FAILED | *=CANCELLED | *=TIMEOUT | *=NODE_FAIL | *=OUT_OF_MEMORY) break ;; esac
    sleep 0.1
  done
  cat "$dir/job.out"
  echo "job $job: $state"
  [ "$state" = JobState=COMPLETED ]
}
export -f job_test
export dir bin src
"$src/scripts/slurm/local_cluster.sh" "$dir/cluster" bash -c 'job_test "$@"' job_test "$@" > "$dir/out" 2>&1
rc=$?
cat "$dir/out"
[ $rc = 77 ] && exit 77
fail() {
  echo "slurm requeue: $*"
  tail -n 15 "$dir"/cluster/log/*.log
  exit 1
}
[ $rc = 0 ] || fail "the job did not complete (exit $rc)"
out=$dir/out
stopped=$(grep -oE "SIGTERM: stopped after iteration [0-9]+, checkpoint saved" "$out" | grep -oE "[0-9]+")
[ -n "$stopped" ] || fail "no rank stopped on SIGTERM with a checkpoint"
grep -q "train.sbatch: stopped by SIGTERM .*requeued" "$out" || fail "not requeued"
grep -qE "train.sbatch: job [0-9]+ start 1: 2 ranks on 1 node.*resuming from .*/ckpt/iter_0*$stopped$" "$out" ||
  fail "the second start did not resume from iteration $stopped"
last=$(grep -oE "^iter +[0-9]+/[0-9]+" "$out" | tail -n 1)
[[ $last =~ ^iter\ +([0-9]+)/([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[2]}" ] ||
  fail "the second start did not train to the end (last line: ${last:-none})"
echo "slurm requeue: ok (stopped after iteration $stopped, resumed from it, last line $last)"
