#!/usr/bin/env bash
# NBD servers side by side through the same client (fio's nbd engine, i.e.
# libnbd): ustor (malloc bdev, example server crates/nbd/examples/nbd_server.rs)
# in its default adaptive poll mode and in interrupt mode,
# qemu-storage-daemon (raw file in /dev/shm) and nbdkit's memory plugin.
# 4 KiB randread/randwrite at QD1 and QD32, 1 and 4 connections.
#
# Every server runs for the whole benchmark, pinned to the same core(s);
# the workloads are interleaved (round r runs every workload on every
# server) and each cell reports the median of ROUNDS runs and the spread
# (min-max IOPS), because the machines this runs on are shared and noisy.
# fio runs on the cores the servers do not use (CLIENT_CORES), as a remote
# client would: left unpinned, the scheduler puts fio on the server's core
# whenever that server sleeps, and a sleeping server then gets same-core
# wakeups that a real network client never gives it.
# Reports IOPS, mean and p99 total latency (fio's lat: submission + completion;
# with the nbd engine a third of the round trip lands in slat, so clat alone
# understates it unevenly between servers) and the CPU time each server
# spent per I/O (from /proc/PID/stat, all its threads) and fio's own CPU per
# I/O (the client's cost: when it is the larger one, the client sets the
# ceiling), then per workload the best ustor mode against the best peer.
#
# Usage: bench/nbd.sh   (env: ROUNDS=3 RUNTIME=3 SIZE_MIB=1024 CORES=0 CLIENT_CORES=<the others> NICE=-20
#                        SERVERS="ustor ustor-int qsd nbdkit" RWS QDS CONNS)
# Before/after: BASE_BIN=<an older nbd_server build> and add "base base-int"
# to SERVERS; those rows are printed but left out of the summary.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-3}
SIZE_MIB=${SIZE_MIB:-1024}
CORES=${CORES:-0}
# Every CPU not in CORES (CORES is a taskset -c list).
CLIENT_CORES=${CLIENT_CORES:-$(python3 -c '
import os, sys
used = set()
for part in sys.argv[1].split(","):
    a, _, b = part.partition("-")
    used.update(range(int(a), int(b or a) + 1))
rest = sorted(set(os.sched_getaffinity(0)) - used)
print(",".join(map(str, rest)) if rest else sys.argv[1])' "$CORES")}
SERVERS=${SERVERS:-"ustor ustor-int qsd nbdkit"}
RWS=${RWS:-"randread randwrite"}
QDS=${QDS:-"1 32"}
CONNS=${CONNS:-"1 4"}
OUT=${OUT:-/tmp/ustor-bench-nbd}
# Servers and fio run at this nice level: on a shared machine other
# processes' threads would otherwise take a share of the server core that
# grows with the server's thread count (nbdkit runs 16 threads, qsd a pool).
NICE=${NICE:--20}
RUN=(nice -n "$NICE")
mkdir -p "$OUT"
for t in fio qemu-storage-daemon nbdkit python3; do
  command -v "$t" >/dev/null || { echo "missing $t (apt-get install -y \$(cat .ci/apt/nbd.txt))" >&2; exit 1; }
done

cargo build --release -q -p ustor-nbd --example nbd_server
BIN=target/release/examples/nbd_server

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }

declare -A PID URI
cleanup() { for p in "${PID[@]}"; do kill -CONT "$p" 2>/dev/null; kill "$p" 2>/dev/null || true; done; rm -f /dev/shm/ustor-bench-qsd.img; }
trap cleanup EXIT

start_ustor() { # name poll-mode [binary]
  local port; port=$(free_port)
  "${RUN[@]}" taskset -c "$CORES" "${3:-$BIN}" --cores "$CORES" --port "$port" --size-mib "$SIZE_MIB" --poll-mode "$2" >"$OUT/$1.log" 2>&1 &
  PID[$1]=$!; wait_port "$port"; URI[$1]="nbd://127.0.0.1:$port/malloc"
}
start_qsd() {
  local port; port=$(free_port)
  truncate -s "${SIZE_MIB}M" /dev/shm/ustor-bench-qsd.img
  "${RUN[@]}" taskset -c "$CORES" qemu-storage-daemon \
    --blockdev driver=file,node-name=file0,filename=/dev/shm/ustor-bench-qsd.img,aio=threads \
    --blockdev driver=raw,node-name=disk,file=file0 \
    --nbd-server addr.type=inet,addr.host=127.0.0.1,addr.port="$port",max-connections=16 \
    --export type=nbd,id=exp0,node-name=disk,name=qsd,writable=on >"$OUT/qsd.log" 2>&1 &
  PID[qsd]=$!; wait_port "$port"; URI[qsd]="nbd://127.0.0.1:$port/qsd"
}
start_nbdkit() {
  local port; port=$(free_port)
  "${RUN[@]}" taskset -c "$CORES" nbdkit -f -p "$port" -i 127.0.0.1 memory "${SIZE_MIB}M" >"$OUT/nbdkit.log" 2>&1 &
  PID[nbdkit]=$!; wait_port "$port"; URI[nbdkit]="nbd://127.0.0.1:$port/"
}

for s in $SERVERS; do
  case $s in
    ustor) start_ustor ustor adaptive ;;
    ustor-int) start_ustor ustor-int interrupt ;;
    ustor-poll) start_ustor ustor-poll poll ;;
    base) start_ustor base adaptive "$BASE_BIN" ;;
    base-int) start_ustor base-int interrupt "$BASE_BIN" ;;
    qsd) start_qsd ;;
    nbdkit) start_nbdkit ;;
    *) echo "unknown server $s" >&2; exit 1 ;;
  esac
