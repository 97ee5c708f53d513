#!/usr/bin/env bash
# scripts/bundle_check.sh BUILD_DIR WORK_DIR [MAX_MIB]
#
# Checks the bundle mechanism (scripts/bundle.sh) on an existing build: makes a bundle in
# WORK_DIR, moves it elsewhere, and then, in a clean environment (env -i PATH=/usr/bin:/bin
# HOME=$HOME), requires that
#   - it is smaller than MAX_MIB (default 64) before its first start;
#   - ./run mpigpt --version works;
#   - every library of the bundle's programs and Open MPI/PMIx components resolves inside the
#     bundle, apart from the C library family and the CUDA libraries (ldd, through ./run);
#   - the bundled Open MPI reports the bundle as its prefix, component and help-file folders and
#     settings file (ompi_info), and opens its components without complaint;
#   - ./run mpirun -np 2 mpigpt bench ... runs two ranks that communicate, and every shared
#     object that mpirun and both ranks load (LD_DEBUG=files) comes from the bundle, the C
#     library family or the CUDA toolkit;
#   - the GPT-2 pre-tokenizer tests pass on the bundle's ICU (mpigpt_tests, when bundled).
# Prints "bundle check: ok" at the end and removes WORK_DIR; on a failure it says what failed and
# leaves WORK_DIR for a look. A CTest entry (app/cli_tests.cmake) runs it on the test build.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR WORK_DIR [MAX_MIB]" >&2; exit 2; }
BUILD=$1 W=$2 MAX_MIB=${3:-64}
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fail() { echo "bundle check: FAIL: $*"; exit 1; }

rm -rf "$W"
mkdir -p "$W/moved"
W=$(cd "$W" && pwd)
"$SRC/scripts/bundle.sh" "$BUILD" "$W/made" --xz-level 0
mv "$W/made" "$W/moved/bundle"
B=$W/moved/bundle
CLEAN=(env -i PATH=/usr/bin:/bin HOME="${HOME:-/tmp}")

size=$(du -sm "$B" | cut -f1)
[ "$size" -lt "$MAX_MIB" ] || fail "the bundle is $size MiB (limit $MAX_MIB)"
echo "bundle check: $size MiB"

# What may come from outside the bundle: the C library family, and the CUDA driver and toolkit.
ALLOWED='^(linux-vdso|ld-linux[-a-z0-9_]*|libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|libmvec|libcuda|libcudart|libcublas|libcublasLt|libnccl|libcudnn[a-z_]*|libnvrtc[-a-z_]*|libnvJitLink|libnvidia-ml)[.]so'

out=$("${CLEAN[@]}" "$B/run" mpigpt --version 2>&1) || fail "./run mpigpt --version: $out"
grep -Eq '^mpigpt [0-9]+\.[0-9]+' <<<"$out" || fail "./run mpigpt --version printed: $out"

