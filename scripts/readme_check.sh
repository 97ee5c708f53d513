#!/usr/bin/env bash
# CTest (cli/readme_examples): every command of README.md's "Using it" block, as written, in a scratch
# folder: mpigpt's for two steps each, make's targets as dry runs (-n), the sbatch script's syntax.
#   scripts/readme_check.sh BUILT_MPIGPT SCRATCH_DIR      (MPIRUN: the mpirun command line to use)
set -euo pipefail
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$1 WORK=$2
MPIRUN=${MPIRUN:-mpirun --oversubscribe --bind-to none}
fail() { echo "readme check: $*" >&2; exit 1; }
rm -rf "$WORK" && mkdir -p "$WORK/build" && cd "$WORK"
ln -s "$SRC/inputs" inputs
ln -s "$BIN" build/mpigpt
# corpus.jsonl: the fortunes, one {"text": ...} line per fortune.
python3 - /usr/share/games/fortunes >corpus.jsonl <<'PY'
import json, os, sys
d = sys.argv[1]
for name in sorted(os.listdir(d)):
    p = os.path.join(d, name)
    if name.endswith(('.dat', '.u8')) or not os.path.isfile(p):
        continue
    for doc in open(p, encoding='utf-8', errors='replace').read().split('\n%\n'):
        if doc.strip():
            print(json.dumps({'text': doc}))
PY
# The block's commands: continuation lines joined, trailing comments dropped.
block=$(awk '/^## Using it/ {on = 1} on && /^```sh/ {inside = 1; next} inside && /^```/ {exit} inside' "$SRC/README.md")
[ -n "$block" ] || fail "README.md has no sh block under '## Using it'"
commands=$(sed -e ':a' -e '/\\$/N; s/\\\n//; ta' <<<"$block" | sed -e 's/  *# .*$//' -e 's/  */ /g')
n=0
while IFS= read -r cmd; do
  [ -n "$cmd" ] || continue
  n=$((n + 1))
  echo "== $cmd"
  case $cmd in
    build/mpigpt*train*--dry-run* | build/mpigpt*--help* | build/mpigpt\ prepare-data* | build/mpigpt\ plan*)
      eval "$cmd" </dev/null >out.log 2>&1 || { cat out.log; fail "failed: $cmd"; } ;;
    build/mpigpt*train* | mpirun*build/mpigpt*train*)
      cmd=${cmd/#mpirun/$MPIRUN}
      eval "$cmd --training.train_iters 2 --training.eval_interval 0 --training.log_interval 1" </dev/null >out.log 2>&1 ||
        { cat out.log; fail "failed: $cmd"; }
      grep -q "iter 2/2 " out.log || { cat out.log; fail "no second step: $cmd"; } ;;
    make\ *)
      make -n -C "$SRC" "${cmd#make }" </dev/null >/dev/null || fail "make has no target for: $cmd" ;;
    sbatch\ *)
      script=$(tr ' ' '\n' <<<"$cmd" | grep -m1 '\.sbatch$')
      bash -n "$SRC/$script" || fail "$script does not parse" ;;
    *) fail "a README command of a kind this check does not know: $cmd (teach scripts/readme_check.sh)" ;;
  esac
done <<<"$commands"
[ $n -ge 10 ] || fail "only $n commands found in README.md's block"
echo "readme check: ok ($n commands)"
