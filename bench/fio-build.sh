#!/bin/sh
# Build fio with its libiscsi engine outside the ustor repo, for
# bench/iscsi.sh (FIO=...): Debian's fio is built without libiscsi, and
# libiscsi 1.19's iscsi-perf only reads, so fio is the libiscsi client that
# writes. Idempotent: a finished build is not redone (FORCE=1 rebuilds).
#
# Usage (as root: installs libiscsi-dev with apt-get):
#   [FIO_SRC=<fio git dir or URL, default https://github.com/axboe/fio.git>]
#   [FIO_REF=fio-3.42] [FIO_DIR=$HOME/fio] [JOBS=2] [NOAPT=1] [FORCE=1]
#   bench/fio-build.sh
# Then: FIO=$FIO_DIR/fio bench/iscsi.sh
set -eu
FIO_SRC=${FIO_SRC:-https://github.com/axboe/fio.git}
FIO_REF=${FIO_REF:-fio-3.42}
FIO_DIR=${FIO_DIR:-$HOME/fio}
JOBS=${JOBS:-2}

[ -n "${NOAPT:-}" ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -q libiscsi-dev >/dev/null
[ -d "$FIO_DIR/.git" ] || git clone -q "$FIO_SRC" "$FIO_DIR"
cd "$FIO_DIR"
if [ -n "${FORCE:-}" ] || ! ./fio --enghelp 2>/dev/null | grep -qx '[[:space:]]*libiscsi'; then
  git checkout -q "$FIO_REF"
  ./configure --enable-libiscsi --disable-native >configure.log
  grep -q '^iscsi engine *yes' configure.log || { echo "fio configure found no libiscsi" >&2; exit 1; }
  nice -n 10 make -j"$JOBS" >make.log
fi
./fio --enghelp | grep -qx '[[:space:]]*libiscsi' || { echo "fio has no libiscsi engine" >&2; exit 1; }
echo "$FIO_DIR/fio ($(./fio --version), libiscsi engine)"
