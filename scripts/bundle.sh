#!/usr/bin/env bash
# scripts/bundle.sh BUILD_DIR OUT_DIR [--no-tests] [--full-icu] [--xz-level N]
#
# Writes a relocatable folder that runs mpigpt on a node with the NVIDIA driver and the CUDA
# toolkit but none of our other dependencies (Open MPI, parallel HDF5, Boost, fmt, ICU,
# OpenBLAS): the binaries of BUILD_DIR, every shared library they need except the C library
# family and the CUDA libraries (found on the node), Open MPI's launcher, components, help files
# and PMIx, the INI files of inputs/, a README.txt and the `run` wrapper that sets the paths.
# `make bundle` builds BUILD_DIR for this (build-bundle: no -march=native, CUDA for sm_90);
# scripts/bundle_check.sh (a CTest entry) checks the mechanism on the test build.
#
#   --no-tests      leave out mpigpt_tests (the test binary; in by default when BUILD_DIR has it)
#   --full-icu      ship ICU's 30 MB data library instead of an empty stand-in (see below)
#   --xz-level N    xz preset for the files stored compressed (default 6; 0 is fastest)
#
# Needs, besides the build's own tools: ldd, strip, objdump, nm, cc, xz, python3, ompi_info.
set -euo pipefail

usage() { echo "usage: $0 BUILD_DIR OUT_DIR [--no-tests] [--full-icu] [--xz-level N]" >&2; exit 2; }
[ $# -ge 2 ] || usage
BUILD=$(cd "$1" && pwd) || { echo "bundle: no build folder $1" >&2; exit 1; }
OUT=$2
shift 2
WITH_TESTS=1 FULL_ICU=0 XZ_LEVEL=6
while [ $# -gt 0 ]; do
  case $1 in
    --no-tests) WITH_TESTS=0 ;;
    --full-icu) FULL_ICU=1 ;;
    --xz-level) XZ_LEVEL=${2:?}; shift ;;
    *) usage ;;
  esac
  shift
done
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
die() { echo "bundle: $*" >&2; exit 1; }

[ -x "$BUILD/mpigpt" ] || die "$BUILD/mpigpt is missing: build it first (make bundle does)"
for t in ldd strip objdump nm cc xz python3 ompi_info; do
  command -v $t >/dev/null || die "needs $t"
done

# The output folder is replaced; refuse to wipe anything that is not an earlier bundle.
if [ -e "$OUT" ]; then
  [ -f "$OUT/.mpigpt-bundle" ] || [ -z "$(ls -A "$OUT")" ] ||
    die "$OUT exists and is not a bundle; give an empty or new folder"
  rm -rf "$OUT"
fi
mkdir -p "$OUT"/{bin,lib/gcc,lib/compat,lib/openmpi,lib/pmix,lib/hwloc,share/openmpi,share/pmix,etc,inputs}
OUT=$(cd "$OUT" && pwd)
# An id for the cache folder that ./run unpacks into when the bundle is read-only.
echo "mpigpt-bundle-$(date -u +%Y%m%dT%H%M%SZ)-$$-$RANDOM" > "$OUT/.mpigpt-bundle"

# ---- where Debian's Open MPI keeps its pieces ------------------------------------------------
ompi_path() { ompi_info --parsable --path "$1" | sed -n "s/^path:$1://p" | head -1; }
OMPI_PKGLIBDIR=$(ompi_path pkglibdir)     # mca_*.so components
OMPI_PKGDATADIR=$(ompi_path pkgdatadir)   # help-*.txt
OMPI_SYSCONFDIR=$(ompi_path sysconfdir)   # openmpi-mca-params.conf, default hostfile
ORTERUN=$(readlink -f "$(command -v orterun || command -v mpirun)")
OMPI_BINDIR=$(dirname "$ORTERUN")
[ -d "$OMPI_PKGLIBDIR" ] || die "Open MPI's component folder ($OMPI_PKGLIBDIR) is missing"

