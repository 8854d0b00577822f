#!/usr/bin/env bash
# Virtual bdev stack cost (issue 21, experiment 1), in one run:
#
#   `ustor bench` 4 KiB randread on one core (poll mode) at QD1 and QD128 on
#   a null bdev alone and on each virtual bdev over null bdevs: passthru,
#   split part, raid0 (2 members, 64 KiB strips), concat (2), raid1 (2).
#   Per point: IOPS, average latency, CPU ns per I/O; the summary gives the
#   medians over REPEAT and the ns per I/O each layer adds over null alone.
#   With SPDK built by bench/spdk-build.sh (SPDK_DIR), SPDK bdevperf runs on
#   the same null and raid0-over-null in the same run, interleaved, and the
#   summary adds ustor/SPDK IOPS ratios (goal: raid0 adds <= 15 ns per I/O,
#   ustor's raid0 IOPS per core >= SPDK's).
#
# Experiment 2 of the issue (dm-linear/dm-stripe with polled io_uring in a
# guest vs ustor's concat/raid0 over IOPOLL uring bdevs) is bench/dm-poll.sh.
#
# Usage: [REPEAT=3] [RUNTIME=3] bench/vbdev.sh
# Environment: CORE=1 QDS="1 128" STACKS="null passthru split raid0 concat
#   raid1" SPDK_DIR=<SPDK tree, static or shared build> NOBUILD=1 USTOR=path
# bdevperf runs with --disable-cpumask-locks: other SPDK apps on the machine
# may hold the core lock of CORE.
# Output: bench/results/vbdev-<date>.txt (raw lines, then the summary).
set -euo pipefail

REPEAT=${REPEAT:-3}
RUNTIME=${RUNTIME:-3}
CORE=${CORE:-1}
QDS=${QDS:-"1 128"}
STACKS=${STACKS:-"null passthru split raid0 concat raid1"}
SPDK_DIR=${SPDK_DIR:-$HOME/spdk}

cd "$(dirname "$0")/.."
root=$(pwd)
stamp=$(date +%Y%m%d-%H%M%S)
out=$root/bench/results/vbdev-$stamp.txt
mkdir -p "$root/bench/results"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ -z "${NOBUILD:-}" ]; then
    cargo build --release -q -p ustor
fi
USTOR=${USTOR:-$root/target/release/ustor}
[ -x "$USTOR" ] || { echo "vbdev.sh: $USTOR missing" >&2; exit 2; }
BDEVPERF=$SPDK_DIR/build/examples/bdevperf
[ -x "$BDEVPERF" ] || BDEVPERF=""
# A shared-library SPDK build finds its libraries here (a static one needs nothing).
export LD_LIBRARY_PATH=$SPDK_DIR/build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# config STACK: the bdev subsystem calls for STACK; the bdev to run on is
# named "top" (null alone: "n0").
null_call() {
    echo "{\"method\": \"bdev_null_create\", \"params\": {\"name\": \"$1\", \"num_blocks\": 2097152, \"block_size\": 512}}"
}
config() {
    local calls top=top
    calls="$(null_call n0), $(null_call n1)"
    case $1 in
        null) top=n0 ;;
        passthru) calls="$calls, {\"method\": \"bdev_passthru_create\", \"params\": {\"base_bdev_name\": \"n0\", \"name\": \"top\"}}" ;;
        split) calls="$calls, {\"method\": \"bdev_split_create\", \"params\": {\"base_bdev\": \"n0\", \"split_count\": 2}}"; top=n0p1 ;;
        raid0 | concat) calls="$calls, {\"method\": \"bdev_raid_create\", \"params\": {\"name\": \"top\", \"raid_level\": \"$1\", \"base_bdevs\": [\"n0\", \"n1\"], \"strip_size_kb\": 64}}" ;;
        raid1) calls="$calls, {\"method\": \"bdev_raid_create\", \"params\": {\"name\": \"top\", \"raid_level\": \"raid1\", \"base_bdevs\": [\"n0\", \"n1\"]}}" ;;
        *) echo "unknown stack $1" >&2; exit 2 ;;
    esac
    echo "{\"subsystems\": [{\"subsystem\": \"bdev\", \"config\": [$calls]}]}" >"$tmp/$1.json"
    echo "$top"
}

point() { # TOOL STACK QD
    local tool=$1 stack=$2 qd=$3 top r
    top=$(config "$stack")
    if [ "$tool" = bdevperf ]; then
        timeout $((RUNTIME + 60)) "$BDEVPERF" --no-pci --disable-cpumask-locks --json "$tmp/$stack.json" -m $((1 << CORE)) \
            -q "$qd" -o 4096 -w randread -t "$RUNTIME" -T "$top" >"$tmp/bdevperf.out" 2>&1 || true
        r=$(tr -d '\r' <"$tmp/bdevperf.out" | awk '/^ *Total +:/ {print "iops=" $3 " lat_avg_us=" $7}')
    else
        r=$(timeout $((RUNTIME + 60)) "$USTOR" bench -c "$tmp/$stack.json" -b "$top" --cores "$CORE" \
            --poll-mode poll -w randread --bs 4096 -q "$qd" -t "$RUNTIME" --json 2>/dev/null |
            python3 -c 'import json,sys; d=json.load(sys.stdin); t=d["total"]; print("iops=%.1f lat_avg_us=%.3f cpu_ns_per_io=%.1f" % (t["iops"], t["lat_avg_us"], d["cpu_ns_per_io"]))') || true
    fi
    echo "rep=$rep tool=$tool stack=$stack qd=$qd ${r:-FAILED}"
}

{
    echo "# vbdev.sh $stamp $(uname -r) $(nproc) cpus; ustor $(git rev-parse --short HEAD)"
    for rep in $(seq "$REPEAT"); do
        for qd in $QDS; do
            for stack in $STACKS; do
                point ustor "$stack" "$qd"
                if [ -n "$BDEVPERF" ] && { [ "$stack" = null ] || [ "$stack" = raid0 ]; }; then
                    point bdevperf "$stack" "$qd"
                fi
            done
        done
    done
} | tee "$out.raw"

python3 - "$out.raw" <<'PY' | tee "$out"
import re, statistics, sys
pts = {}
for line in open(sys.argv[1]):
    if line.startswith("#"):
        print(line.strip()); continue
    kv = dict(re.findall(r"(\w+)=(\S+)", line))
    if "iops" not in kv:
        continue
    k = (kv["tool"], kv["stack"], kv["qd"])
    pts.setdefault(k, []).append(kv)
def med(k, f):
    v = [float(p[f]) for p in pts.get(k, []) if f in p]
    return statistics.median(v) if v else None
print("\n%-9s %-9s %4s %12s %10s %10s %12s %10s" % ("tool", "stack", "qd", "iops", "lat_us", "cpu_ns", "+ns/io", "vs_spdk"))
for (tool, stack, qd) in sorted(pts):
    iops, lat, cpu = med((tool, stack, qd), "iops"), med((tool, stack, qd), "lat_avg_us"), med((tool, stack, qd), "cpu_ns_per_io")
    base = med((tool, "null", qd), "cpu_ns_per_io")
    add = "%.1f" % (cpu - base) if cpu is not None and base is not None else "-"
    sp = med(("bdevperf", stack, qd), "iops")
    ratio = "%.2f" % (iops / sp) if tool == "ustor" and sp else "-"
    print("%-9s %-9s %4s %12.0f %10.3f %10s %12s %10s" % (tool, stack, qd, iops, lat, "%.1f" % cpu if cpu else "-", add, ratio))
PY
rm -f "$out.raw"
