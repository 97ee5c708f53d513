#!/usr/bin/env bash
# A signal to a running training job, sent the ways users and batch systems send it:
#   signal_run.sh DIR SIGNAL ranks|launcher save|nosave [LAUNCHER...] -- BIN train ARGS...
# starts the job (with checkpoint.save = DIR/s when "save"), waits for its first logged step, then
# sends SIGNAL to the rank processes (as Slurm does) or to the launcher (kill, timeout, Ctrl-C:
# mpirun, or the one process itself when LAUNCHER is empty), and reports the job's log, then
# "exit STATUS, last step N, latest = NAME" (N from the metrics file: a launcher that ends the
# job stops passing on the ranks' console output).
set -u
dir=$1 sig=$2 target=$3 save=$4
shift 4
launcher=()
while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
shift
rm -rf "$dir" && mkdir -p "$dir"
extra=()
[ "$save" = save ] && extra=(--checkpoint.save "$dir/s")
"${launcher[@]}" "$@" "${extra[@]}" --training.log_interval 1 --training.metrics_file "$dir/m.jsonl" > "$dir/log" 2>&1 &
pid=$!
for _ in $(seq 600); do grep -q loss "$dir/m.jsonl" 2>/dev/null && break; sleep 0.1; done
if [ "$target" = ranks ]; then
  pkill "-$sig" -f "^$1 train.*--training.metrics_file $dir/m.jsonl\$"
else
  kill "-$sig" $pid
fi
wait $pid
rc=$?
cat "$dir/log"
last=$(grep -o '"iter":[0-9]*' "$dir/m.jsonl" | tail -n 1 | cut -d: -f2)
echo "exit $rc, last step $last, latest = $(cat "$dir/s/latest" 2>/dev/null)"