# ---- ELF files of the bundle: binaries, then plugins -----------------------------------------
copy_exe() { install -m 755 "$1" "$OUT/bin/$2"; }
copy_exe "$BUILD/mpigpt" mpigpt
if [ $WITH_TESTS = 1 ] && [ -x "$BUILD/mpigpt_tests" ]; then copy_exe "$BUILD/mpigpt_tests" mpigpt_tests; fi
copy_exe "$ORTERUN" orterun
ln -s orterun "$OUT/bin/mpirun"
ln -s orterun "$OUT/bin/mpiexec"
for t in orted ompi_info; do
  f=$(readlink -f "$OMPI_BINDIR/$t"); [ -x "$f" ] || die "Open MPI's $t is missing"; copy_exe "$f" $t
done

# Components. Left out: the cluster interconnects (UCX, libfabric/OFI, InfiniBand verbs, PSM,
# and the cm PML that only drives them), which pull in large libraries a single node does not
# use (ranks there talk over shared memory, vader; GPU traffic goes through NCCL), and
# OpenSHMEM (liboshmem), which mpigpt does not use. etc/openmpi-mca-params.conf says the same.
SKIP_COMPONENTS='ucx|ofi|openib|psm|verbs|usnic|portals4|_mtl_|pml_cm|atomic_|memheap_|scoll_|spml_|sshmem_'
for f in "$OMPI_PKGLIBDIR"/mca_*.so; do
  [[ $(basename "$f") =~ $SKIP_COMPONENTS ]] && continue
  install -m 644 "$f" "$OUT/lib/openmpi/"
done
# PMIx: Debian builds Open MPI against the external libpmix, which has its own prefix; its few
# plugins go to lib/pmix, its help files to share/pmix.
PMIX_LIB=$(ldd "$OMPI_PKGLIBDIR/mca_pmix_ext3x.so" 2>/dev/null | awk '$1 ~ /^libpmix\.so/ {print $3}')
if [ -n "$PMIX_LIB" ]; then
  PMIX_LIBDIR=$(dirname "$(readlink -f "$PMIX_LIB")")
  for f in "$PMIX_LIBDIR"/pmix/*.so; do [ -e "$f" ] && install -m 644 "$f" "$OUT/lib/pmix/"; done
  for d in "$PMIX_LIBDIR/../share/pmix" /usr/share/pmix; do
    if [ -d "$d" ]; then cp -r "$d/." "$OUT/share/pmix/"; break; fi
  done
fi

# ---- the libraries they need (ldd gives the whole closure) -----------------------------------
# System: the C library family, present on every Linux. CUDA: the driver and the toolkit's
# libraries, too big to ship (cuBLASLt alone is 540 MB) and installed on GPU nodes; the run
# wrapper puts the toolkit's lib folder and NCCL's on the library path.
SYSTEM_RE='^(linux-vdso|ld-linux[-a-z0-9_]*|libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|libmvec|libBrokenLocale|libthread_db|libnss_[a-z]+)\.so'
CUDA_RE='^lib(cuda|cudart|cublas|cublasLt|cudnn[a-z_]*|nccl|nvrtc[-a-z_]*|nvJitLink|curand|cufft[a-z]*|cusparse[a-zA-Z]*|cusolver[a-zA-Z]*|nvToolsExt|nvtx3interop|cupti|nvidia-ml)\.so'
GCC_RE='^(libstdc\+\+|libgcc_s)\.so'
CUDA_HOME_BUILD=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}" 2>/dev/null || true)

mapfile -t ELVES < <(find "$OUT/bin" "$OUT/lib/openmpi" "$OUT/lib/pmix" -type f)
declare -A SEEN=()
missing=""
for f in "${ELVES[@]}"; do
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [[ $name =~ $SYSTEM_RE || $name =~ $CUDA_RE ]] && continue
    if [ "$path" = "not" ]; then missing="$missing $name(for $(basename "$f"))"; continue; fi
    [ -n "$CUDA_HOME_BUILD" ] && [[ $(readlink -f "$path") == "$CUDA_HOME_BUILD"/* ]] && continue
    [ -n "${SEEN[$name]:-}" ] && continue
    SEEN[$name]=1
    if [[ $name == libicudata.so.* ]] && [ $FULL_ICU = 0 ]; then continue; fi
    if [[ $name =~ $GCC_RE ]]; then dest=$OUT/lib/gcc; else dest=$OUT/lib; fi
    install -m 644 "$(readlink -f "$path")" "$dest/$name"
  done < <(env -u LD_LIBRARY_PATH ldd "$f")
done
[ -z "$missing" ] || die "libraries not found on this machine:$missing"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# ICU: mpigpt asks ICU only for Unicode properties (general category, White_Space), which
# libicuuc carries compiled in; its 30 MB data library (collation, locales, converters) is never
# read. A stand-in with an empty table of contents takes its place, as ICU's own "stubdata"
# library does (the bundle check runs the GPT-2 pre-tokenizer tests on it). --full-icu ships
# the real one.
icudata=$(printf '%s\n' "${!SEEN[@]}" | grep -m1 '^libicudata\.so' || true)
if [ -n "$icudata" ] && [ $FULL_ICU = 0 ]; then
  entry=$(nm -D "$OUT"/lib/libicuuc.so.* | awk '$1 == "U" && $2 ~ /^icudt[0-9]+_dat$/ {print $2}')
  [ -n "$entry" ] || die "cannot find ICU's data entry point in libicuuc"
  cat > "$TMP/icudata.c" <<EOF
/* An empty ICU common data package (what ICU's stubdata library holds). */
#include <stdint.h>
struct header {
  uint16_t header_size; uint8_t magic1, magic2;                     /* MappedData */
  uint16_t size, reserved_word; uint8_t big_endian, charset_family, sizeof_uchar, reserved_byte;
  uint8_t data_format[4], format_version[4], data_version[4];      /* UDataInfo */
  char padding[8]; uint32_t count, reserved; uint64_t toc[2];
};
__attribute__((visibility("default"))) const struct header $entry = {
  32, 0xda, 0x27, 20, 0, 0, 0, 2, 0, {0x54, 0x6f, 0x43, 0x50}, {1, 0, 0, 0}, {0, 0, 0, 0},
  {0}, 0, 0, {0, 0}};
