#!/usr/bin/env bash
# Does a ustor reactor sleep while a saturating frontend keeps its
# vhost-user-blk queue fed? `ustor serve` (null bdev, one blk controller,
# one core BCORE, poll mode MODE) under SPDK bdevperf's virtio-user
# frontend (core FCORE, RW at QD for T seconds); in the middle of the I/O
# (from 1 s after it starts, for WINDOW seconds) it counts the reactor's
# sleeps and loop passes (framework_get_reactors), the queue's kicks
# (vhost_get_controllers: the queue parked on its kick eventfd and the
# frontend woke it), the backend's CPU (schedstat of all its threads) and
# the runnable count of /proc/loadavg at both ends of the window (above
# the CPU count, the adaptive reactor's contention check is on).
#
# Usage: bench/vhost-sleeps.sh [MODE] [QD] [RW]     (MODE adaptive|poll)
# Environment: SPDK_DIR (built WITH="vhost virtio")  USTOR=target/release/ustor
#              BCORE=0 FCORE=1 T=12 WINDOW=4
# Needs root (hugepages for bdevperf). Prints one line.
set -euo pipefail
MODE=${1:-adaptive}
QD=${2:-32}
RW=${3:-randread}
SPDK_DIR=${SPDK_DIR:-$HOME/spdk-full}
USTOR=${USTOR:-target/release/ustor}
BCORE=${BCORE:-0}
FCORE=${FCORE:-1}
T=${T:-12}
WINDOW=${WINDOW:-4}
cd "$(dirname "$0")/.."
. bench/lib/vhost-null.sh
export LD_LIBRARY_PATH=$SPDK_DIR/build/lib:$SPDK_DIR/dpdk/build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
d=$(mktemp -d /tmp/ustor-vhost-sleeps.XXXXXX)
up=
cleanup() {
    [ -n "$up" ] && kill "$up" 2>/dev/null && wait "$up" 2>/dev/null
    rm -rf "$d"
}
trap cleanup EXIT
mkdir -p "$d/s"
vhost_null_config "$d/c.json"
cat >"$d/fe.json" <<J
{"subsystems": [{"subsystem": "bdev", "config": [
  {"method": "bdev_virtio_attach_controller", "params": {"name": "V", "trtype": "user",
   "traddr": "$d/s/vb0", "dev_type": "blk", "vq_count": 2}}]}]}
J
taskset -c "$BCORE" "$USTOR" serve --cores "$BCORE" --poll-mode "$MODE" -S "$d/s" -r "$d/rpc" \
    -c "$d/c.json" --log-level warn >"$d/log" 2>&1 &
up=$!
for _ in $(seq 200); do [ -S "$d/s/vb0" ] && break; sleep 0.05; done
field() { tr -d ' \n' | grep -o "\"$1\":[0-9]*" | cut -d: -f2 | paste -sd+ | bc; }
# "ns cpu_ns sleeps loops kicks runnable": the RPCs first, then the clock.
snap() {
    local r c
    r=$("$USTOR" rpc -s "$d/rpc" framework_get_reactors)
    c=$("$USTOR" rpc -s "$d/rpc" vhost_get_controllers)
    echo "$(date +%s%N) $(cat /proc/"$up"/task/*/schedstat | awk '{s += $1} END {printf "%.0f\n", s}')" \
        "$(echo "$r" | field sleeps) $(echo "$r" | field loops) $(echo "$c" | field kicks)" \
        "$(cut -d' ' -f4 /proc/loadavg)"
}
taskset -c "$FCORE" "$SPDK_DIR/build/examples/bdevperf" -m "$(printf '0x%x' $((1 << FCORE)))" \
    --disable-cpumask-locks -g --huge-dir /dev/hugepages -s 512 --no-rpc-server --json "$d/fe.json" \
    -q "$QD" -o 4096 -w "$RW" -t "$T" >"$d/bp.out" 2>&1 &
bp=$!
for _ in $(seq 200); do grep -q "Running I/O" "$d/bp.out" 2>/dev/null && break; sleep 0.05; done
sleep 1
read -r t0 c0 s0 l0 k0 r0 < <(snap)
sleep "$WINDOW"
read -r t1 c1 s1 l1 k1 r1 < <(snap)
wait "$bp" || true
rate() { awk -v n="$1" -v d=$((t1 - t0)) -v m="$2" 'BEGIN { printf "%.1f", n * m / d }'; }
echo "mode=$MODE qd=$QD rw=$RW window_s=$(awk -v d=$((t1 - t0)) 'BEGIN { printf "%.2f", d / 1e9 }') sleeps_per_s=$(rate $((s1 - s0)) 1e9)" \
    "kicks_per_s=$(rate $((k1 - k0)) 1e9) loops_per_s=$(rate $((l1 - l0)) 1e9)" \
    "backend_cpu_pct=$(rate $((c1 - c0)) 100) runnable=$r0,$r1 cpus=$(nproc)" \
    "$(tr -d '\r' <"$d/bp.out" | awk '/^ *Total +:/ {print "iops=" $3, "lat_us=" $7}')"
