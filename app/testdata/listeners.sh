#!/usr/bin/env bash
# The TCP ports the ranks of an mpirun listen on once training runs: `listeners.sh LOG MPIRUN ... -np N
# BIN train ...` prints "rank listeners: N, on other than loopback: M" (the launcher's own are not counted).
set -uo pipefail
log=$1
shift
"$@" >"$log" 2>&1 &
launcher=$!
for _ in $(seq 600); do  # the first log line of a step: every rank is past MPI_Init and its setup
  grep -q "^iter " "$log" && break
  kill -0 $launcher 2>/dev/null || { echo "listeners: the run ended before its first step:"; cat "$log"; exit 1; }
  sleep 0.1
done
ranks=$(pgrep -d '|' -P $launcher)
[ -n "$ranks" ] || { echo "listeners: no rank found under the launcher (pid $launcher)"; kill $launcher; exit 1; }
lines=$(ss -ltnpH | grep -E "pid=($ranks)," || true)
kill $launcher
wait $launcher 2>/dev/null
all=$(printf '%s' "$lines" | grep -c . || true)
outside=$(printf '%s' "$lines" | awk '$4 !~ /^(127\.|\[::1\]:)/' | grep -c . || true)
[ "$outside" = 0 ] || printf '%s\n' "$lines"
echo "rank listeners: $all, on other than loopback: $outside"
