#!/usr/bin/env bash
# iSCSI targets side by side through the same client (libiscsi's iscsi-perf):
# ustor (crates/iscsi-target/examples/serve.rs, a malloc LUN) and tgtd
# (Debian `tgt`, a LUN on a file in /dev/shm, rdwr backing store).
# 4 KiB random reads at QD1 and QD32 with 1 and 4 sessions (one iscsi-perf
# process per session). iscsi-perf in libiscsi 1.19 only reads, so 4 KiB
# random writes go through fio's libiscsi engine (FIO=, a build of
# bench/fio-build.sh; see run_fio) and through ustor's own iSCSI
# initiator: `ustor bench -w randwrite` on a SCSI
# bdev over the iSCSI LLD (one session; `scsi_iscsi_attach_host`), the
# same client for every target, at each QD of WQDS (WRS="" skips them).
# BASE_BIN names an older build of the same serve example: it joins as
# target "base" (same LUN, same pinning, alternating with the others) and
# the summary gives ustor/base, a paired before/after A/B in one run;
# VARIANTS="name:binary ..." adds more such builds (one step each).
# SPDK's iscsi_tgt joins when SPDK_TGT names its binary (a build of
# bench/spdk-build.sh, e.g. spdk/build/bin/iscsi_tgt; a malloc LUN, its
# reactor on CORES: it busy-polls, so its CPU per I/O is the whole core).
#
# Both targets run for the whole benchmark pinned to CORES (one core by
# default); iscsi-perf runs on the other cores. While one target is
# measured the others are stopped (SIGSTOP, SIGCONT before their own
# runs): SPDK's reactor busy-polls its core even with no session, and
# left running it took half of the shared core from every other target. Workloads are interleaved
# (round r runs every workload on every target) and each cell is the median
# of ROUNDS runs, because the machines this runs on are shared and noisy.
# Reports IOPS (sum over sessions of iscsi-perf's average), the target's CPU
# time per I/O (from /proc/PID/stat, all threads) and each target's idle CPU
# (% of a core over IDLE seconds with no session), then ustor/tgtd ratios.
#
# SYSCALLS=1 also counts the target's io_uring_enter calls over each run
# (perf stat on the syscalls:sys_enter_io_uring_enter tracepoint, all its
# threads; needs perf and tracepoint access) and reports them per I/O.
# GAPS=1 records the target's receive syscall exits (io_uring_enter, read,
# readv, recvfrom, recvmsg) and send syscall entries (sendmsg, sendto,
# write, writev) over each run and reports the median time from the last
# receive's return to the next send (bench/lib/sysgap.py): the target's
# own time per request at QD1, outside the kernel's TCP work. The tracing
# slows every target, so GAPS runs are not IOPS runs.
# SPLIT=1 splits each QD1 round trip of a one-session row (iscsi-perf's
# reads, ustor's initiator's writes) between the client and the target
# into phases (client send, target wake-up, target work, target send,
# client wake-up, client work: bench/lib/qd1split.py), from one second of
# both processes' send and receive syscalls and context switches, and
# prints the median of each phase per target. Like GAPS, it slows the I/O
# it traces.
#
# Usage: bench/iscsi.sh  (env: ROUNDS=3 RUNTIME=4 SIZE_MIB=256 CORES=0
#                         REACTORS=<one per CORES entry>
#                         QDS="1 32" SESS="1 4" IDLE=5 BIN=<serve binary>
#                         SPDK_TGT=<iscsi_tgt binary> WRS=randwrite
#                         WQDS="1 32" USTOR=<ustor binary>
#                         BASE_BIN=<older serve binary>
#                         VARIANTS="name:<serve binary> ..." SYSCALLS=1
#                         GAPS=1 SPLIT=1 PREFAULT=1
#                         FIO=<fio with libiscsi> FRWS="randwrite randread"
#                         FQDS="1 32" FSESS="1 4")
set -euo pipefail

