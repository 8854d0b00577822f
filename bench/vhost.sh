#!/usr/bin/env bash
# vhost-user-blk backends side by side through the same frontend: SPDK
# bdevperf's virtio-user driver (bdev_virtio_attach_controller, trtype
# user, one core FCORE) against
#   ustor  `ustor serve` (adaptive reactor: polls while busy, sleeps on
#          the kick eventfd when idle) with a null bdev,
#   ustor-poll  the same with `--poll-mode poll` (never sleeps, as SPDK),
#   ustor-alt   a second ustor binary, USTOR_ALT (adaptive), so two
#          builds alternate in one run (not in the default list),
#   spdk   SPDK's vhost target (polling reactor) with a null bdev,
#   qsd    qemu-storage-daemon's vhost-user-blk export of a null-co node
#          (not in the default list: QEMU 7.2's export answers GET_CONFIG
#          with fewer bytes than the 256 SPDK's virtio-user asks, and
#          bdevperf gives up: "get_config failed"; FRONTEND=blkio drives it),
# each backend pinned to one core (BCORE), all with SIZE_MIB of 512-byte
# blocks that touch no data. 4 KiB randread/randwrite at QDS on each
# count of QUEUES (default 1): with N queues bdevperf runs N jobs on its one
# core (a job file, one SPDK thread each, so one virtqueue each), each at
# the QD, and the point is labelled QDxN (e.g. 32x2: 64 in flight).
# DEV=scsi runs every backend as a vhost-user-scsi controller instead (the
# null bdev as target 0; bdevperf's virtio-user with dev_type scsi; qsd has
# no such export), and the output file is named vhost-scsi-<date>.txt.
#
# Every backend runs for the whole benchmark, stopped (SIGSTOP) while
# another is measured; the rounds alternate (round
# r runs every workload on every backend, backend innermost) and each
# point is a fresh bdevperf process. Per point: IOPS and mean latency as
# bdevperf reports them, and the backend's CPU (all its threads,
# /proc/PID/task/*/schedstat) over the bdevperf run, per I/O and as % of
# a core two ways: cpu%wall over bdevperf's whole wall time (start-up
# included, when an adaptive backend sleeps on its kick), cpu%io over the
# RUNTIME seconds of I/O (the CPU of start-up still counted, so a polling
# backend reads a little over 100). The summary gives medians over ROUNDS and, per round, the IOPS
# ratio of ustor to each peer and their median (the figure to trust on a
# shared machine: both sides of a ratio ran seconds apart).
# Per point the raw line also records the steal and busy/idle % of the
# backend and frontend cores (/proc/stat) and the CPUs the backend's and
# the frontend's threads ran on; the summary gives, per cell, the IOPS
# and steal of every round and the rank correlation of IOPS with steal,
# and per ustor/peer pair whether both sides rose and fell together
# across rounds (a cause outside the backends). Odd rounds run BACKENDS
# in order, even rounds reversed. On a noisy VM short alternating rounds
# (ROUNDS=9 RUNTIME=1) and the per-round ratios are the figures to use.
# Before and after every point, with every backend stopped,
# bench/lib/xcore_rtt.c times a cache line's round trip between the
# backend and frontend cores (`xrtt_ns`, `xrtt2_ns`: medians of 20000): a
# QD1 request is a few such exchanges, and on a VM the figure moves (e.g.
# ~110 ns or ~460 ns on a 2-vCPU EPYC guest) as the host moves the vCPUs
# between core complexes. The summary gives the rank correlation of IOPS
# with it per cell and, when the probes fall in two groups (slowest over
# twice the fastest), each cell's median per group (a point whose two
# probes disagree is in neither) and the ustor/peer ratio over the rounds
# where both sides met the same group (XRTT=0: no probe).
# Idle: each backend's CPU over IDLE_S seconds with no frontend, then with
# a bdevperf connected and idle (`-z`: it attaches and waits).
#
# bdevperf takes a queue for a channel of its own before the jobs', so it
# is given vq_count N + 1 (N queues carry the I/O).
#
# Needs root (hugepages for bdevperf), SPDK built with vhost and virtio
# (WITH="vhost virtio" bench/spdk-build.sh, in its own SPDK_DIR),
# qemu-storage-daemon, python3.
# Usage: sudo bench/vhost.sh
# Environment:
#   SPDK_DIR=$HOME/spdk-full   ROUNDS=6 RUNTIME=3 IDLE_S=5
#   BCORE=0 FCORE=1 NICE=-20   BACKENDS="ustor ustor-poll spdk" (qsd: see above)
#   RWS="randread randwrite"   QDS="1 32 128"   QUEUES="1 2"   SIZE_MIB=1024
#   DEV=blk|scsi
#   NOBUILD=1 USTOR=path       skip cargo build / use this ustor binary
#   USTOR_ALT=path             the binary backend ustor-alt runs (e.g. the
#                              build before a change; BACKENDS="ustor ustor-alt spdk")
#   XRTT=0                     no cross-core round-trip probe (needs cc)
#   FRONTEND=bdevperf|blkio    blkio: crates/vhost-user/examples/blkio_load.rs
#                              (libblkio's virtio-blk-vhost-user driver, one
#                              busy-polled queue) instead of bdevperf; every
#                              backend accepts it, qsd included (BLKIO_LOAD=path)
# Output: bench/results/vhost-<date>.txt (vhost-scsi-<date>.txt with
# DEV=scsi; raw lines, then the summary).
set -euo pipefail

