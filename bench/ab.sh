#!/usr/bin/env bash
# Before/after A/B of ustor's own data paths: the current tree against an
# older build, alternating in one run on the same machine (it is shared and
# noisy: every round runs every point on both builds, back to back, and the
# summary gives per point the median IOPS of each, the median of the
# per-round ratios new/base and their spread).
#
#   bdev  `ustor bench` on the null bdev, 4 KiB randread QD128 and malloc
#         4 KiB randwrite QD32, one core, poll mode (the per-I/O path every
#         target inherits)
#   nvmf  examples/nvmf_initiator_load (target on core 0, initiator bdev on
#         core 1, adaptive LANoT): 4/16 KiB randread/randwrite at QD 1/32/128
#   nbd   bench/nbd.sh with SERVERS="ustor base" and BASE_BIN (it alternates
#         the two servers itself: fio's nbd engine, 4 KiB randread/randwrite
#         at QD 1/32 over 1 and 4 connections, ROUNDS rounds of SECS
#         seconds); its rows join the summary as part=nbd, with the
#         server's CPU per I/O
#
# Usage: BASE=/path/to/old/checkout [ROUNDS=5] [SECS=2] [PARTS="bdev nvmf nbd"] bench/ab.sh
# (BASE_REV=<commit> names the base when BASE is an export, not a git checkout:
# git archive <commit> | tar -x -C <dir>.)
# BASE must hold release builds of ustor and the nvmf_initiator_load example
# (cargo build --release -p ustor -p ustor-nvme --example nvmf_initiator_load),
# and for nbd the nbd_server example (-p ustor-nbd --example nbd_server).
# Output: bench/results/ab-<date>.txt (raw lines, then the summary).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${BASE:?BASE=<older checkout with release builds>}"
ROUNDS=${ROUNDS:-5}
SECS=${SECS:-2}
PARTS=${PARTS:-"bdev nvmf"}
NVMF_POINTS=${NVMF_POINTS:-"randread:4096:1 randread:4096:32 randread:4096:128 randwrite:4096:32 randread:16384:32 randwrite:16384:128"}
[ -n "${NOBUILD:-}" ] || cargo build --release -q -p ustor -p ustor-nvme --example nvmf_initiator_load
declare -A BIN=([base]="$BASE/target/release" [new]="$PWD/target/release")
# Only the binaries the chosen parts run must exist.
need=""
case " $PARTS " in *" bdev "*) need="ustor" ;; esac
case " $PARTS " in *" nvmf "*) need="$need examples/nvmf_initiator_load" ;; esac
case " $PARTS " in *" nbd "*) need="$need examples/nbd_server" ;; esac
for v in base new; do
  for b in $need; do
    [ -x "${BIN[$v]}/$b" ] || { echo "ab.sh: ${BIN[$v]}/$b missing" >&2; exit 1; }
  done
done
mkdir -p bench/results
out=bench/results/ab-$(date +%Y%m%d-%H%M%S).txt

bdev_point() { # version spec workload qd
  "${BIN[$1]}/ustor" bench -b "$2" -w "$3" --bs 4K --qd "$4" -t "$SECS" --cores 0 --poll-mode poll --json 2>/dev/null |
    python3 -c 'import json,sys; print("iops=%.0f" % json.load(sys.stdin)["total"]["iops"])'
}
nbd_part() { # round lines from bench/nbd.sh's alternating run (all rounds at once)
  local o; o=$(mktemp -d)
  OUT=$o SERVERS="ustor base" BASE_BIN="${BIN[base]}/examples/nbd_server" ROUNDS=$ROUNDS RUNTIME=$SECS \
    bench/nbd.sh >"$o/summary.txt" 2>&1 || { cat "$o/summary.txt" >&2; rm -rf "$o"; return 1; }
  python3 - "$o/results.tsv" <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1]), delimiter="\t"):
    v = {"ustor": "new", "base": "base"}[r["server"]]
    print("round=%s part=nbd point=%s/qd%s/x%s v=%s iops=%s srv_cpu_ns_per_io=%.0f"
          % (r["round"], r["rw"], r["qd"], r["conns"], v, r["iops"], float(r["cpu_us_per_io"]) * 1000))
