#!/usr/bin/env bash
# The kernel's virtio_scsi + sd path against ustor's virtio-scsi LLD over
# VFIO, on the same virtio-scsi disk in the same QEMU/TCG guest (q35 with an
# emulated Intel IOMMU): the HwPerfIO comparison of issue 24. The guest
# (tests/guest/scsi-vfio-bench.sh, booted by the ignored test
# crates/ustor/tests/scsi_vfio_bench.rs) rebinds the HBA between virtio-pci
# and vfio-pci each round, alternating which path goes first, and runs the
# same `ustor bench` workloads on both (the kernel path through io_uring with
# O_DIRECT on /dev/sdX, and at QD1 also fio with the psync and io_uring
# engines, the study's tool). 4 KiB random reads and writes at QD1 and QD32.
# Reported: median IOPS, mean and p99 latency, guest CPU time per I/O, and
# ustor/kernel ratios. TCG inflates every absolute number; the ratio on the
# same guest is the result. With MPT=1 (the default) the guest also has an
# LSI SAS1068 (mptsas1068) with a disk of the same size, measured through
# ustor's MPT Fusion LLD right after the virtio-scsi LLD in each round
# (path "mptsas"; there is no kernel path for it here: Linux's mptsas does
# not show the emulated disk).
#
# Usage: bench/scsi-vfio.sh  (env: ROUNDS=3 RUNTIME=5 POLL=poll
#   WORKLOADS="randread:1 randwrite:1 randread:32 randwrite:32"
#   MPT=1 PROFILE=release OUT=/tmp/ustor-bench-scsi-vfio RESULTS_DIR=bench/results)
set -euo pipefail
cd "$(dirname "$0")/.."

export ROUNDS=${ROUNDS:-3}
export RUNTIME=${RUNTIME:-5}
# Busy polling for the latency comparison; adaptive mode works too (the
# LLDs' MSI-X/MSI wakes a sleeping reactor; Run 4 of RESULTS-scsi-vfio.md).
export POLL=${POLL:-poll}
export WORKLOADS=${WORKLOADS:-"randread:1 randwrite:1 randread:32 randwrite:32"}
PROFILE=${PROFILE:-release}
OUT=${OUT:-/tmp/ustor-bench-scsi-vfio}
RESULTS_DIR=${RESULTS_DIR:-bench/results}
NRUNS=$(wc -w <<<"$WORKLOADS")
export GUEST_TIMEOUT_S=${GUEST_TIMEOUT_S:-$((240 + ROUNDS * 3 * NRUNS * (RUNTIME + 10)))}
mkdir -p "$OUT" "$RESULTS_DIR"

command -v fio >/dev/null || { echo "missing fio (apt-get install -y fio): the guest runs the host's" >&2; exit 1; }
cargo build --profile "$PROFILE" -q -p ustor
DIR=$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")
BIN=$PWD/target/$DIR/ustor
cargo test --profile "$PROFILE" -q -p ustor --test scsi_vfio_bench --no-run
DISK=$OUT/disk.img
rm -f "$DISK"
truncate -s 64M "$DISK"
if [ "${MPT:-1}" = 1 ]; then
  export SCSI_VFIO_MPT_DISK=$OUT/mpt.img
  rm -f "$SCSI_VFIO_MPT_DISK"
  truncate -s 64M "$SCSI_VFIO_MPT_DISK"
fi

STAMP=$(date -u +%Y%m%d-%H%M)
RAW="$RESULTS_DIR/scsi-vfio-$STAMP.txt"
GUEST_LOG="$OUT/guest-$STAMP.log"
. bench/lib/guest.sh
SCSI_VFIO_DISK=$DISK USTOR_BIN=$BIN SCSI_VFIO_LOG=$GUEST_LOG \
  guest_runner "$OUT" --profile "$PROFILE" -q -p ustor --test scsi_vfio_bench || exit 1
{
  guest_raw_header scsi-vfio.sh "ROUNDS=$ROUNDS RUNTIME=$RUNTIME POLL=$POLL PROFILE=$PROFILE WORKLOADS=$WORKLOADS"
  guest_raw_log
} >"$RAW"

python3 - "$GUEST_LOG" <<'PY' | tee -a "$RAW"
import json, re, statistics as st, sys
runs = {}


