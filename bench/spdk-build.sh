#!/bin/sh
# Build SPDK (bdevperf, nvmf_tgt, spdk_nvme_perf, rpc.py) outside the ustor
# repo, for bench/spdk.sh. Idempotent: an existing checkout is reused, a
# finished build is not redone (FORCE=1 reconfigures and rebuilds).
#
# Usage (as root: installs packages with apt-get):
#   [SPDK_SRC=<SPDK git dir or URL, default https://github.com/spdk/spdk.git>]
#   [SPDK_REF=<commit|tag>] [ISAL_SRC=<isa-l git dir or URL>]
#   [SPDK_DIR=$HOME/spdk] [JOBS=2] [NOAPT=1] [FORCE=1] [WITH="rbd vhost virtio"]
#   [STATIC=1] bench/spdk-build.sh
#
# STATIC=1 links DPDK statically (./configure --with-dpdk=/usr, Debian's
# librte_*.a), the way SPDK's own build ships its binaries; the default
# links Debian's shared DPDK (./configure --with-dpdk, via pkg-config).
# Build each in its own SPDK_DIR (e.g. SPDK_DIR=$HOME/spdk-static).
#
# WITH turns on optional SPDK parts the default build leaves out: "vhost"
# and "virtio" (bench/vhost.sh: SPDK's vhost target and bdevperf's
# virtio-user frontend), "rbd" (bench/rbd.sh: bdev_rbd; needs librbd-dev).
# Build such a tree in its own SPDK_DIR so the default one stays as measured.
#
# What it does (exactly what was done for bench/RESULTS-spdk.md):
#  1. apt-get install the -dev packages and Debian's DPDK 22.11 (libdpdk-dev).
#  2. git clone SPDK_SRC into SPDK_DIR (checkout SPDK_REF if given).
#  3. Submodules: the snapshot has none. SPDK's configure has no way to turn
#     ISA-L off on x86_64 (only --with-isal=DIR, which needs --with-shared), so
#     the isa-l submodule is cloned from ISAL_SRC at the commit SPDK pins
#     (git ls-tree HEAD isa-l). dpdk (system one used), isa-l-crypto,
#     intel-ipsec-mb, ocf, libvfio-user, xnvme are left out by configure flags.
#  4. ./configure (line below) and `nice -n 10 make -j$JOBS`.
#  5. Hugepages: 1024 x 2 MiB (bench/spdk.sh also does this).
set -eu
SPDK_SRC=${SPDK_SRC:-https://github.com/spdk/spdk.git}
ISAL_SRC=${ISAL_SRC:-https://github.com/intel/isa-l.git}
SPDK_DIR=${SPDK_DIR:-$HOME/spdk}
JOBS=${JOBS:-2}

DPDK_OPT=--with-dpdk
[ -z "${STATIC:-}" ] || DPDK_OPT=--with-dpdk=/usr
CONFIGURE="$DPDK_OPT --without-isal-crypto --without-crypto --with-uring \
 --without-vfio-user --without-xnvme --without-ocf --without-vhost --without-virtio \
 --without-fsdev --without-nvme-cuse --without-fio \
 --disable-tests --disable-unit-tests"
for w in ${WITH:-}; do
    case $w in
    rbd | vhost | virtio) ;;
    *) echo "spdk-build.sh: WITH=$w: only rbd, vhost, virtio" >&2; exit 2 ;;
    esac
    CONFIGURE=$(printf '%s' "$CONFIGURE" | sed "s/ --without-$w / /")
    CONFIGURE="$CONFIGURE --with-$w"
done

if [ -z "${NOAPT:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        build-essential pkg-config meson nasm autoconf automake libtool python3 python3-pyelftools python3-tabulate python3-yaml python3-jinja2 \
        libdpdk-dev libnuma-dev libaio-dev liburing-dev uuid-dev libssl-dev \
        libjson-c-dev libcunit1-dev libncurses-dev libkeyutils-dev >/dev/null
    case " ${WITH:-} " in *" rbd "*)
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends librbd-dev librados-dev >/dev/null ;;
    esac
fi

if [ ! -d "$SPDK_DIR/.git" ]; then
    git clone -q "$SPDK_SRC" "$SPDK_DIR"
fi
cd "$SPDK_DIR"
[ -z "${SPDK_REF:-}" ] || git checkout -q "$SPDK_REF"

isal_rev=$(git ls-tree HEAD isa-l | awk '{print $3}')
if [ ! -f isa-l/autogen.sh ]; then
    rmdir isa-l 2>/dev/null || true
    git clone -q "$ISAL_SRC" isa-l
    git -C isa-l checkout -q "$isal_rev"
fi

