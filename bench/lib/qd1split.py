"""Splits a QD1 round trip between a client and a target into phases, from
`perf script --ns -F pid,tid,time,event,trace` of both processes' send
syscall entries and exits (sendmsg, sendto, write, writev), receive
syscall exits (read, readv, recvfrom, recvmsg: only those that returned
data, so record them with `--filter 'ret > 0'`; io_uring_enter: entries
and exits, all) and
sched_switch (bench/iscsi.sh SPLIT=1, reads and writes). argv: target PID, client PID, and
optionally a label: then one tab-separated line, the label and each
phase's median (the header comes with `--header`).

Each request starts at the client's send entry and ends at its next one:

  A1 client send      the client's send syscall (its TCP transmit and the
                      loopback delivery into the target's socket)
  A2 target wake      client send returned -> the target's last receive
                      syscall return before its response
  B  target work      that return -> the target's send entry (the target's
                      own time, as sysgap.py measures it)
  C1 target send      the target's send syscall (delivery into the client)
  C2 client wake      target send returned -> the client's first receive
                      that brought data
  D  client work      that receive -> the client's next send entry

A target whose wait rides in the enter that sends (ustor's adaptive and
interrupt modes fold the wait into that enter, runtime `fold_wait`) is
not split right: the send's exit comes with the next request, so C1
runs long and C2 goes negative. Split such a target in poll mode.

and the counts per request of the target's receive returns and of each
side's context switches (a switch is a sleep or a preemption). Prints
the median of each phase and its 10th and 90th percentiles, in us; the
medians need not add up to the median cycle."""

import collections
import re
import statistics
import sys

SENDS = {"sendmsg", "sendto", "write", "writev"}
RECVS = {"read", "readv", "recvfrom", "recvmsg"}
EV = re.compile(r"sys_(enter|exit)_(\w+)")


def events(lines, target, client):
    """(time, side, kind, syscall) for each event of the two processes."""
    for line in lines:
        p = line.split()
        if len(p) < 3:
            continue
        side = {target: "T", client: "C"}.get(p[0].split("/")[0])
        if side is None:
            continue
        try:
            t = float(p[1].rstrip(":"))
        except ValueError:
            continue
        name = p[2].rstrip(":")
        if "sched_switch" in name:
            yield t, side, "switch", ""
            continue
        m = EV.search(name)
        if m:
            yield t, side, m.group(1), m.group(2)


def split(evs):
    """Per-request phases (seconds) and counts.

    The target's send is the last target send syscall, or io_uring_enter
    (a target that sends through its ring: the response goes out inside
    an enter), entered before the client's receive returned data; its
    receive is the last receive return (an io_uring_enter exit counts)
    after the client's send and before that."""
    phases = collections.defaultdict(list)
    counts = collections.defaultdict(list)
    cur = {}
    tev = []
    n = collections.Counter()
    for t, side, kind, call in sorted(evs):
        if side == "C" and kind == "enter" and call in SENDS:
            close(cur, tev, n, t, phases, counts)
            cur = {"c_send": t}
            tev = []
            n = collections.Counter()
            continue
        if "c_send" not in cur:
            continue
        if kind == "switch":
            n["target switches" if side == "T" else "client switches"] += 1
        elif side == "C" and kind == "exit" and call in SENDS:
            cur.setdefault("c_sent", t)
        elif side == "C" and kind == "exit" and call in RECVS and "c_sent" in cur:
            cur.setdefault("c_rx", t)
        elif side == "T" and (call in SENDS or call in RECVS or call == "io_uring_enter"):
            tev.append((t, kind, call))
    return phases, counts


def close(cur, tev, n, t, phases, counts):
    """Ends the request that began at cur["c_send"], at the client's next send t."""
    if not all(k in cur for k in ("c_send", "c_sent", "c_rx")):
        return
    c_sent, c_rx = cur["c_sent"], cur["c_rx"]
    sends = [(x, c) for x, k, c in tev if k == "enter" and x < c_rx and (c in SENDS or c == "io_uring_enter")]
    if not sends:
        return
    t_send, call = sends[-1]
    sent = [x for x, k, c in tev if k == "exit" and c == call and x > t_send]
    rx = [x for x, k, c in tev if k == "exit" and c_sent < x < t_send and (c in RECVS or c == "io_uring_enter")]
    if not sent or not rx:
        return
    t_sent, t_rx = sent[0], rx[-1]
    phases["A1 client send"].append(c_sent - cur["c_send"])
    phases["A2 target wake"].append(t_rx - c_sent)
    phases["B  target work"].append(t_send - t_rx)
    phases["C1 target send"].append(t_sent - t_send)
    phases["C2 client wake"].append(c_rx - t_sent)
    phases["D  client work"].append(t - c_rx)
    phases["cycle"].append(t - cur["c_send"])
    n["target receives"] = sum(1 for x, k, c in tev if k == "exit" and c_sent < x <= t_send)
    for k in ("target receives", "target switches", "client switches"):
        counts[k].append(n[k])


NAMES = ("A1 client send", "A2 target wake", "B  target work", "C1 target send",
         "C2 client wake", "D  client work", "cycle")


def main():
    if sys.argv[1:] == ["--header"]:
        print("label\t" + "\t".join(n.split()[0] for n in NAMES))
        return
    phases, counts = split(events(sys.stdin, sys.argv[1], sys.argv[2]))
    if len(sys.argv) > 3:
        meds = [statistics.median(phases[n]) * 1e6 if phases[n] else float("nan") for n in NAMES]
        print(sys.argv[3] + "\t" + "\t".join(f"{m:.2f}" for m in meds))
        return
    if not phases:
        print("no complete request")
        return
    print(f"requests {len(phases['cycle'])}")
    for k, v in phases.items():
        v = sorted(x * 1e6 for x in v)
        p10, p90 = v[len(v) // 10], v[len(v) * 9 // 10]
        print(f"{k:15} median {statistics.median(v):7.2f}  p10 {p10:7.2f}  p90 {p90:7.2f}")
    for k, v in counts.items():
        print(f"{k:15} per request {statistics.mean(v):.2f}")


if __name__ == "__main__":
    main()
