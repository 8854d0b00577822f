#!/usr/bin/env bash
# MC/S spread over reactors: one iSCSI session of ustor's target driven
# through one connection or two (crates/iscsi-target/examples/mcs_client.rs:
# a raw MC/S client, one thread per connection, QD 4 KiB random reads each,
# CmdSN shared by the session; libiscsi and open-iscsi do not do MC/S).
# Two targets (examples/serve.rs, a malloc LUN) run side by side: one with
# 2 reactors, one with 1 (REACTORS=1). Rows, alternating every round:
#   one      1 connection            -> 2-reactor target
#   two-one  2 connections           -> 1-reactor target (both on it)
#   two-two  2 connections           -> 2-reactor target (one per reactor)
# Each cell is the median of ROUNDS runs; then two-two/one and
# two-two/two-one, from the medians and paired within each round. The listener places connections round robin, so the two
# connections of a session land on the 2-reactor target's two reactors.
#
# Usage: bench/iscsi-mcs.sh  (env: ROUNDS=5 RUNTIME=4 QD=16 SIZE_MIB=128
#                             BIN=<serve binary> CLIENT=<mcs_client binary>)
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
RUNTIME=${RUNTIME:-4}
QD=${QD:-16}
SIZE_MIB=${SIZE_MIB:-128}
OUT=${OUT:-/tmp/ustor-bench-iscsi-mcs}
mkdir -p "$OUT"
if [ -z "${BIN:-}" ] || [ -z "${CLIENT:-}" ]; then
  cargo build --release -q -p ustor-iscsi-target --example serve --example mcs_client
  BIN=target/release/examples/serve
  CLIENT=target/release/examples/mcs_client
fi
. bench/lib/tgtd.sh

P2=$(free_port)
REACTORS=2 "$BIN" "$P2" 512 "$SIZE_MIB" >"$OUT/serve2.log" 2>&1 &
T2=$!
P1=$(free_port)
REACTORS=1 "$BIN" "$P1" 512 "$SIZE_MIB" >"$OUT/serve1.log" 2>&1 &
T1=$!
trap 'kill $T1 $T2 2>/dev/null || true' EXIT
wait_port "$P2"; wait_port "$P1"

RES="$OUT/results.tsv"
printf 'round\trow\tconns\treactors\tqd\tiops\n' >"$RES"
run() { # round row port conns reactors
  local iops
  iops=$("$CLIENT" "$3" "$4" "$QD" "$RUNTIME" | sed -n 's/.*iops=//p')
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$4" "$5" "$QD" "$iops" >>"$RES"
}
for r in $(seq "$ROUNDS"); do
  run "$r" one "$P2" 1 2
  run "$r" two-one "$P1" 2 1
  run "$r" two-two "$P2" 2 2
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs; raw: $RES"
python3 - "$RES" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
med = {}
for name in ("one", "two-one", "two-two"):
    v = [float(r["iops"]) for r in rows if r["row"] == name]
    med[name] = statistics.median(v)
    print(f"{name:8} conns={rows[[r['row'] for r in rows].index(name)]['conns']} "
          f"median {med[name]:.0f} IOPS  runs {' '.join(f'{x:.0f}' for x in v)}")
print(f"two-two/one {med['two-two'] / med['one']:.2f}x   "
      f"two-two/two-one {med['two-two'] / med['two-one']:.2f}x   (medians)")
# Paired: the ratio within each round (its runs ran back to back).
by = {(r["round"], r["row"]): float(r["iops"]) for r in rows}
rounds = sorted({r["round"] for r in rows}, key=int)
for base in ("one", "two-one"):
    q = [by[(n, "two-two")] / by[(n, base)] for n in rounds]
    print(f"two-two/{base} per round: median {statistics.median(q):.2f}x, "
          f"{sum(x > 1 for x in q)} of {len(q)} rounds above 1 "
          f"({' '.join(f'{x:.2f}' for x in q)})")
PY
