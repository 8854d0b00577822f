#!/usr/bin/env bash
# The kernel's polled device mapper against ustor's polled composite bdevs
# (issue 21, part 2), on the same two emulated NVMe disks in the same
# QEMU/TCG guest, in one run. The guest (tests/guest/dm-poll-bench.sh,
# booted by the ignored test crates/ustor/tests/dm_poll_bench.rs) loads the
# NVMe driver with poll queues, builds dm-linear and dm-stripe (64 KiB
# chunks) over the two disks, checks that io_poll is on everywhere and that
# ustor's uring bdevs really use IOPOLL, then per round (alternating which
# side goes first) runs 4 KiB random reads at each queue depth:
#   fio-poll  fio io_uring --hipri on the DM device     (the kernel, polled)
#   fio-irq   fio io_uring without hipri                (the kernel, interrupts)
#   kdm-poll  `ustor bench` on an IOPOLL uring bdev over the DM device
#             (same tool as the next row: only the composite layer differs)
#   ustor     `ustor bench` on concat / raid0 over two IOPOLL uring bdevs
# Reported: median IOPS, mean and p99 latency, guest CPU time per I/O, and
# per-round paired ratios of ustor against fio-poll and kdm-poll. Goal of
# the issue: ustor's latency <= the kernel's polled DM at QD1 and its IOPS
# >= at QD32. TCG inflates every absolute number; the ratios on the same
# guest are the result.
#
# Usage: bench/dm-poll.sh  (env: ROUNDS=3 RUNTIME=5 QDS="1 32"
#   LAYOUTS="linear stripe" DISK_MIB=256 OUT=/tmp/ustor-bench-dm-poll
#   RESULTS_DIR=bench/results NOBUILD=1 USTOR=path)
set -euo pipefail
cd "$(dirname "$0")/.."

export ROUNDS=${ROUNDS:-3}
export RUNTIME=${RUNTIME:-5}
export QDS=${QDS:-"1 32"}
export LAYOUTS=${LAYOUTS:-"linear stripe"}
DISK_MIB=${DISK_MIB:-256}
OUT=${OUT:-/tmp/ustor-bench-dm-poll}
RESULTS_DIR=${RESULTS_DIR:-bench/results}
NPOINTS=$(($(wc -w <<<"$QDS") * $(wc -w <<<"$LAYOUTS") * 4))
export GUEST_TIMEOUT_S=${GUEST_TIMEOUT_S:-$((240 + ROUNDS * NPOINTS * (RUNTIME + 6)))}
mkdir -p "$OUT" "$RESULTS_DIR"

[ -n "${NOBUILD:-}" ] || cargo build --release -q -p ustor
BIN=${USTOR:-$PWD/target/release/ustor}
cargo test -q -p ustor --test dm_poll_bench --no-run
# Written once, so reads hit allocated blocks on both paths.
for d in 0 1; do
    dd if=/dev/urandom of="$OUT/nvme$d.img" bs=1M count="$DISK_MIB" status=none
done

STAMP=$(date -u +%Y%m%d-%H%M)
RAW="$RESULTS_DIR/dm-poll-$STAMP.txt"
GUEST_LOG="$OUT/guest-$STAMP.log"
. bench/lib/guest.sh
DM_POLL_DISKS="$OUT/nvme0.img,$OUT/nvme1.img" USTOR_BIN=$BIN DM_POLL_LOG=$GUEST_LOG \
    guest_runner "$OUT" -q -p ustor --test dm_poll_bench || exit 1
{
    guest_raw_header dm-poll.sh \
        "ustor $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo '+dirty')" \
        "ROUNDS=$ROUNDS RUNTIME=$RUNTIME QDS=$QDS LAYOUTS=$LAYOUTS DISK_MIB=$DISK_MIB"
    echo
    grep -a -E '^(DMPOLL |USTOR-KV )' "$GUEST_LOG" | sed 's/^/  /'
    echo
    python3 - "$GUEST_LOG" <<'EOF'
import json, statistics, sys

TICK_US = 10_000  # USER_HZ = 100
rows = {}
for line in open(sys.argv[1], errors="replace"):
    if not line.startswith("DMPOLL "):
        continue
    _, rnd, layout, path, qd, ticks, js = line.rstrip("\n").split(" ", 6)
    d = json.loads(js)
    if path.startswith("fio"):
        r = d["jobs"][0]["read"]
        iops, ios = r["iops"], r["total_ios"]
        lat = r["lat_ns"]["mean"] / 1000
        p99 = r["clat_ns"]["percentile"]["99.000000"] / 1000
    else:
        t = d["total"]
        iops, ios, lat, p99 = t["iops"], t["ios"], t["lat_avg_us"], t["lat_p99_us"]
        assert t["errors"] == 0, line
    cpu = int(ticks) * TICK_US / ios if ios else float("nan")
    rows.setdefault((layout, int(qd), path), {})[int(rnd)] = (iops, lat, p99, cpu)

med = statistics.median
paths = ["fio-poll", "fio-irq", "kdm-poll", "ustor"]
print("## 4 KiB randread, medians over rounds (guest CPU per I/O: busy time of both vCPUs / I/Os)")
print("| layout | QD | path | IOPS | mean lat µs | p99 µs | guest CPU µs/I/O |")
print("|---|---|---|---:|---:|---:|---:|")
keys = sorted({(l, q) for (l, q, _) in rows})
for l, q in keys:
    for p in paths:
        v = list(rows.get((l, q, p), {}).values())
        if not v:
            continue
        print("| %s | %d | %s | %.0f | %.1f | %.1f | %.1f |" % (
            l, q, p, med(x[0] for x in v), med(x[1] for x in v), med(x[2] for x in v),
            med(x[3] for x in v)))
print()
print("## ustor against the kernel's polled DM: per-round paired ratios, median (min-max)")
print("| layout | QD | vs | IOPS ratio | mean latency ratio | CPU/I/O ratio |")
print("|---|---|---|---|---|---|")
for l, q in keys:
    u = rows.get((l, q, "ustor"), {})
    for p in ["fio-poll", "kdm-poll"]:
        k = rows.get((l, q, p), {})
        common = sorted(set(u) & set(k))
        if not common:
            continue
        cols = []
        for i in range(4):
            if i == 2:
                continue
            rs = [u[r][i] / k[r][i] for r in common]
            cols.append("%.2f (%.2f-%.2f)" % (med(rs), min(rs), max(rs)))
        print("| %s | %d | %s | %s |" % (l, q, p, " | ".join(cols)))
EOF
} | tee "$RAW"
echo "raw + summary: $RAW"