SPDK_DIR=${SPDK_DIR:-$HOME/spdk-full}
ROUNDS=${ROUNDS:-6}
RUNTIME=${RUNTIME:-3}
IDLE_S=${IDLE_S:-5}
BCORE=${BCORE:-0}
FCORE=${FCORE:-1}
NICE=${NICE:--20}
BACKENDS=${BACKENDS:-"ustor ustor-poll spdk"}
RWS=${RWS:-"randread randwrite"}
QDS=${QDS:-"1 32 128"}
QUEUES=${QUEUES:-1}
DEV=${DEV:-blk}
case $DEV in
blk) FBDEV=V ;;
scsi) FBDEV=Vt0 ;; # bdev_virtio_scsi names a target's bdev <name>t<target>
*) echo "DEV is blk or scsi" >&2; exit 1 ;;
esac
case " ${BACKENDS:-} " in
*" qsd "*) [ "$DEV" = blk ] || { echo "qsd exports vhost-user-blk only (DEV=blk)" >&2; exit 1; } ;;
esac
SIZE_MIB=${SIZE_MIB:-1024}

cd "$(dirname "$0")/.."
. bench/lib/vhost-null.sh
root=$(pwd)
stamp=$(date +%Y%m%d-%H%M%S)
out=$root/bench/results/vhost-$stamp.txt
[ "$DEV" = blk ] || out=$root/bench/results/vhost-$DEV-$stamp.txt
mkdir -p "$root/bench/results"
die() {
    echo "vhost.sh: $*" >&2
    exit 2
}
[ "$(id -u)" -eq 0 ] || die "needs root (hugepages)"
BDEVPERF=$SPDK_DIR/build/examples/bdevperf
VHOST=$SPDK_DIR/build/bin/vhost
RPC_PY=$SPDK_DIR/scripts/rpc.py
for b in "$BDEVPERF" "$VHOST"; do
    [ -x "$b" ] || die "$b missing: WITH=\"vhost virtio\" SPDK_DIR=$SPDK_DIR bench/spdk-build.sh"
done
command -v qemu-storage-daemon >/dev/null || die "qemu-storage-daemon missing (apt-get install qemu-system-common)"
export LD_LIBRARY_PATH=$SPDK_DIR/build/lib:$SPDK_DIR/dpdk/build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mkdir -p /dev/hugepages
mountpoint -q /dev/hugepages || mount -t hugetlbfs nodev /dev/hugepages

if [ -z "${USTOR:-}" ]; then
    [ -n "${NOBUILD:-}" ] || cargo build --release -q -p ustor
    USTOR=$root/target/release/ustor