EOF
  cc -shared -fPIC -O2 -Wl,-soname,"$icudata" -o "$OUT/lib/$icudata" "$TMP/icudata.c"
fi

# Debug symbols out, binaries and libraries alike (CUDA device code sits in a section strip keeps).
find "$OUT/bin" "$OUT/lib" -type f -exec strip --strip-unneeded {} +

# ---- glibc floor -----------------------------------------------------------------------------
# Debian 12's libevent asks for arc4random/arc4random_buf, new in glibc 2.36; everything else
# needs 2.34 at most. To run on glibc 2.34/2.35 too (Ubuntu 22.04, RHEL 9), such references are
# made unversioned (their symbol version entry points at "global", the version requirement is
# unlinked from the file's version-needs list): on glibc >= 2.36 they bind to glibc's own
# functions as before, and on an older glibc ./run preloads lib/compat, which implements them
# with getrandom(2). The GCC runtime (lib/gcc) is left as it is: on an older glibc ./run uses
# the node's libstdc++ instead.
cat > "$TMP/unversion.py" <<'PY'
"""unversion.py LIB MIN_VERSION SYMBOLS FILES...: in each ELF file, drop the requirements on the
versions >= MIN_VERSION of LIB that are used only by undefined references to SYMBOLS (comma
separated), and make those references unversioned. Prints the files changed."""
import re, struct, sys

def vkey(name):
    return tuple(int(x) for x in re.findall(r"\d+", name))

