#!/bin/bash
# Syscalls of a vhost-user-blk backend per I/O (kick reads, call-eventfd
# writes, sleeps in ppoll / io_uring_enter, context switches), counted
# with perf's syscall tracepoints while the libblkio frontend
# (crates/vhost-user/examples/blkio_load.rs, one polled queue) drives it:
# ustor (null bdev, one core, adaptive polling) and qemu-storage-daemon's
# vhost-user-blk export of a null-co node, alternating, for each queue
# depth. Counts do not depend much on the machine's load (rates do, so
# the IOPS printed here say nothing on a shared machine).
#
# Usage: bench/vhost-syscalls.sh [RW] [QDS] [SECS]
# Environment: USTOR=target/release/ustor BLKIO_LOAD=target/release/examples/blkio_load
#              BCORE=0 FCORE=1 BACKENDS="ustor qsd"
# Needs perf (with tracepoint access: root), qemu-storage-daemon.
set -euo pipefail
RW=${1:-randread}
QDS=${2:-"1 32 128"}
SECS=${3:-3}
cd "$(dirname "$0")/.."
USTOR=${USTOR:-target/release/ustor}
BLKIO_LOAD=${BLKIO_LOAD:-target/release/examples/blkio_load}
BCORE=${BCORE:-0}
FCORE=${FCORE:-1}
BACKENDS=${BACKENDS:-"ustor qsd"}
for b in "$USTOR" "$BLKIO_LOAD"; do
    [ -x "$b" ] || { echo "vhost-syscalls.sh: no $b (cargo build --release -p ustor --bin ustor; cargo build --release -p ustor-vhost --example blkio_load)" >&2; exit 2; }
done
tmp=$(mktemp -d)
pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
cat >"$tmp/c.json" <<J
{"subsystems": [
  {"subsystem": "bdev", "config": [{"method": "bdev_null_create", "params": {"name": "Null0", "num_blocks": 2097152, "block_size": 512}}]},
  {"subsystem": "vhost_blk", "config": [{"method": "vhost_create_blk_controller", "params": {"ctrlr": "vb0", "dev_name": "Null0"}}]}
]}
J
events=syscalls:sys_enter_write,syscalls:sys_enter_read,syscalls:sys_enter_ppoll,syscalls:sys_enter_io_uring_enter,context-switches
echo "# bench/vhost-syscalls.sh $RW QD ($QDS) ${SECS}s; load: $(cut -d' ' -f1-3 /proc/loadavg); per 1000 I/Os"
for qd in $QDS; do
    for b in $BACKENDS; do
        rm -rf "$tmp/s" "$tmp/qsd.sock"
        mkdir -p "$tmp/s"
        if [ "$b" = qsd ]; then
            taskset -c "$BCORE" qemu-storage-daemon \
                --blockdev "driver=null-co,node-name=null0,size=$((1 << 30))" \
                --export "type=vhost-user-blk,id=exp0,node-name=null0,addr.type=unix,addr.path=$tmp/qsd.sock,writable=on,num-queues=2" \
                >"$tmp/log" 2>&1 &
            sock=$tmp/qsd.sock
        else
            taskset -c "$BCORE" "$USTOR" serve --cores "$BCORE" -S "$tmp/s" -r "$tmp/rpc" \
                -c "$tmp/c.json" --log-level warn >"$tmp/log" 2>&1 &
            sock=$tmp/s/vb0
        fi
        pid=$!
        for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
        [ -S "$sock" ] || { echo "vhost-syscalls.sh: $b: no socket" >&2; cat "$tmp/log" >&2; exit 1; }
        perf stat -x, -e "$events" -p "$pid" -o "$tmp/perf" -- sleep "$(echo "$SECS + 0.5" | bc)" &
        pp=$!
        sleep 0.2
        out=$(taskset -c "$FCORE" "$BLKIO_LOAD" "$sock" "$RW" "$qd" "$SECS")
        wait "$pp"
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        pid=
        ios=$(echo "$out" | sed -n 's/.*ios=\([0-9]*\).*/\1/p')
        counts=$(grep -v '^#' "$tmp/perf" | awk -F, -v n="$ios" 'NF > 2 {
            e = $3; sub(/^syscalls:sys_enter_/, "", e); printf "%s=%.3f ", e, $1 * 1000 / n }')
        echo "$b $RW QD$qd: $out | $counts"
    done
done
