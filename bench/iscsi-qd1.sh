#!/usr/bin/env bash
# Where one QD1 iSCSI request's target time goes, counted rather than
# timed: `ustor serve` (adaptive and poll mode, one reactor on core TCORE)
# and SPDK's iscsi_tgt, alternated ROUNDS times, each driven by ustor's
# own initiator (`ustor bench`, one session, QD1, RW in RWS, on core
# CCORE), the client of bench/iscsi.sh's write rows. For each run it
# prints the client's IOPS and latency and, per I/O over a WINDOW-second
# window from 1 s into the run:
# - the target's CPU (us), context switches, syscalls in all, and
#   io_uring_enter, readv, sendmsg and epoll_wait calls (perf stat on the
#   syscall tracepoints: needs perf and tracepoint access);
# - the client's CPU and context switches (a sleeping client pays a
#   wake-up in the target's send);
# - for ustor, the reactor's counters (framework_get_reactors): sleeps
#   (waits in io_uring_enter, timed or not), naps (timed waits planned by
#   runtime/nap.rs), naps_early (naps that ended before their timer),
#   wakeups and loops. Sleeps above context switches are waits that
#   returned at once: a completion was already posted when the wait began,
#   as the response's own send is when it rides in the wait's enter and
#   the socket takes it inline.
#
# Usage: bench/iscsi-qd1.sh   (env: USTOR=target/release/ustor (target)
#   CLIENT=$USTOR  SPDK_TGT=<iscsi_tgt; unset: ustor only>  RWS=randwrite
#   MODES="adaptive poll"  ROUNDS=3  T=4  WINDOW=2  TCORE=0  CCORE=1
#   ECHO=1: each round also runs a bare loopback TCP echo with one
#   request's sizes (bench/lib/lo-echo.c, server spinning on TCORE, client
#   on CCORE blocking ("echo") and spinning ("echo-spin", as ustor's
#   initiator does on a CPU of its own)): the floor under any target on
#   this machine, in the same minute as the targets)
# Run it like every benchmark: nice -n -20 in an autogroup of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/tgtd.sh
USTOR=${USTOR:-target/release/ustor}
CLIENT=${CLIENT:-$USTOR}
RWS=${RWS:-randwrite}
MODES=${MODES:-"adaptive poll"}
ROUNDS=${ROUNDS:-3}
T=${T:-4}
WINDOW=${WINDOW:-2}
TCORE=${TCORE:-0}
CCORE=${CCORE:-1}
IQN=iqn.2016-06.io.spdk:disk1
d=$(mktemp -d /tmp/ustor-iscsi-qd1.XXXXXX)
tp=
cleanup() {
  [ -z "$tp" ] || { kill "$tp" 2>/dev/null; wait "$tp" 2>/dev/null || true; }
  rm -rf "$d"
}
trap cleanup EXIT
# The LUN: 256 MiB of malloc, faulted in at creation as SPDK's is.
lun_cfg() { # product port
  local prefault=""
  [ "$1" = spdk ] || prefault=', "prefault": true'
  cat <<JSON
{"subsystems": [
 {"subsystem": "bdev", "config": [{"method": "bdev_malloc_create",
   "params": {"name": "Malloc0", "num_blocks": 524288, "block_size": 512$prefault}}]},
 {"subsystem": "iscsi", "config": [
  {"method": "iscsi_create_portal_group", "params": {"tag": 1, "portals": [{"host": "127.0.0.1", "port": "$2"}]}},
  {"method": "iscsi_create_initiator_group", "params": {"tag": 1, "initiators": ["ANY"], "netmasks": ["ANY"]}},
  {"method": "iscsi_create_target_node", "params": {"name": "$IQN", "alias_name": "qd1",
   "pg_ig_maps": [{"pg_tag": 1, "ig_tag": 1}], "luns": [{"bdev_name": "Malloc0", "lun_id": 0}],
   "queue_depth": 64, "disable_chap": true}}]}]}
JSON
}
reactors() { # -> framework_get_reactors of the ustor target, or {}
  "$USTOR" rpc -s "$d/rpc" framework_get_reactors 2>/dev/null || echo '{}'
}
TEV=task-clock,context-switches,raw_syscalls:sys_enter,syscalls:sys_enter_io_uring_enter
TEV=$TEV,syscalls:sys_enter_readv,syscalls:sys_enter_sendmsg,syscalls:sys_enter_epoll_wait
run() { # target(adaptive|poll|spdk) rw round
  local port; port=$(free_port)
  lun_cfg "$1" "$port" >"$d/c.json"
  rm -f "$d/rpc"
  if [ "$1" = spdk ]; then
    "$SPDK_TGT" -m "$(printf '0x%x' $((1 << TCORE)))" -r "$d/rpc" --json "$d/c.json" >"$d/t.log" 2>&1 &
  else
    taskset -c "$TCORE" "$USTOR" serve --cores "$TCORE" --poll-mode "$1" -r "$d/rpc" -c "$d/c.json" \
      --log-level warn >"$d/t.log" 2>&1 &
  fi
  tp=$!
  wait_port "$port" || { cat "$d/t.log" >&2; exit 1; }
  cat >"$d/i.json" <<JSON
{"subsystems":[{"subsystem":"scsi","config":[
 {"method":"scsi_iscsi_attach_host","params":{"portal":"127.0.0.1:$port","target":"$IQN","queue_depth":64}},
 {"method":"bdev_scsi_create","params":{"name":"lun","device":"sda"}}]}]}
JSON
  taskset -c "$CCORE" "$CLIENT" bench -c "$d/i.json" -b lun -w "$2" --bs 4K -q 1 -t "$T" --cores 0 \
    --no-pin --json >"$d/out.json" 2>"$d/err" &
  local cp=$!
  sleep 1
  [ "$1" = spdk ] || reactors >"$d/r0.json"
  perf stat -x, -e task-clock,context-switches -p "$cp" -o "$d/c.perf" -- sleep "$WINDOW" &
  local pp=$!
  perf stat -x, -e "$TEV" -p "$tp" -o "$d/t.perf" -- sleep "$WINDOW"
  wait "$pp" || true
  [ "$1" = spdk ] || reactors >"$d/r1.json"
  [ "$1" != spdk ] || { echo '{}' >"$d/r0.json"; echo '{}' >"$d/r1.json"; }
  wait "$cp" || true
  kill "$tp"; wait "$tp" 2>/dev/null || true; tp=
  python3 bench/lib/qd1count.py "$3 $2 $1" "$d/out.json" "$WINDOW" "$d/t.perf" "$d/c.perf" "$d/r0.json" "$d/r1.json"
}
[ -z "${SPDK_TGT:-}" ] || MODES="$MODES spdk"
if [ "${ECHO:-0}" = 1 ]; then
  cc -O2 -o "$d/lo-echo" bench/lib/lo-echo.c
  MODES="$MODES echo echo-spin"
fi
echo_run() { # rw round [spin]: REQ/RESP of a QD1 write (4144 in, 48 out) or read (48 in, 4144 out)
  local port sp req=4144 resp=48
  [ "$1" = randwrite ] || { req=48; resp=4144; }
  port=$(free_port)
  taskset -c "$TCORE" "$d/lo-echo" server "$port" "$req" "$resp" spin &
  sp=$!
  printf '%s %s echo%s: ' "$2" "$1" "${3:+-$3}"
  taskset -c "$CCORE" "$d/lo-echo" client "$port" "$req" "$resp" "$T" ${3:-}
  wait "$sp" 2>/dev/null || true
}
echo "# bench/iscsi-qd1.sh RWS=\"$RWS\" MODES=\"$MODES\" ROUNDS=$ROUNDS T=$T WINDOW=$WINDOW; load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$ROUNDS"); do
  for rw in $RWS; do for m in $MODES; do
    case $m in
    echo) echo_run "$rw" "$r" ;;
    echo-spin) echo_run "$rw" "$r" spin ;;
    *) run "$m" "$rw" "$r" ;;
    esac
  done; done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
