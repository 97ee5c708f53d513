#!/usr/bin/env bash
# SIGTERM to every rank of a running job, as Slurm sends it before the time limit:
#   sigterm_run.sh DIR MPIRUN... -- BIN train ARGS...
# starts the job with checkpoint.save = DIR, waits for its first logged step, signals the rank
# processes (not the launcher), and reports the job's exit status and DIR/latest.
set -u
dir=$1
shift
launcher=()
while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
shift
bin=$1
rm -rf "$dir" && mkdir -p "$dir"
"${launcher[@]}" "$@" --training.log_interval 1 --training.metrics_file "$dir/m.jsonl" --checkpoint.save "$dir" \
  > "$dir/log" 2>&1 &
pid=$!
for _ in $(seq 600); do grep -q loss "$dir/m.jsonl" 2>/dev/null && break; sleep 0.1; done
pkill -TERM -f "^$bin train.*--checkpoint.save $dir\$"
wait $pid
rc=$?
cat "$dir/log"
echo "exit $rc, latest = $(cat "$dir/latest" 2>/dev/null)"