fi
[ -x "$USTOR" ] || die "no ustor binary at $USTOR"
case " $BACKENDS " in
*" ustor-alt "*) [ -x "${USTOR_ALT:-}" ] || die "backend ustor-alt needs USTOR_ALT=path" ;;
esac
FRONTEND=${FRONTEND:-bdevperf}
case $FRONTEND in
bdevperf) ;;
blkio)
    if [ -z "${BLKIO_LOAD:-}" ]; then
        [ -n "${NOBUILD:-}" ] || cargo build --release -q -p ustor-vhost --example blkio_load
        BLKIO_LOAD=$root/target/release/examples/blkio_load
    fi
    [ -x "$BLKIO_LOAD" ] || die "no blkio_load at $BLKIO_LOAD"
    [ "$QUEUES" = 1 ] || die "FRONTEND=blkio drives one queue (QUEUES=1)"
    ;;
*) die "FRONTEND is bdevperf or blkio" ;;
esac

tmp=$(mktemp -d /tmp/ustor-bench-vhost.XXXXXX)
declare -A PID SOCK
XRTT=${XRTT:-1}
if [ "$XRTT" = 1 ]; then
    cc -O2 -pthread -o "$tmp/xcore_rtt" bench/lib/xcore_rtt.c || die "cc bench/lib/xcore_rtt.c failed (XRTT=0: no probe)"
fi
cleanup() {
    # Subshells (command substitution) inherit the trap: only the script
    # itself stops the backends.
    [ "$BASHPID" = "$$" ] || return 0
    for p in "${PID[@]}"; do kill -CONT "$p" 2>/dev/null; kill "$p" 2>/dev/null || true; done
    for p in "${PID[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT
RUN=(nice -n "$NICE")
bmask=$(printf '0x%x' $((1 << BCORE)))
fmask=$(printf '0x%x' $((1 << FCORE)))
blocks=$((SIZE_MIB * 2048))

wait_sock() { # path
    for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done
    die "no socket $1"
}

start_ustor() { # [name] [poll mode] [binary]
    local n=${1:-ustor} mode=${2:-adaptive} bin=${3:-$USTOR}
    mkdir -p "$tmp/$n"
    vhost_null_config "$tmp/$n.json" "$blocks" "$DEV"
    "${RUN[@]}" taskset -c "$BCORE" "$bin" serve --cores "$BCORE" --poll-mode "$mode" -S "$tmp/$n" \
        -r "$tmp/$n.rpc" -c "$tmp/$n.json" --log-level warn >"$tmp/$n.log" 2>&1 &
    PID[$n]=$!
    SOCK[$n]=$tmp/$n/vb0
    wait_sock "${SOCK[$n]}"
}
start_ustor-poll() { start_ustor ustor-poll poll; }
start_ustor-alt() { start_ustor ustor-alt adaptive "$USTOR_ALT"; }

start_spdk() {
    mkdir -p "$tmp/spdk"
    "${RUN[@]}" taskset -c "$BCORE" "$VHOST" -m "$bmask" --disable-cpumask-locks --no-huge -s 512 \
        -S "$tmp/spdk" -r "$tmp/spdk.rpc" >"$tmp/spdk.log" 2>&1 &
    PID[spdk]=$!
    wait_sock "$tmp/spdk.rpc"
    python3 "$RPC_PY" -s "$tmp/spdk.rpc" -t 30 framework_wait_init >/dev/null
    python3 "$RPC_PY" -s "$tmp/spdk.rpc" bdev_null_create Null0 "$SIZE_MIB" 512 >/dev/null
    if [ "$DEV" = scsi ]; then
        python3 "$RPC_PY" -s "$tmp/spdk.rpc" vhost_create_scsi_controller --cpumask "$bmask" vb0 >/dev/null
        python3 "$RPC_PY" -s "$tmp/spdk.rpc" vhost_scsi_controller_add_target vb0 0 Null0 >/dev/null
    else
        python3 "$RPC_PY" -s "$tmp/spdk.rpc" vhost_create_blk_controller --cpumask "$bmask" vb0 Null0 >/dev/null
    fi
    SOCK[spdk]=$tmp/spdk/vb0
    wait_sock "${SOCK[spdk]}"
}

start_qsd() {
    "${RUN[@]}" taskset -c "$BCORE" qemu-storage-daemon \
        --blockdev "driver=null-co,node-name=null0,size=$((SIZE_MIB << 20))" \
        --export "type=vhost-user-blk,id=exp0,node-name=null0,addr.type=unix,addr.path=$tmp/qsd.sock,writable=on,num-queues=$(( $(echo "$QUEUES" | tr ' ' '\n' | sort -n | tail -1) + 1 ))" \
        >"$tmp/qsd.log" 2>&1 &
    PID[qsd]=$!
    SOCK[qsd]=$tmp/qsd.sock
    wait_sock "${SOCK[qsd]}"
}

# Nanoseconds every thread of PID has run (schedstat), so far.
cpu_ns() {
    cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%.0f\n", s}'
}

# A ustor backend's reactor sleeps so far (framework_get_reactors); "-"
# for the other backends. Read around each point: a reactor that sleeps
# under a saturating frontend shows thousands there, one that polls while
# I/O flows only the few of the frontend's start and end.
sleeps() { # backend
    case $1 in
    ustor*) python3 "$RPC_PY" -s "$tmp/$1.rpc" framework_get_reactors 2>/dev/null |
        python3 -c 'import json,sys; print(sum(r["sleeps"] for r in json.load(sys.stdin)["reactors"]))' 2>/dev/null || echo - ;;
    *) echo - ;;
    esac
}

