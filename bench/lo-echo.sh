#!/usr/bin/env bash
# The loopback floor under a QD1 iSCSI write on this machine: a bare TCP
# echo (bench/lib/lo-echo.c) with one write's sizes (REQ=4144 bytes in:
# command + 4 KiB immediate data; RESP=48 out), server on core TCORE
# (busy-polling "spin", as a polling target; blocking "block"), client on
# CCORE blocking in recv as ustor's initiator does. No protocol work on
# either side: what any target and client pay before doing anything.
# Alternated ROUNDS times, T seconds each.
# Usage: bench/lo-echo.sh  (env: ROUNDS=3 T=3 REQ=4144 RESP=48 TCORE=0 CCORE=1)
# Run it like every benchmark: nice -n -20 in an autogroup of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/tgtd.sh
ROUNDS=${ROUNDS:-3}
T=${T:-3}
REQ=${REQ:-4144}
RESP=${RESP:-48}
TCORE=${TCORE:-0}
CCORE=${CCORE:-1}
d=$(mktemp -d /tmp/ustor-lo-echo.XXXXXX)
sp=
cleanup() {
  [ -z "$sp" ] || { kill "$sp" 2>/dev/null; wait "$sp" 2>/dev/null || true; }
  rm -rf "$d"
}
trap cleanup EXIT
cc -O2 -o "$d/lo-echo" bench/lib/lo-echo.c
echo "# bench/lo-echo.sh ROUNDS=$ROUNDS T=$T REQ=$REQ RESP=$RESP; load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$ROUNDS"); do
  for m in spin block; do
    port=$(free_port)
    taskset -c "$TCORE" "$d/lo-echo" server "$port" "$REQ" "$RESP" "$m" &
    sp=$!
    printf '%s server=%s: ' "$r" "$m"
    taskset -c "$CCORE" "$d/lo-echo" client "$port" "$REQ" "$RESP" "$T"
    wait "$sp" 2>/dev/null || true
    sp=
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
