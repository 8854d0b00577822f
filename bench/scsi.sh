#!/usr/bin/env bash
# ustor's iSCSI initiator (SCSI bdev over the iSCSI LLD, driven by
# `ustor bench` inside the reactor) against libiscsi's iscsi-perf, on the
# same tgtd LUN (a file in /dev/shm), 4 KiB random I/O at QD1 and QD32.
#
# One tgtd for the whole run, pinned to TGT_CORE; both initiators pinned to
# INIT_CORE. Peers alternate inside each round (ustor, then iscsi-perf, per
# workload) and each cell reports the median of REPEAT runs and the IOPS
# spread (min-max), because the machine is shared and noisy.
#
# What each side reports: `ustor bench --json` gives IOPS and completion
# latency (mean, p99, from the TSC). iscsi-perf only READs and prints only
# an average IOPS: its mean latency is derived by Little's law for a closed
# loop (QD / IOPS), it has no p99, and it has no randwrite row.
#
# Usage: bench/scsi.sh   (env: REPEAT=3 RUNTIME=5 SIZE_MIB=512 INIT_CORE=0
#                         TGT_CORE=1 POLL=adaptive RWS="randread randwrite"
#                         QDS="1 32" OUT=/tmp/ustor-bench-scsi)
set -euo pipefail
cd "$(dirname "$0")/.."

REPEAT=${REPEAT:-3}
RUNTIME=${RUNTIME:-5}
SIZE_MIB=${SIZE_MIB:-512}
INIT_CORE=${INIT_CORE:-0}
TGT_CORE=${TGT_CORE:-1}
POLL=${POLL:-adaptive}
RWS=${RWS:-"randread randwrite"}
QDS=${QDS:-"1 32"}
OUT=${OUT:-/tmp/ustor-bench-scsi}
IQN=iqn.2024-01.io.ustor:bench
mkdir -p "$OUT"
for t in tgtd tgtadm iscsi-perf python3 taskset; do
  command -v "$t" >/dev/null || { echo "missing $t (apt-get install -y tgt libiscsi-bin)" >&2; exit 1; }
done

cargo build --release -q -p ustor
BIN=target/release/ustor

. bench/lib/tgtd.sh
trap tgtd_stop EXIT
tgtd_start /dev/shm/ustor-bench-scsi.img "$SIZE_MIB" "$IQN" "$OUT/tgtd.log" taskset -c "$TGT_CORE"

cat >"$OUT/config.json" <<EOF
{"subsystems":[{"subsystem":"scsi","config":[
 {"method":"scsi_iscsi_attach_host","params":{"portal":"127.0.0.1:$PORT","target":"$IQN","queue_depth":64}},
 {"method":"bdev_scsi_create","params":{"name":"iscsi0","device":"sda"}}]}]}
EOF

RESULTS="$OUT/results.tsv"
printf 'round\tpeer\trw\tqd\tiops\tlat_mean_us\tlat_p99_us\n' >"$RESULTS"

run_ustor() { # round rw qd
  local json="$OUT/ustor-$2-qd$3-r$1.json"
  taskset -c "$INIT_CORE" "$BIN" bench -c "$OUT/config.json" -b iscsi0 -w "$2" --bs 4K -q "$3" \
    -t "$RUNTIME" --cores "$INIT_CORE" --poll-mode "$POLL" --json >"$json" 2>"$OUT/ustor.err"
  python3 - "$json" "$@" >>"$RESULTS" <<'PY'
import json, sys
path, rnd, rw, qd = sys.argv[1:]
t = json.load(open(path))["total"]
print(f"{rnd}\tustor\t{rw}\t{qd}\t{t['iops']:.0f}\t{t['lat_avg_us']:.1f}\t{t['lat_p99_us']:.1f}")
PY
}

run_perf() { # round rw qd
  [ "$2" = randread ] || return 0
  local log="$OUT/iscsi-perf-$2-qd$3-r$1.log"
  taskset -c "$INIT_CORE" iscsi-perf -m "$3" -b 8 -r -t "$RUNTIME" \
    "iscsi://127.0.0.1:$PORT/$IQN/1" >"$log" 2>&1
  python3 - "$log" "$@" >>"$RESULTS" <<'PY'
import re, sys
path, rnd, rw, qd = sys.argv[1:]
m = re.findall(r"iops average (\d+)", open(path, errors="replace").read())
iops = float(m[-1]) if m else 0.0
# Closed loop: mean latency = in flight / throughput.
mean = int(qd) * 1e6 / iops if iops else 0.0
print(f"{rnd}\tiscsi-perf\t{rw}\t{qd}\t{iops:.0f}\t{mean:.1f}\tnan")
PY
}

LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
for r in $(seq "$REPEAT"); do
  for rw in $RWS; do
    for qd in $QDS; do
      run_ustor "$r" "$rw" "$qd"
      run_perf "$r" "$rw" "$qd"
    done
  done
done

echo "$(date -u +%Y-%m-%dT%H:%MZ) $(nproc) CPUs $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(uname -r)"
echo "REPEAT=$REPEAT RUNTIME=$RUNTIME SIZE_MIB=$SIZE_MIB INIT_CORE=$INIT_CORE TGT_CORE=$TGT_CORE POLL=$POLL; load at start: $LOAD0, at end: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$RESULTS" <<'PY'
import sys, csv, math, statistics as st
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
cells = {}
for r in rows:
    cells.setdefault((r["rw"], int(r["qd"]), r["peer"]), []).append(r)
med = lambda rs, k: st.median(float(x[k]) for x in rs)
fmt = lambda v: "n/a" if math.isnan(v) else f"{v:.1f}"
print(f"{'workload':<16}{'peer':<12}{'IOPS':>9}{'(min-max)':>17}{'mean us':>9}{'p99 us':>9}")
for (rw, qd, peer), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "ustor")):
    lo, hi = min(float(x["iops"]) for x in rs), max(float(x["iops"]) for x in rs)
    print(f"{rw+' qd'+str(qd):<16}{peer:<12}{med(rs,'iops'):>9.0f}{f'({lo:.0f}-{hi:.0f})':>17}"
          f"{fmt(med(rs,'lat_mean_us')):>9}{fmt(med(rs,'lat_p99_us')):>9}")
print()
print(f"{'workload':<16}{'IOPS x':>8}{'mean lat x':>12}")
for (rw, qd) in sorted({(k[0], k[1]) for k in cells}):
    u, p = cells.get((rw, qd, "ustor")), cells.get((rw, qd, "iscsi-perf"))
    if u and p:
        print(f"{rw+' qd'+str(qd):<16}{med(u,'iops')/med(p,'iops'):>8.2f}"
              f"{med(u,'lat_mean_us')/med(p,'lat_mean_us'):>12.2f}")
    else:
        print(f"{rw+' qd'+str(qd):<16}{'n/a':>8}{'n/a':>12}   (iscsi-perf only reads)")
print("x = ustor / iscsi-perf (IOPS > 1 and latency < 1 favour ustor).")
PY