# ldd through the wrapper's environment (one ./run for all files).
cd "$B"
files=(bin/mpigpt bin/orterun bin/orted bin/ompi_info lib/openmpi/*.so lib/pmix/*.so)
[ -e bin/mpigpt_tests ] && files+=(bin/mpigpt_tests)
lddout=$("${CLEAN[@]}" "$B/run" bash -c 'for f; do echo "== $f"; ldd "$f"; done' _ "${files[@]}" 2>&1) ||
  fail "ldd through ./run:"$'\n'"$lddout"
[ "$(grep -c '^== ' <<<"$lddout")" = ${#files[@]} ] && grep -q "=> $B/lib/" <<<"$lddout" ||
  fail "ldd through ./run printed:"$'\n'"$lddout"
bad=$(awk -v B="$B/" -v ok="$ALLOWED" '
  /^== / { f = $2; next }
  $2 == "=>" && $3 == "not" { if ($1 !~ ok) print f ": " $1 " not found"; next }
  $2 == "=>" && index($3, B) != 1 && $1 !~ ok { print f ": " $1 " => " $3 }' <<<"$lddout")
[ -z "$bad" ] || fail "libraries resolved outside the bundle:"$'\n'"$bad"
echo "bundle check: ldd: ${#files[@]} programs and components resolve inside the bundle"

# The bundled Open MPI knows where it lies.
info=$("${CLEAN[@]}" "$B/run" ompi_info --parsable --path all 2>&1) || fail "ompi_info --path all: $info"
for want in "path:prefix:$B" "path:pkglibdir:$B/lib/openmpi" "path:pkgdatadir:$B/share/openmpi" \
            "path:sysconfdir:$B/etc"; do
  grep -qxF "$want" <<<"$info" || fail "ompi_info --path all lacks $want:"$'\n'"$info"
done
info=$("${CLEAN[@]}" "$B/run" ompi_info --parsable --param mca base --level 9 2>&1) ||
  fail "ompi_info --param mca base: $info"
grep -qF "mca_base_component_path:value:\"$B/lib/openmpi:" <<<"$info" ||
  fail "Open MPI's component path is not the bundle's: $(grep component_path:value <<<"$info")"
grep -F "mca_base_param_files:value:" <<<"$info" | grep -qF "$B/etc/openmpi-mca-params.conf" ||
  fail "Open MPI does not read the bundle's settings file"
info=$("${CLEAN[@]}" "$B/run" ompi_info 2>"$W/ompi_info.err") || fail "ompi_info: $(cat "$W/ompi_info.err")"
[ ! -s "$W/ompi_info.err" ] || fail "ompi_info complains:"$'\n'"$(head -40 "$W/ompi_info.err")"
for c in "MCA btl: vader" "MCA pml: ob1" "MCA pmix: ext3x" "MCA io: ompio"; do
  grep -qF "$c" <<<"$info" || fail "ompi_info does not list $c"
done
echo "bundle check: ompi_info: prefix, components, help files and settings inside the bundle"

# Two ranks under the bundled mpirun; every shared object loaded by mpirun and the ranks.
mkdir -p "$W/ld"
out=$("${CLEAN[@]}" LD_DEBUG=files LD_DEBUG_OUTPUT="$W/ld/ld" OMP_NUM_THREADS=1 \
  "$B/run" mpirun --oversubscribe --bind-to none -np 2 mpigpt bench --model.num_layers 2 \
  --model.hidden 32 --model.num_heads 2 --model.seq_len 32 --model.vocab_size 256 \
  --training.micro_batch 2 --training.global_batch 4 --bench-steps 2 --bench-warmup 1 2>&1) ||
  fail "./run mpirun -np 2 mpigpt bench:"$'\n'"$out"
grep -q 'mpigpt bench: 2 rank(s)' <<<"$out" || fail "the bench did not run on 2 ranks:"$'\n'"$out"
grep -Eq 'dp_cp [1-9][0-9.]* KiB' <<<"$out" || fail "the 2 ranks did not communicate:"$'\n'"$out"
grep -q 'bench: 2 steps after 1 warm-up' <<<"$out" || fail "the bench did not finish:"$'\n'"$out"
# In each LD_DEBUG file (one per process; a process that execs continues its file), the program
# that needs a library is named on "needed by PROGRAM [0]" lines; "calling init: PATH" names
# each object loaded, dlopen()ed components included.
loaded=$(awk '
  match($0, /needed by [^ ]+ \[0\]/) { t = substr($0, RSTART + 10, RLENGTH - 14)
                                       if (t !~ /\.so/) { n = split(t, p, "/"); prog = p[n] } }
  /calling init: / && (prog == "mpirun" || prog == "mpigpt") { print prog, $NF }' "$W"/ld/ld.*)
ranks=$(grep -l 'initialize program: mpigpt' "$W"/ld/ld.* | wc -l)
[ "$ranks" = 2 ] || fail "LD_DEBUG saw $ranks mpigpt processes, not 2"
grep -q '^mpirun ' <<<"$loaded" || fail "LD_DEBUG saw no mpirun"
outside=$(awk -v B="$B/" -v ok="$ALLOWED" '{ n = split($2, p, "/") }
  index($2, B) != 1 && p[n] !~ ok' <<<"$loaded" | sort -u)
[ -z "$outside" ] || fail "objects loaded from outside the bundle:"$'\n'"$outside"
for want in lib/openmpi/mca_pml_ob1.so lib/openmpi/mca_btl_vader.so lib/pmix/ lib/libopenblas.so.0; do
  grep -qF "$B/$want" <<<"$loaded" || fail "no process loaded $B/$want"
done
echo "bundle check: mpirun -np 2: $(wc -l <<<"$loaded") objects loaded, all inside the bundle or the system/CUDA set"

if [ -e bin/mpigpt_tests ]; then
  out=$("${CLEAN[@]}" "$B/run" mpigpt_tests --source-file='*io/data/tokenizer_test.cpp' --no-version=true 2>&1) ||
    fail "the tokenizer tests fail on the bundle:"$'\n'"$out"
  grep -q 'Status: SUCCESS' <<<"$out" || fail "the tokenizer tests did not pass:"$'\n'"$out"
  echo "bundle check: mpigpt_tests io/data/tokenizer_test.cpp passes on the bundle's ICU"
fi
glibc=$(sed -n 's/^NEED_CORE=\([0-9.]*\).*/\1/p' "$B/run")
cd / && rm -rf "$W"  # kept when a check fails, for a look
echo "bundle check: ok ($size MiB; needs glibc >= $glibc)"
