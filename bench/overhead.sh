#!/usr/bin/env bash
# HwPerfIO experiment (issue 3): what does ustor's stack cost per I/O next to
# fio on the same device, in the same run?
#
#  1. One loop device (losetup --direct-io=on over a file this script creates,
#     on tmpfs by default: LOOP_DIR)
#     and one O_DIRECT file: fio (io_uring, libaio, psync) and `ustor bench`
#     with the uring bdev, 4 KiB randread/randwrite at QD1 and QD32 (psync
#     QD1 only): IOPS, mean and p99 latency, CPU per I/O, ratio ustor/fio
#     io_uring, and at QD1 the mean-latency difference ("stack cost per I/O").
#  2. `ustor bench` on null and malloc at QD1 and QD128: IOPS per core and ns
#     of CPU per I/O (SPDK bdevperf's bar: 13.6 M IOPS on null, QD128).
#
# Everything benchmarked runs on one core ($CORE): ustor's reactor
# (--cores $CORE) and fio's job (--cpus_allowed=$CORE).
# Latency is submit-to-completion for both (fio's lat_ns, ustor's bdev-layer
# timestamps). CPU per I/O: fio's job usr+sys (per thread, --thread) times its
# runtime over its I/Os; ustor's whole-process usr+sys over its I/Os (so the
# reactor's busy-polling counts: in poll mode that is a whole core).
#
# Needs root (losetup), fio, python3. Usage:
#   sudo bench/overhead.sh
# Environment:
#   RUNTIME=5        seconds per point
#   REPEAT=1         runs per point; the table shows medians and the IOPS spread
#   CORE=1           core for ustor's reactor and for fio
#   DIR=/var/tmp     where the 1 GiB file of the file test goes (ext4)
#   LOOP_DIR=/dev/shm  where the loop device's backing file goes. tmpfs by
#                    default: the loop device then costs a few µs and the
#                    same every time, so what differs between fio and ustor
#                    is their stacks. This VM's virtual disk is shared with
#                    other guests and its latency swings by 10x from minute
#                    to minute (QD1 loop randread 5.9 K to 40 K IOPS), which
#                    drowned the stack cost in runs 1-3. LOOP_DIR=/var/tmp
#                    gives the disk-backed loop device of those runs.
#   SIZE_MB=1024     size of each backing file
#   USTOR_MODES="poll adaptive interrupt"   ustor poll modes for the uring bdev
#   MALLOC=1G        malloc bdev size
#   NOBUILD=1        do not run cargo build
#   USTOR=path       ustor binary (default target/release/ustor)
#   OUT=path         raw results (JSON lines); default bench/results/overhead-<date>.jsonl
#   TARGETS="loop file" RWS="randread randwrite" QDS="1 32"
#   ENGINES="io_uring libaio psync"   fio engines (psync runs at QD1 only)
#   PART2=1          0: skip the null/malloc part
set -euo pipefail

RUNTIME=${RUNTIME:-5}
REPEAT=${REPEAT:-1}
CORE=${CORE:-1}
DIR=${DIR:-/var/tmp}
LOOP_DIR=${LOOP_DIR:-/dev/shm}
SIZE_MB=${SIZE_MB:-1024}
USTOR_MODES=${USTOR_MODES:-"poll adaptive interrupt"}
MALLOC=${MALLOC:-1G}

cd "$(dirname "$0")/.."
root=$(pwd)
stamp=$(date +%Y%m%d-%H%M%S)
OUT=${OUT:-$root/bench/results/overhead-$stamp.jsonl}
TARGETS=${TARGETS:-"loop file"}
RWS=${RWS:-"randread randwrite"}
QDS=${QDS:-"1 32"}
ENGINES=${ENGINES:-"io_uring libaio psync"}
PART2=${PART2:-1}
mkdir -p "$(dirname "$OUT")"
: >"$OUT"

die() {
    echo "overhead.sh: $*" >&2
    exit 2
}
[ "$(id -u)" -eq 0 ] || die "needs root (losetup)"
command -v fio >/dev/null || die "fio not found (apt-get install fio; see .ci/apt/bench.txt)"
command -v losetup >/dev/null || die "losetup not found (util-linux)"
command -v python3 >/dev/null || die "python3 not found"
ncpu=$(nproc)
[ "$CORE" -lt "$ncpu" ] || die "CORE=$CORE but only $ncpu CPUs"

