#!/usr/bin/env bash
# Per-thread cost of one client I/O (issue 22): runs a client command
# (`ustor bench ... --json` or `fio ... --output-format=json`), and over a
# window in the middle of its run takes, per thread (grouped by name):
# CPU time (/proc/PID/task/TID/schedstat), voluntary and involuntary
# context switches (/proc/PID/task/TID/status), system calls and wake-ups
# it made (`perf stat --per-thread`, raw_syscalls:sys_enter and
# sched:sched_wakeup, counted in the waker's context), each divided by the
# I/Os of the window (the command's mean IOPS times the window).
#
# Usage: bench/rbd-threads.sh LABEL -- COMMAND...
# Environment: WAIT=3 (seconds before the window), WIN=8 (its length; the
#   command must run at least WAIT + WIN + 1 seconds), OUT=dir for the raw
#   snapshots (default: a temporary directory, removed).
# Run it as every bench: `flock <bench lock> nice -n -20 bench/rbd-threads.sh ...`.
set -euo pipefail

L=${1:?label}
[ "${2:-}" = "--" ] || { sed -n '2,17p' "$0"; exit 2; }
shift 2
WAIT=${WAIT:-3}
WIN=${WIN:-8}
keep=${OUT:-}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"

"$@" >"$out/$L.out" 2>"$out/$L.err" &
pid=$!
sleep "$WAIT"
# The process that does the I/O: the deepest child (taskset and fio's job
# process included).
q=$pid
while c=$(pgrep -P "$q" -n); do q=$c; done
snap() {
    local t
    for t in /proc/$q/task/*; do
        echo "$(basename "$t") $(tr ' ' '_' <"$t/comm") $(cut -d' ' -f1 "$t/schedstat") $(awk '/^voluntary/ {v=$2} /^nonvoluntary/ {n=$2} END {print v, n}' "$t/status")"
    done 2>/dev/null
}
snap >"$out/$L.s0"
perf stat --per-thread -p "$q" -e raw_syscalls:sys_enter,sched:sched_wakeup -o "$out/$L.perf" -- sleep "$WIN" >/dev/null 2>&1
snap >"$out/$L.s1"
wait "$pid" || true

python3 - "$out" "$L" "$WIN" <<'PY'
import collections, json, re, sys
out, L, win = sys.argv[1], sys.argv[2], float(sys.argv[3])
j = json.load(open(f"{out}/{L}.out"))
if "jobs" in j:
    d = j["jobs"][0]
    d = d["read"] if d["read"]["iops"] > 0 else d["write"]
    iops = d["iops"]
else:
    iops = j["total"]["iops"]
ios = iops * win
def load(f):
    r = {}
    for line in open(f):
        p = line.split()
        if len(p) == 5:
            r[p[0]] = (p[1], int(p[2]), int(p[3]), int(p[4]))
    return r
a, b = load(f"{out}/{L}.s0"), load(f"{out}/{L}.s1")
sc, wk = collections.Counter(), collections.Counter()
for line in open(f"{out}/{L}.perf"):
    m = re.match(r"\s*(\S+)-(\d+)\s+([\d,]+)\s+(\S+)", line)
    if m:
        n = int(m.group(3).replace(",", ""))
        (sc if "sys_enter" in m.group(4) else wk)[m.group(2)] += n
g = collections.defaultdict(lambda: [0] * 5)
for t, (c, ns, v, nv) in b.items():
    if t in a:
        k = re.sub(r"[-_]\d+$", "", c)
        x = g[k]
        for i, d in enumerate((ns - a[t][1], v - a[t][2], nv - a[t][3], sc[t], wk[t])):
            x[i] += d
print(f"{L}: iops {iops:.0f}, {ios:.0f} I/Os in the {win:.0f} s window")
print(f"  {'thread':16s} {'us/IO':>7s} {'vcs/IO':>7s} {'nvcs/IO':>7s} {'sys/IO':>7s} {'wakes/IO':>8s}")
tot = [sum(x[i] for x in g.values()) for i in range(5)]
for k, x in sorted(g.items(), key=lambda kv: -kv[1][0]) + [("TOTAL", tot)]:
    if k == "TOTAL" or x[0] / ios >= 50:
        print(f"  {k:16s} {x[0] / ios / 1e3:7.1f} {x[1] / ios:7.2f} {x[2] / ios:7.2f} {x[3] / ios:7.2f} {x[4] / ios:8.2f}")
PY
[ -n "$keep" ] || rm -rf "$out"
