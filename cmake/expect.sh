#!/usr/bin/env bash
# Test driver for command-line behaviour: expect.sh fail|ok REGEX -- COMMAND...
# Runs COMMAND (through bash -c when it is one string), requires the exit status (non-zero for
# "fail", zero for "ok") and that the combined output matches the extended REGEX.
set -u
mode=$1 regex=$2
shift 3
out=$(bash -c "$*" 2>&1)
rc=$?
echo "$out"
echo "[expect.sh] exit status $rc"
if [ "$mode" = fail ] && [ $rc -eq 0 ]; then echo "[expect.sh] expected a failure"; exit 1; fi
if [ "$mode" = ok ] && [ $rc -ne 0 ]; then echo "[expect.sh] expected success"; exit 1; fi
if ! grep -Eq -- "$regex" <<<"$out"; then echo "[expect.sh] output does not match: $regex"; exit 1; fi
exit 0