# SPDK master links rte_log and rte_argparse (DPDK >= 24.x); Debian's 22.11
# has neither (rte_log lives in rte_eal there). Link only the DPDK libraries
# that exist (a one-line edit of lib/env_dpdk/env.mk in the SPDK tree).
if ! grep -q 'ustor: only existing' lib/env_dpdk/env.mk; then
    sed -i 's|^DPDK_LIB_LIST_SORTED = $(sort $(DPDK_LIB_LIST))$|# ustor: only existing DPDK libs\nDPDK_LIB_LIST_SORTED = $(sort $(foreach l,$(DPDK_LIB_LIST),$(if $(wildcard $(DPDK_LIB_DIR)/lib$(l).so $(DPDK_LIB_DIR)/lib$(l).a),$(l))))|' lib/env_dpdk/env.mk
    grep -q 'ustor: only existing' lib/env_dpdk/env.mk
fi

# lib/env_dpdk/pci_dpdk.c refuses 22.11 minors > 4 ("DPDK version 22.11.11 is
# not supported", at start-up) for fear of private-ABI changes in LTS
# releases; bench/spdk.sh runs with --no-pci (no PCI device is touched), so
# accept any 22.11.x with the 22.11 table.
if ! grep -q 'ustor: any 22.11' lib/env_dpdk/pci_dpdk.c; then
    sed -i 's|^\t\tif (minor > 4) {$|\t\tif (0 \&\& minor > 4) { /* ustor: any 22.11.x */|' lib/env_dpdk/pci_dpdk.c
    grep -q 'ustor: any 22.11' lib/env_dpdk/pci_dpdk.c
fi

# Debian installs rte_build_config.h under /usr/include/<triple>/dpdk/, not
# next to rte_config.h in /usr/include/dpdk/. env.mk greps it for NUMA to add
# -lnuma to a static link: look there too (a shared link does not need it).
if ! grep -q 'ustor: multiarch' lib/env_dpdk/env.mk; then
    sed -i 's|^ifneq (,$(wildcard $(DPDK_INC_DIR)/rte_build_config.h))$|# ustor: multiarch rte_build_config.h\nDPDK_BUILD_CONFIG_H := $(firstword $(wildcard $(DPDK_INC_DIR)/rte_build_config.h $(DPDK_INC_DIR)/../$(shell $(CC) -dumpmachine)/dpdk/rte_build_config.h))\nifneq (,$(DPDK_BUILD_CONFIG_H))|; s|^ifneq (,$(shell grep -e "define RTE_LIBRTE_VHOST_NUMA 1" -e "define RTE_EAL_NUMA_AWARE_HUGEPAGES 1" $(DPDK_INC_DIR)/rte_build_config.h))$|ifneq (,$(shell grep -e "define RTE_LIBRTE_VHOST_NUMA 1" -e "define RTE_EAL_NUMA_AWARE_HUGEPAGES 1" $(DPDK_BUILD_CONFIG_H)))|' lib/env_dpdk/env.mk
    grep -q 'ustor: multiarch' lib/env_dpdk/env.mk
fi

stamp=build/.ustor-configure
if [ -n "${FORCE:-}" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$CONFIGURE" ]; then
    # shellcheck disable=SC2086
    ./configure $CONFIGURE
    mkdir -p build
    echo "$CONFIGURE" >"$stamp"
fi
# Debian's DPDK links libIPSec_MB, so configure sets CONFIG_IPSEC_MB=y and
# the top Makefile then wants to build the (absent) intel-ipsec-mb submodule;
# crypto is off, so SPDK does not need it: turn it off for make.
# genrpc.py needs tabulate/yaml/jinja2 from Debian's python3 (a pyenv python3
# first in PATH lacks them): put /usr/bin first.
PATH=/usr/bin:/bin:$PATH nice -n 10 make -j"$JOBS" CONFIG_IPSEC_MB=n >build/ustor-make.log 2>&1 || { tail -40 build/ustor-make.log; exit 1; }

mkdir -p /dev/hugepages
mountpoint -q /dev/hugepages || mount -t hugetlbfs nodev /dev/hugepages || echo "warning: no hugetlbfs mount"
if [ "$(cat /proc/sys/vm/nr_hugepages)" -lt 1024 ]; then
    echo 1024 >/proc/sys/vm/nr_hugepages 2>/dev/null || echo "warning: no hugepages (use --no-huge -s MB)"
fi

bdevperf=$SPDK_DIR/build/examples/bdevperf
[ -x "$bdevperf" ] || bdevperf=$SPDK_DIR/test/bdev/bdevperf/bdevperf
echo "SPDK $(git describe --tags 2>/dev/null || git rev-parse --short HEAD) ($(git rev-parse HEAD)), isa-l $isal_rev"
echo "configure: ./configure $CONFIGURE"
if [ -n "${STATIC:-}" ]; then
    echo "SPDK_DIR=$SPDK_DIR (DPDK linked statically)"
else
    echo "SPDK_DIR=$SPDK_DIR (shared libraries: LD_LIBRARY_PATH=$SPDK_DIR/build/lib)"
fi
echo "bdevperf=$bdevperf"
echo "nvmf_tgt=$SPDK_DIR/build/bin/nvmf_tgt"
echo "spdk_nvme_perf=$SPDK_DIR/build/bin/spdk_nvme_perf"
echo "rpc.py=$SPDK_DIR/scripts/rpc.py"
