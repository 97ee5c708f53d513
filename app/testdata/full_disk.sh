#!/usr/bin/env bash
# Training into a file system that fills up: runs COMMAND with a SIZE tmpfs mounted at DIR in a
# private mount namespace (needs root, as CI has; 77 = skipped where mounting is not allowed), the
# command saving to DIR/s. Ends with one line: the exit status, the errors printed, what DIR/s
# holds, what DIR/s/latest names and the disk-full message.
#   full_disk.sh SIZE DIR COMMAND...
set -u
size=$1 dir=$2
shift 2
mkdir -p "$dir"
unshare -m true 2>/dev/null || { echo "full_disk.sh: no private mount namespace here (not root?)"; exit 77; }
# shellcheck disable=SC2016
exec unshare -m bash -c '
  size=$1 dir=$2
  shift 2
  mount -t tmpfs -o "size=$size" tmpfs "$dir" || exit 77
  "$@" > "$dir/log" 2>&1
  rc=$?
  cat "$dir/log"
  echo "full disk: exit $rc, errors printed $(grep -c "^mpigpt: error" "$dir/log"), saves $(ls "$dir/s" | tr "\n" " ")," \
    "latest $(cat "$dir/s/latest" 2>/dev/null), $(grep -o "disk full writing [^(]*" "$dir/log" | head -n 1)"
  exit $rc' full_disk "$size" "$dir" "$@"