frontend_json() { # socket [queues, default 1]
    cat <<EOF
{"subsystems": [{"subsystem": "bdev", "config": [
  {"method": "bdev_virtio_attach_controller", "params": {"name": "V", "trtype": "user",
   "traddr": "$1", "dev_type": "$DEV", "vq_count": $((${2:-1} + 1))}}]}]}
EOF
}

# bdevperf's job file for N queues: N jobs on the virtio bdev, each on an
# SPDK thread of its own (one channel, one virtqueue each); the command
# line's -q/-o/-w give every job its workload.
jobs_file() { # queues
    local i
    for i in $(seq 0 $(($1 - 1))); do printf '[job%d]\nfilename=%s\n' "$i" "$FBDEV"; done
}

# The /proc/stat counters (USER_HZ ticks) of the backend and frontend
# cores: "busy idle steal" per core, BCORE first. Steal is the time the
# host ran something else on the vCPU; busy counts every process of the
# guest on that core (other work on the machine included).
core_ticks() {
    awk -v b="cpu$BCORE" -v f="cpu$FCORE" '$1 == b || $1 == f {
        t[$1] = ($2 + $3 + $4 + $7 + $8) " " ($5 + $6) " " $9 } END { print t[b], t[f] }' /proc/stat
}

# "bsteal% bbusy% bidle% fsteal% fbusy% fidle%" between two core_ticks
# snapshots over wall_ns (% of one core's wall time).
core_pct() { # before after wall_ns
    awk -v a="$1" -v b="$2" -v w="$3" -v hz="$(getconf CLK_TCK)" 'BEGIN {
        split(a, x); split(b, y); s = w / 1e9 * hz / 100
        printf "%.1f %.1f %.1f %.1f %.1f %.1f", (y[3] - x[3]) / s, (y[1] - x[1]) / s, (y[2] - x[2]) / s,
            (y[6] - x[6]) / s, (y[4] - x[4]) / s, (y[5] - x[5]) / s }'
}