done

RESULTS="$OUT/results.tsv"
printf 'round\tserver\trw\tqd\tconns\tiops\tlat_mean_us\tlat_p99_us\tcpu_us_per_io\tclient_cpu_us_per_io\n' >"$RESULTS"

# Only server $1 runs; the others are stopped (bench/lib/only.sh).
. bench/lib/only.sh
only() { only_run "$1" $SERVERS; }

run_one() { # round server rw qd conns
  local json="$OUT/$2-$3-qd$4-c$5-r$1.json" before after pid=${PID[$2]}
  only "$2"
  before=$(cpu_ticks "$pid")
  "${RUN[@]}" taskset -c "$CLIENT_CORES" fio --name=b --ioengine=nbd --uri="${URI[$2]}" --rw="$3" --bs=4k --iodepth="$4" --numjobs="$5" \
      --size=$((SIZE_MIB / 4))m --offset_increment=$((SIZE_MIB / 4))m --time_based --runtime="$RUNTIME" \
      --ramp_time=1 --lat_percentiles=1 --group_reporting --output-format=json >"$json"
  after=$(cpu_ticks "$pid")
  python3 - "$json" "$@" "$RUNTIME" "$((after - before))" "$(getconf CLK_TCK)" >>"$RESULTS" <<'PY'
import json, sys
path, rnd, server, rw, qd, conns, runtime, ticks, hz = sys.argv[1:]
text = open(path).read()
# fio's nbd engine prints a line before the JSON document.
job = json.loads(text[text.index("{"):])["jobs"][0]
side = job["read"] if rw.endswith("read") else job["write"]
iops = side["iops"]
lat = side["lat_ns"]
p99 = lat.get("percentile", {}).get("99.000000", 0) / 1000
# CPU ticks cover the ramp second too; scale the I/O count by that window.
cpu_us = int(ticks) / int(hz) * 1e6
window_ios = iops * (float(runtime) + 1)
# fio's own CPU (all jobs, % of one CPU over the run): the client's cost.
client_us = (job["usr_cpu"] + job["sys_cpu"]) / 100 * int(conns) * 1e6 / max(iops, 1)
print(f"{rnd}\t{server}\t{rw}\t{qd}\t{conns}\t{iops:.0f}\t{lat['mean']/1000:.1f}\t{p99:.1f}"
      f"\t{cpu_us / max(window_ios, 1):.2f}\t{client_us:.2f}")
PY
}

for r in $(seq "$ROUNDS"); do
  for rw in $RWS; do
    for qd in $QDS; do
      for conns in $CONNS; do
        for s in $SERVERS; do
          run_one "$r" "$s" "$rw" "$qd" "$conns"
        done
      done
    done
  done
done