PY
  grep 'load:' "$o/summary.txt" | sed 's/^/# nbd.sh: /'
  rm -rf "$o"
}
nvmf_point() { # version rw bs qd
  "${BIN[$1]}/examples/nvmf_initiator_load" adaptive "$2" "$3" "$4" "$SECS" 2>/dev/null | tail -1 |
    grep -o 'iops=[0-9.]*\|tgt_busy_ns_per_io=[0-9.]*' | tr '\n' ' '
}
{
  echo "# $(date -u) $(uname -r) $(nproc) cpus; base=${BASE_REV:-$(git -C "$BASE" rev-parse --short HEAD)} new=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo +dirty)"
  echo "# cmd: BASE=$BASE ROUNDS=$ROUNDS SECS=$SECS PARTS=\"$PARTS\" NVMF_POINTS=\"$NVMF_POINTS\" bench/ab.sh"
  for r in $(seq "$ROUNDS"); do
    # Which build goes first alternates by round, so neither always gets
    # the warmer (or the quieter) half of the round.
    order="base new"; [ $((r % 2)) = 0 ] && order="new base"
    for part in $PARTS; do
      case $part in
        bdev)
          for p in "null:1G randread 128" "malloc:1G randwrite 32"; do
            set -- $p
            for v in $order; do echo "round=$r part=bdev point=$1/$2/qd$3 v=$v $(bdev_point "$v" "$1" "$2" "$3" || echo FAILED)"; done
          done ;;
        nvmf)
          for p in $NVMF_POINTS; do
            IFS=: read -r rw bs qd <<<"$p"
            for v in $order; do echo "round=$r part=nvmf point=$rw/$bs/qd$qd v=$v $(nvmf_point "$v" "$rw" "$bs" "$qd" || echo FAILED)"; done
          done ;;
        nbd) if [ "$r" = 1 ]; then nbd_part; fi ;;
        *) echo "ab.sh: unknown part $part" >&2; exit 1 ;;
      esac
    done
  done
} | tee "$out"
python3 - "$out" <<'PY' | tee -a "$out"
import re, statistics as st, sys
# metric -> (part, point) -> round -> version -> value
runs = {"iops": {}, "busy": {}, "cpu": {}}
for line in open(sys.argv[1]):
    m = re.match(r"round=(\d+) part=(\S+) point=(\S+) v=(\S+) (.*)", line)
    if not m:
        continue
    r, part, point, v, rest = m.groups()
    for key, pat in (("iops", r"(?:^| )iops=([\d.]+)"), ("busy", r"tgt_busy_ns_per_io=([\d.]+)"),
                     ("cpu", r"srv_cpu_ns_per_io=([\d.]+)")):
        x = re.search(pat, rest)
        if x:
            runs[key].setdefault((part, point), {}).setdefault(int(r), {})[v] = float(x.group(1))
def rows(key):
    for (part, point), rounds in runs[key].items():
        both = [x for x in rounds.values() if "base" in x and "new" in x and x["base"] > 0]
        if both:
            ratios = [x["new"] / x["base"] for x in both]
            yield part, point, st.median(x["base"] for x in both), st.median(x["new"] for x in both), \
                st.median(ratios), min(ratios), max(ratios), len(both)
print("\n%-6s %-26s %12s %12s %8s %s" % ("part", "point", "base IOPS", "new IOPS", "new/base", "per-round ratio min-max"))
for r in rows("iops"):
    print("%-6s %-26s %12.0f %12.0f %8.3f %.3f-%.3f (n=%d)" % r)
# The target's busy CPU per I/O (nvmf only): load moves it less than IOPS.
print("\n%-6s %-26s %12s %12s %8s %s" % ("part", "point", "base busy ns", "new busy ns", "new/base", "per-round ratio min-max"))
for r in rows("busy"):
    print("%-6s %-26s %12.0f %12.0f %8.3f %.3f-%.3f (n=%d)" % r)
# The NBD server's CPU per I/O (nbd only, from /proc: all its threads).
print("\n%-6s %-26s %12s %12s %8s %s" % ("part", "point", "base CPU ns", "new CPU ns", "new/base", "per-round ratio min-max"))
for r in rows("cpu"):
    print("%-6s %-26s %12.0f %12.0f %8.3f %.3f-%.3f (n=%d)" % r)
PY
