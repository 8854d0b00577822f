"""Reads `perf script --ns -F tid,time,event` output of a target's receive
syscall exits and send syscall entries (bench/iscsi.sh GAPS=1) and prints
the median time, in microseconds, from a thread's last receive syscall
return to its next send syscall entry: the target's own time per request
between the kernel handing it a request and the response going back in
(userspace work, plus whatever ran between on other threads). "nan" when
there was no such pair."""

import statistics
import sys

last = {}
gaps = []
for line in sys.stdin:
    parts = line.split()
    if len(parts) < 3:
        continue
    tid, t, ev = parts[0], float(parts[1].rstrip(":")), parts[2]
    if ":sys_exit_" in ev:
        last[tid] = t
    elif ":sys_enter_" in ev and tid in last:
        gaps.append(t - last.pop(tid))
print(f"{statistics.median(gaps) * 1e6:.2f}" if gaps else "nan")