echo "$(date -u +%Y-%m-%dT%H:%MZ) $(nproc) CPUs, $(uname -r); ROUNDS=$ROUNDS RUNTIME=$RUNTIME CORES=$CORES CLIENT_CORES=$CLIENT_CORES NICE=$NICE; load: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$RESULTS" <<'PY'
import sys, csv, statistics as st
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
cells = {}
for r in rows:
    cells.setdefault((r["rw"], int(r["qd"]), int(r["conns"]), r["server"]), []).append(r)
med = lambda rs, k: st.median(float(x[k]) for x in rs)
print(f"{'workload':<20}{'server':<11}{'IOPS':>9}{'(min-max)':>17}{'mean us':>9}{'p99 us':>9}{'CPU us/IO':>10}{'fio us/IO':>10}")
summary = []
for w in sorted({k[:3] for k in cells}):
    ws = {s: rs for (rw, qd, c, s), rs in cells.items() if (rw, qd, c) == w}
    for s, rs in sorted(ws.items(), key=lambda kv: -med(kv[1], "iops")):
        lo, hi = min(float(x["iops"]) for x in rs), max(float(x["iops"]) for x in rs)
        print(f"{w[0]+' qd'+str(w[1])+' x'+str(w[2]):<20}{s:<11}{med(rs,'iops'):>9.0f}{f'({lo:.0f}-{hi:.0f})':>17}"
              f"{med(rs,'lat_mean_us'):>9.1f}{med(rs,'lat_p99_us'):>9.1f}{med(rs,'cpu_us_per_io'):>10.2f}"
              f"{med(rs,'client_cpu_us_per_io'):>10.2f}")
    us = {s: rs for s, rs in ws.items() if s.startswith("ustor")}
    peers = {s: rs for s, rs in ws.items() if not s.startswith(("ustor", "base"))}
    if us and peers:
        bu = max(us, key=lambda s: med(us[s], "iops"))
        bp = max(peers, key=lambda s: med(peers[s], "iops"))
        summary.append((w, bu, bp,
                        med(us[bu], "iops") / med(peers[bp], "iops"),
                        med(us[bu], "lat_mean_us") / med(peers[bp], "lat_mean_us"),
                        med(us[bu], "cpu_us_per_io") / med(peers[bp], "cpu_us_per_io")))
print()
print(f"{'workload':<20}{'best ustor':<11}{'best peer':<10}{'IOPS x':>8}{'mean lat x':>11}{'CPU/IO x':>10}")
for w, bu, bp, ix, lx, cx in summary:
    print(f"{w[0]+' qd'+str(w[1])+' x'+str(w[2]):<20}{bu:<11}{bp:<10}{ix:>8.2f}{lx:>11.2f}{cx:>10.2f}")
print("x = best ustor / best peer (IOPS > 1, latency and CPU < 1 favour ustor).")
# Issue 5's goals, per workload, checked for every ustor mode: at QD1 a
# lower mean latency than the lowest-latency peer with less server CPU per
# I/O than it; at QD32 at least 1.5x the best peer's IOPS with less CPU.
print()
print(f"{'workload':<20}goal")
for w in sorted({k[:3] for k in cells}):
    ws = {s: rs for (rw, qd, c, s), rs in cells.items() if (rw, qd, c) == w}
    us = {s: rs for s, rs in ws.items() if s.startswith("ustor")}
    peers = {s: rs for s, rs in ws.items() if not s.startswith(("ustor", "base"))}
    if not us or not peers:
        continue
    name = f"{w[0]} qd{w[1]} x{w[2]}"
    if w[1] == 1:
        bp = min(peers, key=lambda s: med(peers[s], "lat_mean_us"))
        ok = [s for s in us if med(us[s], "lat_mean_us") < med(peers[bp], "lat_mean_us")
              and med(us[s], "cpu_us_per_io") < med(peers[bp], "cpu_us_per_io")]
        what = f"lower latency and CPU/IO than {bp}"
    else:
        bp = max(peers, key=lambda s: med(peers[s], "iops"))
        ok = [s for s in us if med(us[s], "iops") >= 1.5 * med(peers[bp], "iops")
              and med(us[s], "cpu_us_per_io") < med(peers[bp], "cpu_us_per_io")]
        what = f">= 1.5x the IOPS of {bp} with less CPU/IO"
    print(f"{name:<20}{'met by ' + ', '.join(sorted(ok)) if ok else 'NOT met'}: {what}")
PY
