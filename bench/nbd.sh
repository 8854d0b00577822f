#!/usr/bin/env bash
# NBD servers side by side through the same client (fio's nbd engine):
# ustor (malloc bdev), qemu-storage-daemon (raw file in /dev/shm) and
# nbdkit's memory plugin. 4 KiB randread/randwrite at QD1 and QD32, 1 and 4
# connections. Reports IOPS, mean and p99 completion latency, and the CPU
# seconds each server spent per I/O (from /proc/PID/stat), with ratios.
#
# Usage: bench/nbd.sh            (RUNTIME=5 SIZE_MIB=1024 CORES=0 env knobs)
set -euo pipefail
cd "$(dirname "$0")/.."

RUNTIME=${RUNTIME:-5}
SIZE_MIB=${SIZE_MIB:-1024}
CORES=${CORES:-0}
OUT=${OUT:-/tmp/ustor-bench-nbd}
mkdir -p "$OUT"
for t in fio qemu-storage-daemon nbdkit python3; do
  command -v "$t" >/dev/null || { echo "missing $t (apt-get install -y \$(cat .ci/apt/nbd.txt))" >&2; exit 1; }
done

cargo build --release -q -p ustor-nbd --example nbd_server
BIN=target/release/examples/nbd_server

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -f /dev/shm/ustor-bench-qsd.img; }
trap cleanup EXIT

start_ustor() {
  local port; port=$(free_port)
  taskset -c "$CORES" "$BIN" --cores "$CORES" --port "$port" --size-mib "$SIZE_MIB" >"$OUT/ustor.log" 2>&1 &
  PID=$!; PIDS+=("$PID"); wait_port "$port"; URI="nbd://127.0.0.1:$port/malloc"
}
start_qsd() {
  local port; port=$(free_port)
  truncate -s "${SIZE_MIB}M" /dev/shm/ustor-bench-qsd.img
  taskset -c "$CORES" qemu-storage-daemon \
    --blockdev driver=file,node-name=file0,filename=/dev/shm/ustor-bench-qsd.img,aio=threads \
    --blockdev driver=raw,node-name=disk,file=file0 \
    --nbd-server addr.type=inet,addr.host=127.0.0.1,addr.port="$port",max-connections=16 \
    --export type=nbd,id=exp0,node-name=disk,name=qsd,writable=on >"$OUT/qsd.log" 2>&1 &
  PID=$!; PIDS+=("$PID"); wait_port "$port"; URI="nbd://127.0.0.1:$port/qsd"
}
start_nbdkit() {
  local port; port=$(free_port)
  taskset -c "$CORES" nbdkit -f -p "$port" -i 127.0.0.1 memory "${SIZE_MIB}M" >"$OUT/nbdkit.log" 2>&1 &
  PID=$!; PIDS+=("$PID"); wait_port "$port"; URI="nbd://127.0.0.1:$port/"
}

RESULTS="$OUT/results.tsv"
printf 'server\trw\tqd\tconns\tiops\tlat_mean_us\tlat_p99_us\tcpu_us_per_io\n' >"$RESULTS"

run_one() { # server rw qd conns
  local json="$OUT/$1-$2-qd$3-c$4.json" before after
  before=$(cpu_ticks "$PID")
  fio --name=b --ioengine=nbd --uri="$URI" --rw="$2" --bs=4k --iodepth="$3" --numjobs="$4" \
      --size=$((SIZE_MIB / 4))m --offset_increment=$((SIZE_MIB / 4))m --time_based --runtime="$RUNTIME" \
      --ramp_time=1 --group_reporting --output-format=json >"$json"
  after=$(cpu_ticks "$PID")
  python3 - "$json" "$1" "$2" "$3" "$4" "$((after - before))" "$(getconf CLK_TCK)" >>"$RESULTS" <<'PY'
import json, sys
path, server, rw, qd, conns, ticks, hz = sys.argv[1:]
text = open(path).read()
# fio's nbd engine prints a line before the JSON document.
job = json.loads(text[text.index("{"):])["jobs"][0]
side = job["read"] if rw.endswith("read") else job["write"]
iops = side["iops"]
ios = side["total_ios"] or 1
lat = side["clat_ns"]
p99 = lat.get("percentile", {}).get("99.000000", 0) / 1000
# CPU ticks cover ramp time too; scale I/O count by the same window.
runtime_ms = job["job_runtime"] or 1
cpu_us = int(ticks) / int(hz) * 1e6
window_ios = iops * (runtime_ms / 1000 + 1)
print(f"{server}\t{rw}\t{qd}\t{conns}\t{iops:.0f}\t{lat['mean']/1000:.1f}\t{p99:.1f}\t{cpu_us / max(window_ios, 1):.2f}")
PY
}

for server in ustor qsd nbdkit; do
  "start_$server"
  for rw in randread randwrite; do
    for qd in 1 32; do
      for conns in 1 4; do
        run_one "$server" "$rw" "$qd" "$conns"
      done
    done
  done
  kill "$PID"; wait "$PID" 2>/dev/null || true
done

python3 - "$RESULTS" <<'PY'
import sys, csv
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
by = {(r["server"], r["rw"], r["qd"], r["conns"]): r for r in rows}
print(f"{'workload':<24}{'server':<8}{'IOPS':>10}{'mean us':>10}{'p99 us':>10}{'CPU us/IO':>11}{'IOPS x':>9}{'CPU x':>8}")
for (s, rw, qd, c), r in sorted(by.items(), key=lambda kv: (kv[0][1], int(kv[0][2]), int(kv[0][3]), kv[0][0] != "ustor", kv[0][0])):
    u = by.get(("ustor", rw, qd, c))
    ix = float(r["iops"]) / max(float(u["iops"]), 1) if u else 0
    cx = float(r["cpu_us_per_io"]) / max(float(u["cpu_us_per_io"]), 1e-9) if u else 0
    w = f"{rw} qd{qd} x{c}"
    print(f"{w:<24}{s:<8}{r['iops']:>10}{r['lat_mean_us']:>10}{r['lat_p99_us']:>10}{r['cpu_us_per_io']:>11}{ix:>9.2f}{cx:>8.2f}")
print("IOPS x / CPU x: the peer's value relative to ustor (IOPS x < 1 and CPU x > 1 favour ustor).")
PY