if [ -z "${NOBUILD:-}" ]; then
    cargo build --release -q -p ustor
fi
USTOR=${USTOR:-$root/target/release/ustor}
[ -x "$USTOR" ] || die "$USTOR missing (cargo build --release -p ustor)"

work=$(mktemp -d "$DIR/ustor-overhead.XXXXXX")
loopwork=$(mktemp -d "$LOOP_DIR/ustor-overhead.XXXXXX")
loopdev=""
cleanup() {
    set +e
    if [ -n "$loopdev" ]; then
        losetup -d "$loopdev"
    fi
    rm -rf "$work" "$loopwork"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Backing files, written in full so reads hit allocated extents (reads of
# holes or unwritten extents return zeroes without touching the disk).
mkfile() {
    dd if=/dev/zero of="$1" bs=1M count="$SIZE_MB" oflag=direct conv=fsync status=none
}
mkfile "$loopwork/loop.img"
mkfile "$work/file.img"
loopdev=$(losetup --direct-io=on --show -f "$loopwork/loop.img")
[ "$(cat /sys/block/"$(basename "$loopdev")"/loop/dio)" = 1 ] || die "$loopdev: direct I/O not on"

# Appends one JSON line {target, engine, rw, qd, rep, iops, lat_mean_us,
# lat_p99_us, cpu_ns_per_io} to $OUT from a tool's JSON output on stdin.
record_py=$(
    cat <<'EOF'
import json, sys
target, engine, rw, qd, rep, kind = sys.argv[1:7]
raw = sys.stdin.read()
d = json.loads(raw[raw.index("{"):])
if kind == "fio":
    j = d["jobs"][0]
    side = j["read"] if rw.endswith("read") else j["write"]
    ios = j["read"]["total_ios"] + j["write"]["total_ios"]
    runtime_ns = j["job_runtime"] * 1e6
    cpu = (j["usr_cpu"] + j["sys_cpu"]) / 100.0 * runtime_ns
    row = dict(iops=side["iops"], lat_mean_us=side["lat_ns"]["mean"] / 1e3,
               lat_p99_us=side["lat_ns"]["percentile"]["99.000000"] / 1e3,
               cpu_ns_per_io=cpu / max(ios, 1), errors=j["error"])
else:
    t = d["total"]
    row = dict(iops=t["iops"], lat_mean_us=t["lat_avg_us"], lat_p99_us=t["lat_p99_us"],
               cpu_ns_per_io=d["cpu_ns_per_io"], errors=t["errors"] + t["verify_errors"],
               cores=d["cores"])
row.update(target=target, engine=engine, rw=rw, qd=int(qd), rep=int(rep))
print(json.dumps(row))
EOF
)
record() { # target engine rw qd rep kind(fio|ustor); the tool's JSON on stdin
    python3 -c "$record_py" "$@" >>"$OUT"
}

run_fio() { # target path engine rw qd rep
    local target=$1 path=$2 engine=$3 rw=$4 qd=$5 rep=$6
    fio --name=overhead --filename="$path" --ioengine="$engine" --rw="$rw" --bs=4k \
        --iodepth="$qd" --direct=1 --thread --time_based --runtime="$RUNTIME" \
        --cpus_allowed="$CORE" --lat_percentiles=1 --randrepeat=0 --norandommap \
        --output-format=json |
        record "$target" "fio-$engine" "$rw" "$qd" "$rep" fio
}

run_ustor() { # target bdevspec mode rw qd rep
    local target=$1 spec=$2 mode=$3 rw=$4 qd=$5 rep=$6
    "$USTOR" bench -b "$spec" -w "$rw" --bs 4K --qd "$qd" -t "$RUNTIME" \
        --cores "$CORE" --poll-mode "$mode" --json |
        record "$target" "ustor-$mode" "$rw" "$qd" "$rep" ustor
}

echo "# overhead.sh: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $ncpu CPUs, $(lscpu | sed -n 's/^Model name: *//p'), kernel $(uname -r)"
echo "# RUNTIME=$RUNTIME REPEAT=$REPEAT CORE=$CORE loop=$loopdev (file $loopwork/loop.img on $(findmnt -n -o FSTYPE --target "$loopwork" | head -1), dio) file=$work/file.img ($(findmnt -n -o FSTYPE --target "$work"))"
echo "# fio $(fio --version | sed 's/fio-//'); raw results: $OUT"
nmodes=$(wc -w <<<"$USTOR_MODES")
echo "# running $(( (4 * (5 + 2 * nmodes) + 4) * REPEAT )) points of ${RUNTIME}s each..." >&2

for target in $TARGETS; do
    if [ "$target" = loop ]; then path=$loopdev; else path=$work/file.img; fi
    for rw in $RWS; do
        for qd in $QDS; do
            for rep in $(seq 1 "$REPEAT"); do
                # Peers back to back, in the same repeat.
                for engine in $ENGINES; do
                    if [ "$engine" = psync ] && [ "$qd" != 1 ]; then continue; fi
                    run_fio "$target" "$path" "$engine" "$rw" "$qd" "$rep"
                done
                for mode in $USTOR_MODES; do
                    run_ustor "$target" "uring:$path" "$mode" "$rw" "$qd" "$rep"
                done
            done
        done
    done
done
[ "$PART2" = 0 ] || for spec in null:1G "malloc:$MALLOC"; do
    for qd in 1 128; do
        for rep in $(seq 1 "$REPEAT"); do
            run_ustor "${spec%%:*}" "$spec" poll randread "$qd" "$rep"
        done
    done
done

python3 - "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
pts = {}
for r in rows:
    pts.setdefault((r["target"], r["rw"], r["qd"], r["engine"]), []).append(r)
def med(rs, k):
    return statistics.median(r[k] for r in rs)
def spread(rs):
    v = [r["iops"] for r in rs]
    m = statistics.median(v)
    return "" if len(v) < 2 or m == 0 else f" ±{100 * (max(v) - min(v)) / 2 / m:.0f}%"

print(f"\n## fio vs ustor uring bdev, 4 KiB, core pinned (medians of {max(r['rep'] for r in rows)})")
print("| target | workload | QD | engine | IOPS | mean lat µs | p99 lat µs | CPU ns/I/O | IOPS / fio-io_uring |")
print("|---|---|---|---|---|---|---|---|---|")
cost = []
for target in ("loop", "file"):
    for rw in ("randread", "randwrite"):
        for qd in (1, 32):
            keys = [k for k in pts if k[:3] == (target, rw, qd)]
            base = pts.get((target, rw, qd, "fio-io_uring"))
            order = ["fio-io_uring", "fio-libaio", "fio-psync"]
            keys.sort(key=lambda k: (order.index(k[3]) if k[3] in order else 9, k[3]))
            for k in keys:
                rs = pts[k]
                ratio = f"{med(rs, 'iops') / med(base, 'iops'):.2f}" if base else "-"
                err = " (ERRORS)" if any(r["errors"] for r in rs) else ""
                print(f"| {target} | {rw} | {qd} | {k[3]}{err} | {med(rs, 'iops') / 1e3:.1f} K{spread(rs)} | "
                      f"{med(rs, 'lat_mean_us'):.1f} | {med(rs, 'lat_p99_us'):.1f} | "
                      f"{med(rs, 'cpu_ns_per_io'):.0f} | {ratio} |")
                if qd == 1 and base and k[3].startswith("ustor"):
                    cost.append((target, rw, k[3], med(rs, "lat_mean_us") - med(base, "lat_mean_us")))
print("\n## stack cost per I/O at QD1 (ustor mean latency - fio io_uring mean latency; negative: ustor faster)")
print("| target | workload | ustor mode | µs |")
print("|---|---|---|---|")
for t, rw, e, d in cost:
    print(f"| {t} | {rw} | {e} | {d:+.2f} |")

print("\n## ustor bench on null and malloc, randread 4 KiB, 1 core, poll mode")
print("| bdev | QD | IOPS per core | wall ns per I/O | CPU ns per I/O | mean lat µs |")
print("|---|---|---|---|---|---|")
for target in ("null", "malloc"):
    for qd in (1, 128):
        rs = pts.get((target, "randread", qd, "ustor-poll"))
        if not rs:
            continue
        iops = med(rs, "iops") / rs[0]["cores"]
        print(f"| {target} | {qd} | {iops / 1e6:.2f} M{spread(rs)} | {1e9 / iops:.0f} | "
              f"{med(rs, 'cpu_ns_per_io'):.0f} | {med(rs, 'lat_mean_us'):.3f} |")
EOF
