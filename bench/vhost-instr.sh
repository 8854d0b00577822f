#!/bin/bash
# Instructions per request of the vhost-user-blk data path, without a PMU:
# `ustor serve` (a null bdev behind one blk controller, poll mode, one
# core) runs under valgrind's callgrind with instrumentation off until its
# socket is up; the libblkio frontend (crates/vhost-user/examples/
# blkio_load.rs, no hugepages) drives it natively for SECS seconds with
# instrumentation on; then the inclusive instruction counts of the data
# path's functions are divided by the requests completed. Instruction
# counts do not depend on the machine's load (timings do), so two builds
# compare on a shared machine; the reactor's idle polling is in `total`
# and `Reactor::run`, not in the per-function lines.
#
# Usage: bench/vhost-instr.sh [RW] [QD] [SECS]
# Environment: USTOR=target/release/ustor BLKIO_LOAD=target/release/examples/blkio_load
#              BCORE=0 FCORE=1 KEEP=1 (keep the callgrind output)
# Needs valgrind (callgrind_control, callgrind_annotate).
set -euo pipefail
RW=${1:-randread}
QD=${2:-32}
SECS=${3:-4}
cd "$(dirname "$0")/.."
. bench/lib/vhost-null.sh
USTOR=${USTOR:-target/release/ustor}
BLKIO_LOAD=${BLKIO_LOAD:-target/release/examples/blkio_load}
BCORE=${BCORE:-0}
FCORE=${FCORE:-1}
for b in "$USTOR" "$BLKIO_LOAD"; do
    [ -x "$b" ] || { echo "vhost-instr.sh: no $b (cargo build --release -p ustor -p ustor-vhost --example blkio_load)" >&2; exit 2; }
done
command -v callgrind_control >/dev/null || { echo "vhost-instr.sh: valgrind missing" >&2; exit 2; }
# What the measured binary is: the commit in its name (the A/B copies
# are named ustor-<sha>), else its build time and the worktree's HEAD,
# said to be only that (the binary may predate or postdate it); and a
# hash of the file either way.
binary_id() {
    local name sum
    name=$(basename "$1")
    sum=$(sha256sum "$1" | cut -c1-12)
    if [[ $name =~ -([0-9a-f]{7,40})$ ]]; then
        echo "commit ${BASH_REMATCH[1]} ($name, sha256 $sum)"
    else
        echo "$name built $(date -u -r "$1" +%FT%TZ), sha256 $sum; worktree HEAD $(git rev-parse --short HEAD 2>/dev/null) (not necessarily the binary's)"
    fi
}
tmp=$(mktemp -d)
pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    [ -n "${KEEP:-}" ] && echo "kept: $tmp" || rm -rf "$tmp"
}
trap cleanup EXIT
mkdir -p "$tmp/s"
vhost_null_config "$tmp/c.json"
nice -n -20 taskset -c "$BCORE" valgrind --tool=callgrind --instr-atstart=no \
    --callgrind-out-file="$tmp/cg.out" "$USTOR" serve --cores "$BCORE" --poll-mode poll \
    -S "$tmp/s" -r "$tmp/rpc" -c "$tmp/c.json" --log-level warn >"$tmp/log" 2>&1 &
pid=$!
for _ in $(seq 600); do [ -S "$tmp/s/vb0" ] && break; sleep 0.1; done
[ -S "$tmp/s/vb0" ] || { echo "vhost-instr.sh: no socket" >&2; cat "$tmp/log" >&2; exit 1; }
callgrind_control -i on "$pid" >/dev/null 2>&1
load=$(nice -n -20 taskset -c "$FCORE" "$BLKIO_LOAD" "$tmp/s/vb0" "$RW" "$QD" "$SECS")
callgrind_control -i off "$pid" >/dev/null 2>&1
kill "$pid"
wait "$pid" 2>/dev/null || true
pid=
ios=$(echo "$load" | sed -n 's/.*ios=\([0-9]*\).*/\1/p')
echo "# bench/vhost-instr.sh $RW QD$QD ${SECS}s: $load"
echo "# ustor $(binary_id "$USTOR"); instructions per request (inclusive)"
callgrind_annotate --inclusive=yes --threshold=100 "$tmp/cg.out" 2>/dev/null | awk -v r="$ios" '
    /PROGRAM TOTALS/ { gsub(",", "", $1); printf "%8.0f  total\n", $1 / r; next }
    /vring::take_available \[|vring::start_request \[|blk::parse_chain \[|blk::read_chain \[|virtq::Virtq::pop \[|DescriptorChain<M> as core::iter::traits::iterator::Iterator>::next \[|vring::complete \[|vring::publish \[|Virtq::push_used \[|QueueT>::add_used \[|QueueT>::pop_descriptor_chain \[|to_region_addr \[|Executor::run_ready \[/ {
        gsub(",", "", $1); n = split($0, a, ":"); f = a[n]; sub(/ \[.*/, "", f)
        printf "%8.0f  %s\n", $1 / r, f
    }'
