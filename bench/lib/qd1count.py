"""One line of bench/iscsi-qd1.sh: a QD1 run's client result and its
counts per I/O over the counting window (target perf stat, client perf
stat, the ustor reactor's counters before and after the window).

Usage: qd1count.py LABEL OUT_JSON WINDOW_S TARGET_PERF CLIENT_PERF R0 R1
"""

import json
import sys


def perf(path):
    """perf stat -x, output: {event: count}."""
    out = {}
    for line in open(path):
        p = line.strip().split(",")
        if len(p) > 3 and p[0][:1].isdigit():
            out[p[2].split(":")[-1].replace("sys_enter_", "")] = float(p[0])
    return out


def reactor(path):
    """The first reactor's counters, or {} (SPDK, or no answer)."""
    try:
        r = json.load(open(path))
    except (OSError, ValueError):
        return {}
    rs = r.get("reactors", []) if isinstance(r, dict) else []
    return rs[0] if rs else {}


def main():
    label, out, window, tperf, cperf, r0, r1 = sys.argv[1:]
    try:
        t = json.load(open(out))["total"]
    except (OSError, ValueError, KeyError):
        print(f"{label}: no result")
        return
    # I/Os in the window, from the run's mean rate (QD1 runs are steady).
    n = max(t["iops"] * float(window), 1.0)
    cols = [f"iops={t['iops']:.0f}", f"lat={t['lat_avg_us']:.1f}", f"p99={t['lat_p99_us']:.1f}", "|"]
    tp = perf(tperf)
    for k, v in tp.items():
        # task-clock is in ms.
        cols.append(f"cpu_us={v * 1e3 / n:.2f}" if k == "task-clock" else f"{k}={v / n:.3f}")
    a, b = reactor(r0), reactor(r1)
    for k in ("sleeps", "sleeps_contended", "naps", "naps_early", "wakeups", "loops"):
        if k in a and k in b:
            cols.append(f"{k}={(b[k] - a[k]) / n:.3f}")
    cols.append("| client")
    for k, v in perf(cperf).items():
        cols.append(f"cpu_us={v * 1e3 / n:.2f}" if k == "task-clock" else f"{k}={v / n:.3f}")
    print(f"{label}: " + " ".join(cols))


if __name__ == "__main__":
    main()