# Autogroup scheduling (Linux's default) shares the CPUs between Unix
# sessions (setsid) first and applies nice only within one, so `nice -n
# -20` alone left the targets a share of their core against a compiler
# started from another terminal (SPDK: 1.8 K IOPS at four QD1 iSCSI
# sessions, 33-46 K in a group of its own, same minute). The benchmark
# runs in a Unix session, so an autogroup, of its own with the nice it was
# started with.
if [ -z "${BENCH_OWN_GROUP:-}" ] && [ -w /proc/self/autogroup ]; then
  export BENCH_OWN_GROUP=1
  exec setsid -w "$0" "$@"
fi
if [ -w /proc/self/autogroup ]; then
  nice >/proc/self/autogroup 2>/dev/null || true
fi
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-4}
SIZE_MIB=${SIZE_MIB:-256}
CORES=${CORES:-0}
CLIENT_CORES=${CLIENT_CORES:-$(python3 -c '
import os, sys
used = {int(c) for c in sys.argv[1].split(",")}
rest = sorted(set(os.sched_getaffinity(0)) - used)
print(",".join(map(str, rest)) if rest else sys.argv[1])' "$CORES")}
# One ustor reactor per target core (the serve example reads REACTORS):
# two reactor threads on one pinned core would take turns on it.
export REACTORS=${REACTORS:-$(python3 -c '
import sys
n = 0
for part in sys.argv[1].split(","):
    lo, _, hi = part.partition("-")
    n += int(hi or lo) - int(lo) + 1
print(n)' "$CORES")}
# ustor's disk faulted in at creation with huge pages (the serve example's
# PREFAULT=1), as SPDK's malloc disk is: otherwise the first write to each
# 4 KiB page pays its page fault inside ustor's write rows, SPDK's not.
# (Serve builds older than this option ignore it and run lazy.)
export PREFAULT=${PREFAULT:-1}
QDS=${QDS:-"1 32"}
SESS=${SESS:-"1 4"}
WRS=${WRS-randwrite}
WQDS=${WQDS:-"1 32"}
IDLE=${IDLE:-5}
OUT=${OUT:-/tmp/ustor-bench-iscsi}
IQN=iqn.2016-06.io.spdk:disk1
mkdir -p "$OUT"
for t in tgtd tgtadm iscsi-perf python3; do
  command -v "$t" >/dev/null || { echo "missing $t (apt-get install -y tgt libiscsi-bin)" >&2; exit 1; }
done
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p ustor-iscsi-target --example serve
  BIN=target/release/examples/serve
fi
if [ -n "$WRS" ] && [ -z "${USTOR:-}" ]; then
  cargo build --release -q -p ustor
  USTOR=target/release/ustor
fi

. bench/lib/tgtd.sh
cpu_ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)

declare -A PID URL TPORT
UPID= SPID= BPIDS=
TARGETS="ustor tgtd"
cleanup() {
  for p in "${PID[@]}"; do kill -CONT "$p" 2>/dev/null || true; done
  [ -z "$UPID" ] || kill "$UPID" 2>/dev/null || true
  for p in $BPIDS; do kill "$p" 2>/dev/null || true; done
  [ -z "$SPID" ] || kill "$SPID" 2>/dev/null || true
  tgtd_stop
}
trap cleanup EXIT

UPORT=$(free_port)
taskset -c "$CORES" "$BIN" "$UPORT" 512 "$SIZE_MIB" >"$OUT/ustor.log" 2>&1 &
UPID=$!; wait_port "$UPORT"
PID[ustor]=$UPID; URL[ustor]="iscsi://127.0.0.1:$UPORT/$IQN/0"; TPORT[ustor]=$UPORT
VARIANTS=${VARIANTS:-}
[ -z "${BASE_BIN:-}" ] || VARIANTS="base:$BASE_BIN $VARIANTS"
VNAMES=
for v in $VARIANTS; do
  name=${v%%:*} bin=${v#*:}
  BPORT=$(free_port)
  taskset -c "$CORES" "$bin" "$BPORT" 512 "$SIZE_MIB" >"$OUT/$name.log" 2>&1 &
  BPIDS="$BPIDS $!"; PID[$name]=$!; wait_port "$BPORT"
  URL[$name]="iscsi://127.0.0.1:$BPORT/$IQN/0"; TPORT[$name]=$BPORT
  VNAMES="$VNAMES $name"
done
TARGETS="ustor$VNAMES tgtd"
tgtd_start /dev/shm/ustor-bench-iscsi-tgt.img "$SIZE_MIB" "$IQN" "$OUT/tgtd.log" taskset -c "$CORES"
PID[tgtd]=$TGT_PID; URL[tgtd]="iscsi://127.0.0.1:$PORT/$IQN/1"; TPORT[tgtd]=$PORT
if [ -n "${SPDK_TGT:-}" ]; then
  SPORT=$(free_port)
  cat >"$OUT/spdk.json" <<JSON
{"subsystems": [
 {"subsystem": "bdev", "config": [{"method": "bdev_malloc_create",
   "params": {"name": "Malloc0", "num_blocks": $((SIZE_MIB * 2048)), "block_size": 512}}]},
 {"subsystem": "iscsi", "config": [
  {"method": "iscsi_create_portal_group",
   "params": {"tag": 1, "portals": [{"host": "127.0.0.1", "port": "$SPORT"}]}},
  {"method": "iscsi_create_initiator_group",
   "params": {"tag": 1, "initiators": ["ANY"], "netmasks": ["ANY"]}},
  {"method": "iscsi_create_target_node",
   "params": {"name": "disk1", "alias_name": "spdk", "pg_ig_maps": [{"pg_tag": 1, "ig_tag": 1}],
              "luns": [{"bdev_name": "Malloc0", "lun_id": 0}], "queue_depth": 128,
              "disable_chap": true}}]}]}
JSON
  MASK=$(python3 -c 'import sys; print(hex(sum(1 << int(c) for c in sys.argv[1].split(","))))' "$CORES")
  "$SPDK_TGT" -m "$MASK" -r "$OUT/spdk.sock" --json "$OUT/spdk.json" >"$OUT/spdk.log" 2>&1 &
  SPID=$!; wait_port "$SPORT"
  PID[spdk]=$SPID; URL[spdk]="iscsi://127.0.0.1:$SPORT/$IQN/0"; TPORT[spdk]=$SPORT
  TARGETS="$TARGETS spdk"
fi

idle_pct() { # pid
  local b a; b=$(cpu_ticks "$1"); sleep "$IDLE"; a=$(cpu_ticks "$1")
  python3 -c "import sys; print(f'{100*($a-$b)/$HZ/$IDLE:.2f}')"
}

# Only target $1 runs; the others are stopped (see the top).
. bench/lib/only.sh
only() { only_run "$1" $TARGETS; }

RES="$OUT/results.tsv"
[ -z "${SPLIT:-}" ] || python3 bench/lib/qd1split.py --header \
  | sed 's/^label/round\trw\ttarget\tqd/' >"$OUT/split.tsv"
printf 'round\trw\ttarget\tqd\tsessions\tiops\tcpu_us_per_io\tlat_avg_us\tlat_p99_us\tenters\tgap_us\n' >"$RES"
# SYSCALLS=1: count the target's io_uring_enter calls for RUNTIME seconds
# (started beside the client); `enters FILE` prints the count (nan without).
PERF_PID=
enters_start() { # pid file
  PERF_PID=
  [ -n "${SYSCALLS:-}" ] || return 0
  perf stat -x, -e syscalls:sys_enter_io_uring_enter -p "$1" -o "$2" -- sleep "$RUNTIME" 2>/dev/null &
  PERF_PID=$!
}
enters_wait() { [ -z "$PERF_PID" ] || wait "$PERF_PID" || true; }
enters() { # file
  [ -n "$PERF_PID" ] || { echo nan; return; }
  awk -F, '/io_uring_enter/ && $1 ~ /^[0-9]+$/ {print $1; n=1} END {if (!n) print "nan"}' "$1"
}
# GAPS=1: record the target's receive returns and send entries for
# RUNTIME seconds; `gap FILE` prints the median gap in us (nan without).
GAP_PID=
GAP_EVENTS=syscalls:sys_exit_io_uring_enter,syscalls:sys_exit_read,syscalls:sys_exit_readv
GAP_EVENTS=$GAP_EVENTS,syscalls:sys_exit_recvfrom,syscalls:sys_exit_recvmsg
GAP_EVENTS=$GAP_EVENTS,syscalls:sys_enter_sendmsg,syscalls:sys_enter_sendto
GAP_EVENTS=$GAP_EVENTS,syscalls:sys_enter_write,syscalls:sys_enter_writev
gap_start() { # pid file
  GAP_PID=
  [ -n "${GAPS:-}" ] || return 0
  perf record -q -e "$GAP_EVENTS" -p "$1" -o "$2" -- sleep "$RUNTIME" >/dev/null 2>&1 &
  GAP_PID=$!
}
gap_wait() { [ -z "$GAP_PID" ] || wait "$GAP_PID" || true; }
gap() { # file
  [ -n "$GAP_PID" ] || { echo nan; return; }
  perf script --ns -F tid,time,event -i "$1" 2>/dev/null | python3 bench/lib/sysgap.py
}
# SPLIT=1: one second of a QD1 row's client and target syscalls, from one
# second into the run; `split_end` appends its phase medians. A client
# given as `child:PID` is the child of PID (iscsi-perf under timeout),
# looked up once it runs.
SPLIT_PID=
SPLIT_EVENTS=(-e syscalls:sys_enter_sendmsg -e syscalls:sys_exit_sendmsg
  -e syscalls:sys_enter_writev -e syscalls:sys_exit_writev
  -e syscalls:sys_enter_sendto -e syscalls:sys_exit_sendto
  -e syscalls:sys_enter_write -e syscalls:sys_exit_write -e syscalls:sys_exit_read --filter 'ret > 0'
  -e syscalls:sys_exit_readv --filter 'ret > 0' -e syscalls:sys_exit_recvfrom --filter 'ret > 0'
  -e syscalls:sys_exit_recvmsg --filter 'ret > 0' -e syscalls:sys_enter_io_uring_enter
  -e syscalls:sys_exit_io_uring_enter
  -e sched:sched_switch)
split_start() { # target-pid client-pid|child:pid file
  SPLIT_PID=
  [ -n "${SPLIT:-}" ] || return 0
  (
    sleep 1
    c=$2
    [ "${c#child:}" = "$c" ] || c=$(pgrep -P "${c#child:}" | head -n 1)
    echo "$c" >"$3.client"
    perf record -q "${SPLIT_EVENTS[@]}" -p "$1,$c" -o "$3" -- sleep 1 >/dev/null 2>&1
  ) &
  SPLIT_PID=$!
}
split_end() { # target-pid file label
  [ -n "$SPLIT_PID" ] || return 0
  wait "$SPLIT_PID" || true
  perf script --ns -F pid,tid,time,event,trace -i "$2" 2>/dev/null \
    | python3 bench/lib/qd1split.py "$1" "$(cat "$2.client")" "$3" >>"$OUT/split.tsv" || true
}
run_one() { # round target qd sessions
  local pid=${PID[$2]} b a i pids=() pf="$OUT/$2-qd$3-s$4-r$1.perf"
  enters_start "$pid" "$pf"
  gap_start "$pid" "$pf.gap"
  b=$(cpu_ticks "$pid")
  for i in $(seq "$4"); do
    timeout -s INT "$RUNTIME" taskset -c "$CLIENT_CORES" iscsi-perf -i "iqn.2007-10.com.github:bench-$i" \
      -m "$3" -b 8 -r "${URL[$2]}" >"$OUT/$2-qd$3-s$4-$i-r$1.txt" 2>&1 & pids+=($!)
  done
  SPLIT_PID=
  [ "$3" != 1 ] || [ "$4" != 1 ] || split_start "$pid" "child:${pids[0]}" "$pf.split"
  for p in "${pids[@]}"; do wait "$p" || true; done
  a=$(cpu_ticks "$pid")
  enters_wait; gap_wait
  split_end "$pid" "$pf.split" "$1	randread	$2	$3"
  python3 - "$@" "$((a - b))" "$HZ" "$OUT" "$(enters "$pf")" "$(gap "$pf.gap")" <<'PY' >>"$RES"
import glob, re, sys
rnd, tgt, qd, s, ticks, hz, out, enters, gap = sys.argv[1:]
iops = 0
for f in glob.glob(f"{out}/{tgt}-qd{qd}-s{s}-*-r{rnd}.txt"):
    avg = re.findall(r"iops average (\d+)", open(f).read())
    iops += int(avg[-1]) if avg else 0
cpu = int(ticks) / int(hz) * 1e6
ios = iops * 1.0  # iops average is per second over the run
print(f"{rnd}\trandread\t{tgt}\t{qd}\t{s}\t{iops}\t{cpu / max(ios, 1) / 1:.2f}\tnan\tnan\t{enters}\t{gap}")
PY
}

# Writes through ustor's initiator: a SCSI bdev on one iSCSI session to the
# target's first disk LUN (tgtd's LUN 0 is its controller, so sda is LUN 1);
# one reactor, kept on CLIENT_CORES by taskset (--no-pin).
run_write() { # round rw target qd
  local pid=${PID[$3]} b a cfg="$OUT/client-$3.json" json="$OUT/$3-$2-qd$4-r$1.json"
  cat >"$cfg" <<JSON
{"subsystems":[{"subsystem":"scsi","config":[
 {"method":"scsi_iscsi_attach_host","params":{"portal":"127.0.0.1:${TPORT[$3]}","target":"$IQN","queue_depth":64}},
 {"method":"bdev_scsi_create","params":{"name":"lun","device":"sda"}}]}]}
JSON
  enters_start "$pid" "$OUT/$3-$2-qd$4-r$1.perf"
  gap_start "$pid" "$OUT/$3-$2-qd$4-r$1.gap"
  b=$(cpu_ticks "$pid")
  taskset -c "$CLIENT_CORES" "$USTOR" bench -c "$cfg" -b lun -w "$2" --bs 4K -q "$4" \
    -t "$RUNTIME" --cores 0 --no-pin --json >"$json" 2>"$OUT/$3-$2-qd$4-r$1.err" &
  local cpid=$!
  SPLIT_PID=
  [ "$4" != 1 ] || split_start "$pid" "$cpid" "$OUT/$3-$2-qd$4-r$1.split"
  wait "$cpid" || true
  a=$(cpu_ticks "$pid")
  enters_wait; gap_wait
  split_end "$pid" "$OUT/$3-$2-qd$4-r$1.split" "$1	$2	$3	$4"
  python3 - "$json" "$@" "$((a - b))" "$HZ" "$RUNTIME" "$(enters "$OUT/$3-$2-qd$4-r$1.perf")" \
    "$(gap "$OUT/$3-$2-qd$4-r$1.gap")" <<'PY' >>"$RES"
import json, sys
path, rnd, rw, tgt, qd, ticks, hz, runtime, enters, gap = sys.argv[1:]
try:
    t = json.load(open(path))["total"]
except (OSError, ValueError, KeyError):
    t = {"iops": 0, "lat_avg_us": float("nan"), "lat_p99_us": float("nan")}
cpu = int(ticks) / int(hz) * 1e6
# Same unit as the read rows: CPU over the run / one second's IOPS.
print(f"{rnd}\t{rw}\t{tgt}\t{qd}\t1\t{t['iops']:.0f}\t{cpu / max(t['iops'], 1):.2f}"
      f"\t{t['lat_avg_us']:.1f}\t{t['lat_p99_us']:.1f}\t{enters}\t{gap}")
PY
}

# FIO=<fio built with --enable-libiscsi> (bench/fio-build.sh; Debian's fio
# has no libiscsi engine): each rw of FRWS at each QD of FQDS with each
# session count of FSESS through fio's libiscsi engine (one job, so one
# session, per FSESS; rows "fio-<rw>"): a libiscsi client that writes as
# well as reads and blocks in poll(2) between completions as iscsi-perf
# does; its latency is fio's mean total and p99 completion latency.
FRWS=${FRWS-"randwrite randread"}
FQDS=${FQDS:-"1 32"}
FSESS=${FSESS:-"1 4"}
run_fio() { # round rw target qd sessions
  local pid=${PID[$3]} b a json="$OUT/$3-fio-$2-qd$4-s$5-r$1.json" u=${URL[$3]}
  # fio's filename takes ':' escaped.
  u=${u//:/\\:}
  b=$(cpu_ticks "$pid")
  taskset -c "$CLIENT_CORES" "$FIO" --name=bench --ioengine=libiscsi --filename="$u" \
    --initiator=iqn.2007-10.com.github:bench-fio --rw="$2" --bs=4k --iodepth="$4" --numjobs="$5" \
    --group_reporting --time_based --runtime="$RUNTIME" --size="$((SIZE_MIB / 2))M" --norandommap \
    --randrepeat=0 --output-format=json --output="$json" >"$json.err" 2>&1 || true
  a=$(cpu_ticks "$pid")
  python3 - "$json" "$@" "$((a - b))" "$HZ" <<'PY' >>"$RES"
import json, sys
path, rnd, rw, tgt, qd, s, ticks, hz = sys.argv[1:]
try:
    # fio may put a note line before its JSON (a QD over 1 with an
    # engine it takes for synchronous, though libiscsi's queues).
    text = open(path).read()
    j = json.loads(text[text.index("{"):])["jobs"][0]
    x = j["read" if "read" in rw else "write"]
    iops, lat = x["iops"], x["lat_ns"]["mean"] / 1e3
    p99 = x["clat_ns"]["percentile"]["99.000000"] / 1e3
except (OSError, ValueError, KeyError, IndexError):
    iops, lat, p99 = 0, float("nan"), float("nan")
cpu = int(ticks) / int(hz) * 1e6
print(f"{rnd}\tfio-{rw}\t{tgt}\t{qd}\t{s}\t{iops:.0f}\t{cpu / max(iops, 1):.2f}\t{lat:.1f}\t{p99:.1f}\tnan\tnan")
PY
}

LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
IDLE_U=$(idle_pct "${PID[ustor]}"); IDLE_T=$(idle_pct "${PID[tgtd]}")
for r in $(seq "$ROUNDS"); do
  for qd in $QDS; do for s in $SESS; do for t in $TARGETS; do
    only "$t"; run_one "$r" "$t" "$qd" "$s"
  done; done; done
  for rw in $WRS; do for qd in $WQDS; do for t in $TARGETS; do
    only "$t"; run_write "$r" "$rw" "$t" "$qd"
  done; done; done
  if [ -n "${FIO:-}" ]; then
    for rw in $FRWS; do for qd in $FQDS; do for s in $FSESS; do for t in $TARGETS; do
      only "$t"; run_fio "$r" "$rw" "$t" "$qd" "$s"
    done; done; done; done
  fi
done

# The machine's load (1/5/15-minute averages) before and after: shared
# machines make absolute numbers noisy, the paired ratios less so.
echo "load average before: $LOAD0  after: $(cut -d' ' -f1-3 /proc/loadavg)  ($(nproc) CPUs)"
echo "scheduler group: $(cat /proc/self/autogroup 2>/dev/null || echo none)"
python3 - "$RES" "$RUNTIME" "$IDLE_U" "$IDLE_T" "${SPLIT:+$OUT/split.tsv}" $VNAMES <<'PY'
import csv, statistics, sys
res, runtime, iu, it = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
split, variants = sys.argv[5], tuple(sys.argv[6:])
rows = list(csv.DictReader(open(res), delimiter="\t"))
cells = {}
for r in rows:
    k = (r["rw"], r["qd"], r["sessions"], r["target"])
    # cpu_us_per_io above divides CPU over the whole run by one second's IOPS.
    cpu = float(r["cpu_us_per_io"]) / runtime
    cells.setdefault(k, []).append((int(r["iops"]), cpu, float(r["lat_avg_us"]), float(r["lat_p99_us"])))
others = [t for t in variants + ("tgtd", "spdk") if any(k[3] == t for k in cells)]
print(f"idle target CPU (% of a core): ustor {iu}  tgtd {it}")
head = "rw            qd sess | ustor IOPS  cpu us/io"
for t in others:
    head += f" | {t} IOPS  cpu us/io | ustor/{t} IOPS  cpu"
print(head)
def med(k, i):
    return statistics.median(x[i] for x in cells[k])
keys = sorted({k[:3] for k in cells}, key=lambda x: (x[0], int(x[1]), int(x[2])))
for rw, qd, s in keys:
    ui, uc = med((rw, qd, s, "ustor"), 0), med((rw, qd, s, "ustor"), 1)
    line = f"{rw:<13} {qd:>2} {s:>4} | {ui:>10.0f} {uc:>9.2f}"
    for t in others:
        ti, tc = med((rw, qd, s, t), 0), med((rw, qd, s, t), 1)
        line += f" | {ti:>9.0f} {tc:>9.2f} | {ui/max(ti,1):>10.2f} {uc/max(tc,1e-9):>5.2f}"
    print(line)
# Paired: each round runs every target back to back, so the per-round
# ratio cancels most of the load that drifts between rounds.
print("paired IOPS ratio ustor/peer: median of the per-round ratios [min, max]")
for rw, qd, s in keys:
    u = [x[0] for x in cells[(rw, qd, s, "ustor")]]
    parts = []
    for t in others:
        rs = [a / max(b, 1) for a, b in zip(u, (x[0] for x in cells[(rw, qd, s, t)]))]
        parts.append(f"{t} {statistics.median(rs):.2f} [{min(rs):.2f}, {max(rs):.2f}]")
    print(f"{rw:<13} {qd:>2} {s:>4} | " + " | ".join(parts))
# SYSCALLS=1: the target's io_uring_enter calls per I/O (count over the
# run / (IOPS x RUNTIME)), median over the rounds.
enters = {}
for r in rows:
    e = float(r.get("enters") or "nan")
    if e == e and int(r["iops"]) > 0:
        k = (r["rw"], r["qd"], r["sessions"], r["target"])
        enters.setdefault(k, []).append(e / (int(r["iops"]) * runtime))
if enters:
    ts = ["ustor"] + [t for t in others if any(k[3] == t for k in enters)]
    print("io_uring_enter per I/O (target, median of rounds): " + " | ".join(ts))
    for rw, qd, s in keys:
        print(f"{rw:<13} {qd:>2} {s:>4} | " + " | ".join(
            f"{statistics.median(enters[(rw, qd, s, t)]):.2f}" if (rw, qd, s, t) in enters else "-"
            for t in ts))
# GAPS=1: the target's time per request between its receive syscall's
# return and its send syscall (us), median of the rounds' medians.
gaps = {}
for r in rows:
    g = float(r.get("gap_us") or "nan")
    if g == g:
        gaps.setdefault((r["rw"], r["qd"], r["sessions"], r["target"]), []).append(g)
if gaps:
    ts = ["ustor"] + [t for t in others if any(k[3] == t for k in gaps)]
    print("receive return -> send entry (us, target, median of rounds): " + " | ".join(ts))
    for rw, qd, s in keys:
        print(f"{rw:<13} {qd:>2} {s:>4} | " + " | ".join(
            f"{statistics.median(gaps[(rw, qd, s, t)]):.2f}" if (rw, qd, s, t) in gaps else "-"
            for t in ts))
# SPLIT=1: where a QD1 round trip goes, median of the rounds' medians.
if split:
    srows = list(csv.DictReader(open(split), delimiter="\t"))
    phases = [c for c in (srows[0].keys() if srows else []) if c not in ("round", "rw", "target", "qd")]
    if srows:
        print("QD1 round trip split (us, median of rounds; bench/lib/qd1split.py): " + " ".join(phases))
    for k in sorted({(r["rw"], r["qd"], r["target"]) for r in srows}):
        vals = [r for r in srows if (r["rw"], r["qd"], r["target"]) == k]
        # A round whose trace had no complete request reads nan: left out.
        meds = [[float(r[p]) for r in vals if float(r[p]) == float(r[p])] for p in phases]
        print(f"{k[0]:<13} {k[1]:>2} {k[2]:<6} | " + " ".join(
            f"{statistics.median(m):6.2f}" if m else "   nan" for m in meds))
# Latency from ustor's initiator (the write rows): mean and p99 in us.
lat = [k for k in keys if k[0] != "randread"]
if lat:
    print("latency (us; write rows: ustor's initiator, fio rows: fio's completion latency) " + " | ".join(f"{t} mean  p99" for t in ["ustor"] + others))
    for rw, qd, s in lat:
        print(f"{rw:<13} {qd:>2} {s:>4} | " + " | ".join(
            f"{med((rw, qd, s, t), 2):>9.1f} {med((rw, qd, s, t), 3):>7.1f}" for t in ["ustor"] + others))
PY