# The CPUs the threads of PID last ran on (/proc/PID/task/*/stat field
# 39), as a sorted list: the pinning, checked per point.
placement() { # pid
    # A process that has already exited gives "" (the caller writes "-").
    { cat /proc/"$1"/task/*/stat 2>/dev/null || true; } | sed 's/^.*) //' | awk '{print $37}' | sort -un | paste -sd, -
}

# Only the backend being measured runs: the others are stopped (SIGSTOP),
# because a polling backend (SPDK, ustor-poll) spins on the shared
# backend core even with no frontend and would take half of it from the
# one measured.
. bench/lib/only.sh
only() { only_run "$1" $BACKENDS; } # backend

# The cache line round trip between the two cores now (ns), every
# backend stopped; "-" without the probe.
xrtt() {
    local be
    [ "$XRTT" = 1 ] || { echo -; return; }
    for be in $BACKENDS; do kill -STOP "${PID[$be]}"; done
    "${RUN[@]}" "$tmp/xcore_rtt" "$BCORE" "$FCORE" 20000 2>/dev/null || echo -
}

# One bdevperf run: "iops lat_avg_us backend_cpu_ns wall_ns reactor_sleeps
# bsteal% bbusy% bidle% fsteal% fbusy% fidle% backend_cpus frontend_cpu
# xrtt_ns_before xrtt_ns_after".
run_point() { # backend rw qd queues
    local cfg=$tmp/fe-$1.json before after t0 t1 res s0 s1 k0 k1 fe fcpu x jobs=()
    x=$(xrtt)
    only "$1"
    frontend_json "${SOCK[$1]}" "$4" >"$cfg"
    if [ "$4" -gt 1 ]; then
        jobs_file "$4" >"$tmp/jobs-$4.conf"
        jobs=(-j "$tmp/jobs-$4.conf")
    fi
    s0=$(sleeps "$1")
    before=$(cpu_ns "${PID[$1]}")
    k0=$(core_ticks)
    t0=$(date +%s%N)
    if [ "$FRONTEND" = blkio ]; then
        "${RUN[@]}" taskset -c "$FCORE" "$BLKIO_LOAD" "${SOCK[$1]}" "$2" "$3" "$RUNTIME" \
            >"$tmp/bdevperf.out" 2>&1 &
    else
        "${RUN[@]}" taskset -c "$FCORE" "$BDEVPERF" -m "$fmask" --disable-cpumask-locks -g \
            --huge-dir /dev/hugepages -s 512 --no-rpc-server --json "$cfg" \
            -q "$3" -o 4096 -w "$2" -t "$RUNTIME" "${jobs[@]}" >"$tmp/bdevperf.out" 2>&1 &
    fi
    fe=$!
    # Where the frontend's threads run, read once mid-run.
    sleep "$(awk -v r="$RUNTIME" 'BEGIN { print r / 2 }')"
    fcpu=$(placement "$fe")
    wait "$fe" || true
    t1=$(date +%s%N)
    k1=$(core_ticks)
    after=$(cpu_ns "${PID[$1]}")
    s1=$(sleeps "$1")
    if [ "$FRONTEND" = blkio ]; then
        res=$(sed -n 's/^iops=\([0-9.]*\) lat_us=\([0-9.]*\) .*/\1 \2/p' "$tmp/bdevperf.out")
    else
        res=$(tr -d '\r' <"$tmp/bdevperf.out" | awk '/^ *Total +:/ {print $3, $7}')
    fi
    if [ -z "$res" ]; then
        tail -5 "$tmp/bdevperf.out" >&2
        res="0 0"
    fi
    if [ "$s0" = - ] || [ "$s1" = - ]; then s1=-; else s1=$((s1 - s0)); fi
    echo "$res $((after - before)) $((t1 - t0)) $s1 $(core_pct "$k0" "$k1" "$((t1 - t0))") $(placement "${PID[$1]}") ${fcpu:--} $x $(xrtt)"
}

pct() { awk -v ns="$1" -v s="$IDLE_S" 'BEGIN { printf "%.2f", ns / s / 1e7 }'; }

# Backend CPU (% of a core) over IDLE_S: with no frontend, then with an
# idle connected bdevperf.
idle_point() { # backend
    local a b cfg=$tmp/fe-$1.json fe
    only "$1"
    a=$(cpu_ns "${PID[$1]}")
    sleep "$IDLE_S"
    b=$(cpu_ns "${PID[$1]}")
    local none
    none=$(pct "$((b - a))")
    if [ "$FRONTEND" = blkio ]; then
        # libblkio's queue is busy-polled by its caller: an idle connected
        # frontend is bdevperf's case only.
        echo "$none -"
        return
    fi
    frontend_json "${SOCK[$1]}" >"$cfg"
    taskset -c "$FCORE" "$BDEVPERF" -m "$fmask" --disable-cpumask-locks -g --huge-dir /dev/hugepages \
        -s 512 -r "$tmp/fe.rpc" --json "$cfg" -z -q 1 -o 4096 -w randread -t 1 >"$tmp/idle-$1.out" 2>&1 &
    fe=$!
    for _ in $(seq 200); do
        kill -0 "$fe" 2>/dev/null || break
        if python3 "$RPC_PY" -s "$tmp/fe.rpc" -t 2 bdev_get_bdevs -b V >/dev/null 2>&1; then
            break
        fi
        sleep 0.1
    done
    sleep 1
    a=$(cpu_ns "${PID[$1]}")
    sleep "$IDLE_S"
    b=$(cpu_ns "${PID[$1]}")
    kill "$fe"
    wait "$fe" 2>/dev/null || true
    echo "$none $(pct "$((b - a))")"
}

for be in $BACKENDS; do "start_$be"; done
{
    echo "# bench/vhost.sh $stamp: $(nproc) CPUs, $(uname -r), backend core $BCORE, frontend core $FCORE,"
    echo "# ROUNDS=$ROUNDS RUNTIME=$RUNTIME SIZE_MIB=$SIZE_MIB NICE=$NICE; load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    # The binary's own name (A/B copies carry their commit: ustor-<sha>);
    # the worktree's HEAD is only where the script ran.
    echo "# ustor: $(basename "$USTOR") ($("$USTOR" --version 2>/dev/null | head -1)); worktree HEAD $(git -C "$root" rev-parse --short HEAD 2>/dev/null)"
    [ -z "${USTOR_ALT:-}" ] || echo "# ustor-alt: $(basename "$USTOR_ALT") ($("$USTOR_ALT" --version 2>/dev/null | head -1))"
    echo "# uptime: $(uptime)"
    echo "# SPDK $(python3 "$RPC_PY" -s "$tmp/spdk.rpc" spdk_get_version 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])' 2>/dev/null || echo '?'), $(qemu-storage-daemon --version | head -1)"
} | tee "$out"
for be in $BACKENDS; do
    read -r none conn < <(idle_point "$be")
    echo "idle $be none_pct=$none connected_pct=$conn" | tee -a "$out"
done
for r in $(seq "$ROUNDS"); do
    for rw in $RWS; do
        for qd in $QDS; do for nq in $QUEUES; do
            label=$qd
            [ "$nq" = 1 ] || label=${qd}x$nq
            # Odd rounds run the backends in BACKENDS order, even rounds in
            # reverse (ABBA): no backend always follows the same one.
            order=$BACKENDS
            [ $((r % 2)) = 1 ] || order=$(echo "$BACKENDS" | tr ' ' '\n' | tac | paste -sd' ' -)
            for be in $order; do
                read -r iops lat cpu wall slp bst bbu bid fst fbu fid bcpu fcpu xr xr2 < <(run_point "$be" "$rw" "$qd" "$nq")
                echo "point round=$r backend=$be rw=$rw qd=$label iops=$iops lat_us=$lat cpu_ns=$cpu wall_ns=$wall runtime=$RUNTIME sleeps=$slp bsteal=$bst bbusy=$bbu bidle=$bid fsteal=$fst fbusy=$fbu fidle=$fid bcpus=$bcpu fcpus=$fcpu xrtt_ns=$xr xrtt2_ns=$xr2" | tee -a "$out"
            done
        done; done
    done
done
echo "# load at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out"
python3 - "$out" <<'PY' | tee -a "$out"
import re, statistics as st, sys
pts, idle = [], {}
for line in open(sys.argv[1]):
    if line.startswith("point "):
        pts.append(dict(kv.split("=") for kv in line.split()[1:]))
    elif line.startswith("idle "):
        f = line.split()
        idle[f[1]] = (f[2].split("=")[1], f[3].split("=")[1])
backends = list(dict.fromkeys(p["backend"] for p in pts))
cells = {}
num = lambda s: float(s) if s and s.replace(".", "").isdigit() else float("nan")
for p in pts:
    iops, rt = float(p["iops"]), float(p["runtime"])
    cpu_s, wall_s = int(p["cpu_ns"]) / 1e9, int(p["wall_ns"]) / 1e9
    # The backend's CPU covers bdevperf's whole run (start-up too): per
    # I/O it is divided by the I/Os of the measured seconds only, so it
    # slightly overstates every backend alike.
    cells.setdefault((p["rw"], p["qd"], p["backend"]), []).append(
        (iops, float(p["lat_us"]), cpu_s * 1e9 / max(iops * rt, 1), 100 * cpu_s / wall_s, p["round"],
         p.get("sleeps", "-"), 100 * cpu_s / rt,
         float(p.get("bsteal", "nan")) + float(p.get("fsteal", "nan")),
         float(p.get("bbusy", "nan")) - 100 * cpu_s / wall_s,
         num(p.get("xrtt_ns")), num(p.get("xrtt2_ns"))))
print("\nmedians over rounds (IOPS; mean latency us; backend CPU ns per I/O; backend CPU % of a core")
print("over bdevperf's wall time (cpu%wall) and over the RUNTIME seconds of I/O (cpu%io))")
print("(sleeps: the ustor reactor's sleeps over the point, start-up and end included, median)")
print(f"{'rw':10} {'qd':>5} {'backend':8} {'IOPS':>10} {'lat_us':>8} {'ns/IO':>8} {'cpu%wall':>8} {'cpu%io':>6} {'sleeps':>7}  IOPS min-max")
for (rw, qd, be), v in cells.items():
    m = lambda i: st.median(x[i] for x in v)
    lo, hi = min(x[0] for x in v), max(x[0] for x in v)
    sl = [int(x[5]) for x in v if x[5].lstrip("-").isdigit()]
    sl = f"{st.median(sl):.0f}" if sl else "-"
    print(f"{rw:10} {qd:>5} {be:8} {m(0):10.0f} {m(1):8.1f} {m(2):8.0f} {m(3):8.1f} {m(6):6.1f} {sl:>7}  {lo:.0f}-{hi:.0f}")
def rank(xs):
    o = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    for k, i in enumerate(o):
        r[i] = float(k)
    return r
def rho(a, b):
    # Spearman's rank correlation; None where it cannot be told.
    if len(a) < 3 or any(x != x for x in a + b):
        return None
    ra, rb = rank(a), rank(b)
    ma, mb = st.mean(ra), st.mean(rb)
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return sum((x - ma) * (y - mb) for x, y in zip(ra, rb)) / den if den else None
fmt = lambda r: "   -" if r is None else f"{r:+.2f}"
if "ustor" in backends:
    print("\nustor/peer IOPS ratio per round (median [min-max]); latency ratio of medians")
    for (rw, qd, be), v in cells.items():
        if be.startswith("ustor"):
            continue
        for us in [b for b in backends if b.startswith("ustor")]:
          u = {x[4]: x for x in cells.get((rw, qd, us), [])}
          rs = [u[x[4]][0] / x[0] for x in v if x[4] in u and x[0] > 0]
          if not rs:
              continue
          lat = st.median(x[1] for x in u.values()) / max(st.median(x[1] for x in v), 1e-9)
          # Whether the two sides' IOPS rise and fall together across rounds
          # (a cause common to both: the machine, not the backend).
          both = [(u[x[4]][0], x[0]) for x in v if x[4] in u]
          r = rho([a for a, _ in both], [b for _, b in both])
          r = "" if r is None else f"  rho(rounds) {r:+.2f}"
          print(f"{rw:10} {qd:>5} {us:10} vs {be:6} IOPS {st.median(rs):5.2f}x [{min(rs):.2f}-{max(rs):.2f}]  latency {lat:5.2f}x{r}")
if "ustor" in backends and "ustor-alt" in backends:
    print("\nustor / ustor-alt (USTOR over USTOR_ALT) IOPS ratio per round (median [min-max]); latency ratio of medians")
    for (rw, qd, be), v in cells.items():
        if be != "ustor-alt":
            continue
        u = {x[4]: x for x in cells.get((rw, qd, "ustor"), [])}
        rs = [u[x[4]][0] / x[0] for x in v if x[4] in u and x[0] > 0]
        if rs:
            lat = st.median(x[1] for x in u.values()) / max(st.median(x[1] for x in v), 1e-9)
            print(f"{rw:10} {qd:>5} ustor vs ustor-alt IOPS {st.median(rs):5.2f}x [{min(rs):.2f}-{max(rs):.2f}]  latency {lat:5.2f}x")
if any(x[7] == x[7] for v in cells.values() for x in v):
    print("\nper point across rounds: IOPS and the steal of both cores (% of a core, backend + frontend core),")
    print("and Spearman's rho of IOPS with steal and with other work on the backend core (its busy % less the backend's own)")
    for (rw, qd, be), v in cells.items():
        rows = " ".join(f"{x[0] / 1e3:.0f}k/{x[7]:.0f}" for x in sorted(v, key=lambda x: int(x[4])))
        print(f"{rw:10} {qd:>5} {be:10} rho(steal) {fmt(rho([x[0] for x in v], [x[7] for x in v]))}"
              f" rho(other) {fmt(rho([x[0] for x in v], [x[8] for x in v]))}  IOPS/steal: {rows}")
xs = [y for v in cells.values() for x in v for y in x[9:11] if y == y]
if xs:
    print(f"\ncross-core round trip before each point (xrtt_ns): {min(xs):.0f}-{max(xs):.0f} ns, median {st.median(xs):.0f};")
    print("per cell: Spearman's rho of IOPS with it (before the point), and each round's IOPS/xrtt before,after")
    for (rw, qd, be), v in cells.items():
        rows = " ".join(f"{x[0] / 1e3:.0f}k/{x[9]:.0f},{x[10]:.0f}" for x in sorted(v, key=lambda x: int(x[4])))
        print(f"{rw:10} {qd:>5} {be:10} rho(xrtt) {fmt(rho([x[0] for x in v], [x[9] for x in v]))}  {rows}")
    # Two groups when the fastest probe is under half the median (or the
    # slowest over twice it): split at the geometric mean of the two. A
    # lone slow probe (its thread descheduled) is not a group of its own.
    lo, md, hi = min(xs), st.median(xs), max(xs)
    cut = (lo * md) ** 0.5 if 2 * lo < md else (md * hi) ** 0.5 if hi > 2 * md else None
    if cut:
        grp = lambda x: ("near" if max(x[9:11]) < cut else "far" if min(x[9:11]) >= cut else "mixed"
                         ) if x[9] == x[9] and x[10] == x[10] else "-"
        print(f"\npoints by round trip: near < {cut:.0f} ns <= far; median IOPS (points) per group")
        for (rw, qd, be), v in cells.items():
            g = {k: [x[0] for x in v if grp(x) == k] for k in ("near", "far")}
            cols = "  ".join(f"{k} {st.median(g[k]) / 1e3:7.0f}k ({len(g[k])})" if g[k] else f"{k}        - (0)" for k in g)
            print(f"{rw:10} {qd:>5} {be:10} {cols}")
        if "ustor" in backends:
            print("ustor/peer IOPS ratio per round where both points met the same group (median [min-max], rounds)")
            for (rw, qd, be), v in cells.items():
                if be.startswith("ustor"):
                    continue
                u = {x[4]: x for x in cells.get((rw, qd, "ustor"), [])}
                for k in ("near", "far"):
                    rs = [u[x[4]][0] / x[0] for x in v if x[4] in u and x[0] > 0
                          and grp(x) == k and grp(u[x[4]]) == k]
                    if rs:
                        print(f"{rw:10} {qd:>5} ustor vs {be:6} {k:4} {st.median(rs):5.2f}x [{min(rs):.2f}-{max(rs):.2f}] ({len(rs)})")
print("\nbackend CPU with no I/O (% of a core): no frontend / a connected idle frontend")
for be, (a, b) in idle.items():
    print(f"{be:8} {a:>4}% / {b:>4}%")
PY
echo "written: $out"