def patch(path, lib, min_version, symbols):
    d = bytearray(open(path, "rb").read())
    if d[:4] != b"\x7fELF" or d[4] != 2 or d[5] != 1:  # 64-bit little-endian only
        return False
    shoff, = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", d, 0x3a)
    secs = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    by_type = {s[1]: s for s in secs}
    dynsym, verneed, versym = by_type.get(11), by_type.get(0x6ffffffe), by_type.get(0x6fffffff)
    if not (dynsym and verneed and versym):
        return False

    def cstr(link, off):
        at = secs[link][4] + off
        return bytes(d[at:d.index(0, at)]).decode()

    users = {}  # version index -> [(symbol index, name, section index)]
    for i in range(dynsym[5] // 24):
        st_name, = struct.unpack_from("<I", d, dynsym[4] + 24 * i)
        st_shndx, = struct.unpack_from("<H", d, dynsym[4] + 24 * i + 6)
        ndx, = struct.unpack_from("<H", d, versym[4] + 2 * i)
        users.setdefault(ndx & 0x7fff, []).append((i, cstr(dynsym[6], st_name), st_shndx))

    changed = False
    off = verneed[4]
    for _ in range(verneed[7]):
        _, cnt, vn_file, vn_aux, vn_next = struct.unpack_from("<HHIII", d, off)
        if cstr(verneed[6], vn_file) == lib:
            entries, a = [], off + vn_aux
            for _ in range(cnt):
                _, _, other, vna_name, vna_next = struct.unpack_from("<IHHII", d, a)
                entries.append((a, other & 0x7fff, cstr(verneed[6], vna_name)))
                if not vna_next:
                    break
                a += vna_next
            drop = [e for e in entries
                    if vkey(e[2]) >= min_version and users.get(e[1])
                    and all(n in symbols and sh == 0 for _, n, sh in users[e[1]])]
            keep = [e for e in entries if e not in drop]
            if drop and keep:
                for e in drop:
                    for i, _, _ in users[e[1]]:
                        struct.pack_into("<H", d, versym[4] + 2 * i, 1)  # VER_NDX_GLOBAL
                struct.pack_into("<H", d, off + 2, len(keep))
                struct.pack_into("<I", d, off + 8, keep[0][0] - off)
                for (a, _, _), (b, _, _) in zip(keep, keep[1:] + [(None, 0, "")]):
                    struct.pack_into("<I", d, a + 12, b - a if b is not None else 0)
                changed = True
        if not vn_next:
            break
        off += vn_next
    if changed:
        open(path, "wb").write(d)
    return changed

lib, min_version, symbols = sys.argv[1], vkey(sys.argv[2]), set(sys.argv[3].split(","))
for path in sys.argv[4:]:
    if patch(path, lib, min_version, symbols):
        print(path)
PY
COMPAT_SYMS=arc4random,arc4random_buf,arc4random_uniform
mapfile -t patched < <(find "$OUT/bin" "$OUT/lib" -path "$OUT/lib/gcc" -prune -o -type f -print0 |
  xargs -0 python3 "$TMP/unversion.py" libc.so.6 GLIBC_2.36 "$COMPAT_SYMS")
NEED_COMPAT=0
if [ ${#patched[@]} -gt 0 ]; then
  NEED_COMPAT=2.36
  cat > "$TMP/compat.c" <<'EOF'
/* arc4random family for glibc < 2.36 (preloaded by ./run there), from getrandom(2). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/random.h>
void arc4random_buf(void *buf, size_t n) {
  unsigned char *p = buf;
  while (n > 0) {
    ssize_t r = getrandom(p, n, 0);
    if (r < 0) { if (errno == EINTR) continue; abort(); }
    p += r; n -= (size_t)r;
  }
}
uint32_t arc4random(void) { uint32_t v; arc4random_buf(&v, sizeof v); return v; }
uint32_t arc4random_uniform(uint32_t n) {
  if (n < 2) return 0;
  uint32_t r, min = -n % n;
  do r = arc4random(); while (r < min);
  return r % n;
}
EOF
  cc -shared -fPIC -O2 -s -o "$OUT/lib/compat/libmpigpt_glibc_compat.so" "$TMP/compat.c"
fi

# The newest glibc (and, for the node's libstdc++, GLIBCXX) symbol versions the bundle needs.
newest() {  # PATTERN FIND-ARGS...: the newest version matching PATTERN among the files found
  local pat=$1; shift
  find "$@" -type f -exec objdump -T {} + 2>/dev/null | grep -o "${pat}_[0-9][0-9.]*" |
    sed "s/^${pat}_//" | sort -uV | tail -1
}
NEED_CORE=$(newest GLIBC "$OUT/bin" "$OUT/lib" -path "$OUT/lib/gcc" -prune -o)
NEED_GCC=$(newest GLIBC "$OUT/lib/gcc")
NEED_GCC=${NEED_GCC:-0}
NEED_GLIBCXX=$(newest GLIBCXX "$OUT/bin" "$OUT/lib" -path "$OUT/lib/gcc" -prune -o)

# ---- files stored compressed ----------------------------------------------------------------
# Files over 1 MiB are kept as FILE.xz (OpenBLAS, with kernels for every x86 CPU, goes from 36 MB
# to 4 MB; the bundle from about 80 MB to 25 MB), and ./run unpacks them on its first start, next
# to themselves or into a cache folder when the bundle is read-only.
find "$OUT/bin" "$OUT/lib" -type f -size +1M -print0 |
  xargs -0 -r -n1 -P"$(nproc)" xz -"$XZ_LEVEL" -T1

# ---- Open MPI's data and settings ------------------------------------------------------------
for f in "$OMPI_PKGDATADIR"/help-*.txt; do
  [[ $(basename "$f") =~ openib|ofi|psm|verbs|oshmem|shmem ]] || install -m 644 "$f" "$OUT/share/openmpi/"
done
[ -d "$OMPI_PKGDATADIR/amca-param-sets" ] && cp -r "$OMPI_PKGDATADIR/amca-param-sets" "$OUT/share/openmpi/"
if [ -f "$OMPI_SYSCONFDIR/openmpi-default-hostfile" ]; then
  install -m 644 "$OMPI_SYSCONFDIR/openmpi-default-hostfile" "$OUT/etc/"
else
  echo "# default hostfile: empty (all ranks on this node)" > "$OUT/etc/openmpi-default-hostfile"
fi
cat > "$OUT/etc/openmpi-mca-params.conf" <<'EOF'
# Open MPI settings of the mpigpt bundle (read through OPAL_SYSCONFDIR, set by ../run).
# One node: ranks talk over shared memory (vader) and TCP; GPU traffic goes through NCCL.
# The cluster interconnect components (UCX, OFI, verbs, PSM) are not in the bundle.
btl = self,vader,tcp
pml = ob1
osc = ^pt2pt
btl_base_warn_component_unused = 0
EOF
cat > "$OUT/etc/pmix-mca-params.conf" <<'EOF'
# PMIx settings of the mpigpt bundle (read through PMIX_SYSCONFDIR, set by ../run). Its
# component path is set by ../run too (PMIX_MCA_mca_base_component_path): it depends on where
# the bundle lies.
EOF

cp "$SRC"/inputs/*.ini "$OUT/inputs/"
mkdir -p "$OUT/slurm" && cp "$SRC"/scripts/slurm/train.sbatch "$OUT/slurm/"

# ---- the run wrapper -------------------------------------------------------------------------
sed -e "s|@NEED_CORE@|$NEED_CORE|" -e "s|@NEED_GCC@|$NEED_GCC|" -e "s|@NEED_COMPAT@|$NEED_COMPAT|" \
  > "$OUT/run" <<'EOF'
#!/usr/bin/env bash
# mpigpt bundle: runs COMMAND with the bundle's libraries and its own Open MPI.
#   ./run mpigpt train ...              ./run mpirun -np 8 mpigpt train ...
#   ./run mpigpt_tests ...              ./run ompi_info
# It reads CUDA_HOME (default /usr/local/cuda), MPIGPT_NCCL_LIB_DIR (a folder holding
# libnccl.so.2), MPIGPT_CUDNN_LIB_DIR (a folder holding libcudnn.so.9),
# MPIGPT_BUNDLE_GCC_RUNTIME (auto | bundle | system) and MPIGPT_BUNDLE_VERBOSE=1 (print the
# library path chosen). See README.txt.
set -eu
B=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd -P)
NEED_CORE=@NEED_CORE@      # the newest glibc the bundle needs (found when it was made)
NEED_GCC=@NEED_GCC@       # ... for its libstdc++/libgcc_s (lib/gcc)
NEED_COMPAT=@NEED_COMPAT@    # below this glibc, lib/compat supplies the arc4random family
say() { [ -z "${MPIGPT_BUNDLE_VERBOSE:-}" ] || echo "run: $*" >&2; }
die() { echo "run: $*" >&2; exit 1; }

if [ $# = 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,8p' "$B/run" | sed 's/^# \{0,1\}//'
  [ $# = 0 ] && exit 2 || exit 0
fi

ver_ge() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$2" ]; }  # $1 >= $2
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}' || true)
if [ -n "$glibc" ] && ! ver_ge "$glibc" "$NEED_CORE"; then
  die "this bundle needs glibc $NEED_CORE or newer; this node has $glibc"
fi

# Files stored compressed (FILE.xz) are unpacked once: beside themselves, or into a cache
# folder when the bundle is read-only.
U=$B
if [ ! -w "$B/lib" ]; then
  U=${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/mpigpt-bundle/$(cat "$B/.mpigpt-bundle")
fi
for z in "$B"/bin/*.xz "$B"/lib/*.xz "$B"/lib/*/*.xz; do
  [ -e "$z" ] || continue
  rel=${z#"$B"/}; dst=$U/${rel%.xz}
  [ -s "$dst" ] && continue
  mkdir -p "$(dirname "$dst")"
  say "unpacking $rel"
  if command -v xz >/dev/null; then xz -dc "$z" > "$dst.$$"
  elif command -v python3 >/dev/null; then
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$z" "$dst.$$"
  else die "needs xz or python3 to unpack $rel"; fi
  case $rel in bin/*) chmod 755 "$dst.$$" ;; *) chmod 644 "$dst.$$" ;; esac
  mv -f "$dst.$$" "$dst"
done

paths=()
add() { local d; for d; do [ -d "$d" ] || continue
          case " ${paths[*]-} " in *" $d "*) ;; *) paths+=("$d") ;; esac; done; }
add "$B/lib" "$U/lib"
# The GCC runtime (libstdc++, libgcc_s) of the bundle needs a newer glibc than the rest; on an
# older glibc the node's own runtime serves.
case ${MPIGPT_BUNDLE_GCC_RUNTIME:-auto} in
  bundle) add "$B/lib/gcc" "$U/lib/gcc" ;;
  system) ;;
  *) if [ -z "$glibc" ] || ver_ge "$glibc" "$NEED_GCC"; then add "$B/lib/gcc" "$U/lib/gcc"
     else say "glibc $glibc < $NEED_GCC: the node's libstdc++ serves"; fi ;;
esac
if [ -n "$glibc" ] && [ "$NEED_COMPAT" != 0 ] && ! ver_ge "$glibc" "$NEED_COMPAT"; then
  export LD_PRELOAD="$B/lib/compat/libmpigpt_glibc_compat.so${LD_PRELOAD:+:$LD_PRELOAD}"
fi
# The CUDA toolkit: cudart, cuBLAS/cuBLASLt. The driver (libcuda) is on the default path.
cuda=${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}
add "$cuda/lib64" "$cuda/lib" "$cuda"/targets/*-linux/lib
# NCCL and cuDNN (opened by mpigpt at run time): a given folder, the toolkit's, the system's, or
# the one PyTorch's pip packages install (nvidia/<name>/lib or nvidia/cu13/lib in python3's
# site-packages).
has_lib() { local d; for d in "${paths[@]}"; do [ -e "$d/$1" ] && return 0; done; return 1; }
pip_lib_dirs() {  # SONAME MODULE...: the lib folders of python3's nvidia.MODULE packages holding SONAME
  python3 - "$@" 2>/dev/null <<'PY' || true
import importlib, os, sys
so, names = sys.argv[1], sys.argv[2:]
for name in names:
    try:
        m = importlib.import_module("nvidia." + name)
    except Exception:
        continue
    dirs = list(getattr(m, "__path__", []))
    if getattr(m, "__file__", None):
        dirs.append(os.path.dirname(m.__file__))
    for d in dirs:
        if os.path.exists(os.path.join(d, "lib", so)):
            print(os.path.join(d, "lib"))
PY
}
find_lib() {  # SONAME GIVEN_DIR HOME_DIR WHY MODULE...
  local so=$1 given=$2 home=$3 why=$4 d; shift 4
  if [ -n "$given" ]; then add "$given"; return; fi
  has_lib "$so" && return
  { /sbin/ldconfig -p 2>/dev/null || true; } | grep -q "${so//./\\.} " && return
  add "${home:-/nonexistent}/lib"
  if ! has_lib "$so" && command -v python3 >/dev/null; then
    while IFS= read -r d; do add "$d"; done < <(pip_lib_dirs "$so" "$@")
  fi
  has_lib "$so" || say "no $so found ($why)"
}
find_lib libnccl.so.2 "${MPIGPT_NCCL_LIB_DIR:-}" "${NCCL_HOME:-}" \
  "set MPIGPT_NCCL_LIB_DIR; multi-GPU runs need it" nccl cu13
find_lib libcudnn.so.9 "${MPIGPT_CUDNN_LIB_DIR:-}" "${CUDNN_HOME:-}" \
  "set MPIGPT_CUDNN_LIB_DIR; without it the attention runs the builtin kernels" cudnn cu13
lp=$(IFS=:; echo "${paths[*]}")
export LD_LIBRARY_PATH="$lp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ "$U" = "$B" ] || PATH="$U/bin:$PATH"
export PATH="$B/bin:$PATH"

# Open MPI finds its components, help files and settings through these (the paths compiled
# into it, Debian's /usr/lib/x86_64-linux-gnu/openmpi/..., do not exist on the node). Debian's
# Open MPI uses the external PMIx, which has its own compiled-in prefix and variables.
export OPAL_PREFIX="$B" OPAL_EXEC_PREFIX="$B" OPAL_BINDIR="$B/bin" OPAL_SBINDIR="$B/bin" \
  OPAL_LIBEXECDIR="$B/bin" OPAL_LIBDIR="$B/lib" OPAL_PKGLIBDIR="$B/lib/openmpi" \
  OPAL_DATAROOTDIR="$B/share" OPAL_DATADIR="$B/share" OPAL_PKGDATADIR="$B/share/openmpi" \
  OPAL_SYSCONFDIR="$B/etc" OPAL_INCLUDEDIR="$B/include" OPAL_PKGINCLUDEDIR="$B/include"
export PMIX_INSTALL_PREFIX="$B" PMIX_EXEC_PREFIX="$B" PMIX_BINDIR="$B/bin" PMIX_LIBDIR="$B/lib" \
  PMIX_DATAROOTDIR="$B/share" PMIX_DATADIR="$B/share" PMIX_PKGDATADIR="$B/share/pmix" \
  PMIX_SYSCONFDIR="$B/etc" PMIX_MCA_mca_base_component_path="$B/lib/pmix"
# hwloc's plugins (PCI, OpenCL, GL discovery) are not needed and not shipped: keep the node's out.
export HWLOC_PLUGINS_PATH="$B/lib/hwloc"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MPIGPT_BUNDLE="$B"
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH${LD_PRELOAD:+ LD_PRELOAD=$LD_PRELOAD}"
exec "$@"
EOF
chmod 755 "$OUT/run"

# ---- README ----------------------------------------------------------------------------------
VERSION=$("$BUILD/mpigpt" --version 2>&1 | head -2 || true)
TESTS_LINE="  ./run mpigpt_tests --source-file='*lib/kernels/cuda/*'   (the GPU tests)"
[ -e "$OUT/bin/mpigpt_tests" ] || [ -e "$OUT/bin/mpigpt_tests.xz" ] ||
  TESTS_LINE="  (the test binary, mpigpt_tests, is not in this bundle)"
cat > "$OUT/README.txt" <<EOF
mpigpt bundle
=============

$VERSION

This folder runs mpigpt on a Linux x86-64 node that has the NVIDIA driver and the CUDA
toolkit but not Open MPI, HDF5, Boost, fmt, ICU or OpenBLAS. It can be moved or copied
anywhere; start every program through ./run, which sets the paths:

  ./run mpigpt --version
  ./run mpigpt train --config inputs/tiny.ini --data.path DATA
  ./run mpirun -np 8 mpigpt train --config CONFIG.ini --engine.backend cuda
  ./run mpigpt bench --config inputs/gpt2_124m_bench.ini
$TESTS_LINE
  ./run ompi_info                        (the bundled Open MPI)
  MPIGPT="\$PWD/run mpigpt" sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 \\
    slurm/train.sbatch --config CONFIG.ini --engine.backend cuda    (Slurm: srun starts ./run
    on every rank, which sets up the bundle there; requeued at the time limit)

What the node needs
  - glibc $NEED_CORE or newer (./run says so otherwise).
  - the CUDA toolkit's libraries (libcudart, libcublas, libcublasLt) of the major version this
    bundle was built with, in \$CUDA_HOME/lib64 (default /usr/local/cuda).
  - NCCL for multi-GPU runs: libnccl.so.2 in MPIGPT_NCCL_LIB_DIR, the toolkit's or the system's
    library folder, or from PyTorch's pip packages (nvidia/nccl/lib in python3's site-packages;
    ./run asks python3 where that is).
  - cuDNN 9 for its fused attention (the default where it loads): libcudnn.so.9 in MPIGPT_CUDNN_LIB_DIR,
    the toolkit's or the system's library folder, or PyTorch's pip package (nvidia/cudnn/lib).
  - xz or python3, to unpack the files stored compressed (*.xz) on the first ./run.

Contents
  bin/          mpigpt, mpigpt_tests, Open MPI's mpirun (= orterun), orted, ompi_info
  lib/          the libraries these need (Open MPI, PMIx, HDF5, Boost, fmt, ICU, OpenBLAS, ...);
                big ones are stored as FILE.xz and unpacked once by ./run (into
                ~/.cache/mpigpt-bundle/ when this folder is read-only)
  lib/gcc/      the GCC C++ runtime it was built with; used when the node's glibc is $NEED_GCC or
                newer, otherwise the node's libstdc++ serves (it must provide GLIBCXX_$NEED_GLIBCXX)
  lib/compat/   the arc4random functions for glibc older than 2.36 (preloaded by ./run there)
  lib/openmpi/, lib/pmix/   Open MPI's and PMIx's components
  share/, etc/  Open MPI's and PMIx's help texts and settings (etc/openmpi-mca-params.conf)
  inputs/       the example and benchmark configurations
  slurm/        train.sbatch, the Slurm job script (its header lists its settings)

Notes
  - Under ./run mpirun, "mpigpt" is this bundle's binary on every rank: bin/ comes first on
    PATH, and mpirun passes its environment (LD_LIBRARY_PATH, OPAL_PREFIX, ...) to the ranks it
    starts on its own node. For several nodes the bundle must lie at the same path on each and
    those variables must be forwarded (mpirun -x LD_LIBRARY_PATH -x OPAL_PREFIX ...).
  - This Open MPI has no cluster interconnect components (UCX, libfabric, verbs, PSM): ranks on
    a node use shared memory; GPU traffic goes over NCCL.
  - ICU's data library is an empty stand-in: mpigpt uses only the Unicode properties compiled
    into libicuuc.
  - Running as root is allowed (OMPI_ALLOW_RUN_AS_ROOT); give mpirun --oversubscribe for more
    ranks than cores.
  - MPIGPT_BUNDLE_VERBOSE=1 ./run ... prints the library path it chose.
EOF

echo "bundle: $OUT ($(du -sh "$OUT" | cut -f1); needs glibc >= $NEED_CORE)"