def from_fio(js, rw):
    """fio's JSON as ustor bench's `total` keys."""
    j = json.loads(js)["jobs"][0]
    d = j["write" if "write" in rw else "read"]
    return {"iops": d["iops"], "ios": d["total_ios"], "errors": j.get("error", 0),
            "lat_avg_us": d["lat_ns"]["mean"] / 1000,
            "lat_p99_us": d["clat_ns"]["percentile"]["99.000000"] / 1000}


for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"USTOR-(BENCH|FIO) (\d+) (\w+) (\w+) (\d+) (\d+) (\{.*\})\s*$", line)
    if not m:
        continue
    tool, rnd, path, rw, qd, ticks, js = m.groups()
    try:
        t = json.loads(js)["total"] if tool == "BENCH" else from_fio(js, rw)
    except (ValueError, KeyError, IndexError):
        continue
    path = path if tool == "BENCH" else "fio-" + path
    if t.get("errors"):
        print(f"warning: round {rnd} {path} {rw} qd{qd}: {t['errors']} errors")
    # USER_HZ = 100: one tick is 10 ms of guest CPU.
    t["cpu_us_per_io"] = int(ticks) * 10000 / max(t["ios"], 1)
    runs.setdefault((rw, int(qd), path), []).append(t)
med = lambda rs, k: st.median(x[k] for x in rs)
cells = sorted({(r, q) for (r, q, _) in runs})
print("medians over rounds; latency from ustor bench (per I/O); CPU = guest busy time per I/O")
print("(kernel: ustor bench on uring:/dev/sdX; fio-psync, fio-io_uring: fio on the same disk;")
print(" fio's p99 is of completion latency)")
print(f"{'workload':<15}{'path':<13}{'n':>2}{'IOPS':>9}{'mean us':>10}{'p99 us':>10}{'CPU us/IO':>11}")
for c in cells:
    for p in ("kernel", "fio-psync", "fio-io_uring", "ustor", "mptsas"):
        rs = runs.get((*c, p))
        if rs:
            print(f"{c[0]+' qd'+str(c[1]):<15}{p:<13}{len(rs):>2}{med(rs,'iops'):>9.0f}"
                  f"{med(rs,'lat_avg_us'):>10.1f}{med(rs,'lat_p99_us'):>10.1f}{med(rs,'cpu_us_per_io'):>11.1f}")
goal = {("randread", 1): "-24 %", ("randwrite", 1): "-30 %"}
print()
print("ustor vs kernel (medians): change = ustor/kernel - 1 (negative latency favours ustor)")
print(f"{'workload':<15}{'IOPS x':>8}{'mean lat':>10}{'p99 lat':>10}{'CPU/IO':>10}{'goal':>8}")
for path in ("ustor", "mptsas"):
    if path == "mptsas" and any((*c, "mptsas") in runs for c in cells):
        print()
        print("ustor's MPT LLD (mptsas1068 disk) vs the kernel's virtio-scsi path (medians)")
    for c in cells:
        k, u = runs.get((*c, "kernel")), runs.get((*c, path))
        if not (k and u):
            continue
        d = lambda key: (med(u, key) / med(k, key) - 1) * 100
        print(f"{c[0]+' qd'+str(c[1]):<15}{med(u,'iops')/med(k,'iops'):>8.2f}{d('lat_avg_us'):>+9.1f}%"
              f"{d('lat_p99_us'):>+9.1f}%{d('cpu_us_per_io'):>+9.1f}%{goal.get(c, '') if path == 'ustor' else '':>8}")
for eng in ("psync", "io_uring"):
    ref = "fio-" + eng
    pairs = [c for c in cells if runs.get((*c, ref)) and runs.get((*c, "ustor"))]
    if not pairs:
        continue
    print()
    print(f"ustor vs the kernel path measured by fio ({eng}), medians")
    for c in pairs:
        k, u = runs[(*c, ref)], runs[(*c, "ustor")]
        d = lambda key: (med(u, key) / med(k, key) - 1) * 100
        print(f"{c[0]+' qd'+str(c[1]):<15}{med(u,'iops')/med(k,'iops'):>8.2f}{d('lat_avg_us'):>+9.1f}%"
              f"{d('lat_p99_us'):>+9.1f}%{d('cpu_us_per_io'):>+9.1f}%{goal.get(c, ''):>8}")
PY
echo "raw output: $RAW"
