#!/bin/sh
# NVMe/TCP LANoT experiment through ustor's own initiator bdev.
# Target: a runtime on core 0 (malloc namespace). Initiator bdev + in-reactor
# load generator: a second runtime on core 1 (examples/nvmf_initiator_load.rs),
# one I/O queue, same coalescing mode on both sides:
# off / fixed(degree 16, timer 50 us) / adaptive.
# Part 1: randread/randwrite 4 KiB and 16 KiB, QD 1..128.
# Part 2: QD1 paced at fixed low rates (50..500 IOPS): latency per mode.
# Part 3 (PROCS_QDS, default "1 32 128"; empty skips it): the same modes as
# users run them, two processes: `ustor serve` (target, core 0) and
# `ustor bench` through `bdev_nvme_attach_controller` (core 1), one point
# per workload and QD (bench/lib/nvmf_procs.py).
# The three modes are interleaved (mode is the innermost loop, repetition
# the outermost), every point is run REPEAT times, and the summary reports
# medians (of IOPS, mean/p50/p99 latency, sendmsg per I/O), the goals
# table, and SPDK nvmf_tgt's reference figures — a
# reference run on a similar machine, NOT this run — with the ratio.
#
# Reactor poll mode (both runtimes): POLL (default adaptive) for part 1;
# part 2 runs once per mode in LOWRATE_POLL (default "adaptive interrupt"):
# at a few hundred IOPS adaptive busy-polls 1 ms after every I/O and then
# sleeps, so the scheduler treats the reactors as CPU hogs when the box is
# shared; interrupt shows the same comparison without that (see
# docs/nvmf.md, "Low-rate latency").
#
# QUEUES (default "1") lists I/O queue counts for part 1: with N, the
# initiator attaches N controllers (N connections, one I/O queue each, all
# on the initiator's core and all served by the target's one reactor) and
# QD is per queue. Many queues per target core is the case LANoT was made
# for: a poll pass's responses are spread over N sockets.
#
# Usage: [REPEAT=3] [QDS="1 8 32 128"] [QUEUES="1"] [RATES="50 200 500"]
#        [POLL=adaptive] [LOWRATE_POLL="adaptive interrupt"]
#        bench/nvmf.sh [SECS] [RATE_SECS]
# Results: bench/results/nvmf-init-<date>.txt (raw lines + summary) and
# -iops.png / -lowrate.png next to it. The 2-vCPU box is shared: each line
# carries the 1-minute load average at its start.
# (the older raw-client run is examples/nvmf_load.rs).
set -eu
secs=${1:-1}
rsecs=${2:-2}
repeat=${REPEAT:-3}
qds=${QDS:-1 8 32 128}
queues=${QUEUES:-1}
rates=${RATES:-50 200 500}
poll=${POLL:-adaptive}
lowpoll=${LOWRATE_POLL:-adaptive interrupt}
pqds=${PROCS_QDS-1 32 128}
cd "$(dirname "$0")/.."
[ -n "${NOBUILD:-}" ] || cargo build --release -q -p ustor-nvme --example nvmf_initiator_load -p ustor --bin ustor
bin=target/release/examples/nvmf_initiator_load
stamp=$(date +%Y%m%d-%H%M%S)
out=bench/results/nvmf-init-$stamp.txt
# run POLLMODE MODE RW BS QD SECS [RATE]
run() {
    pm=$1
    shift
    l=$(cut -d' ' -f1 /proc/loadavg)
    r=$(env POLL="$pm" QUEUES="$nq" "$bin" "$@" 2>/dev/null) || r="mode=$1 poll=$pm rw=$2 bs=$3 queues=$nq qd=$4 rate=${6:-0} FAILED"
    echo "rep=$rep load=$l $r"
}
{
    echo "# $(date -u) $(uname -r) $(nproc) cpus $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); secs=$secs rate_secs=$rsecs repeat=$repeat"
    echo "# cmd: REPEAT=$repeat QDS=\"$qds\" QUEUES=\"$queues\" RATES=\"$rates\" POLL=$poll LOWRATE_POLL=\"$lowpoll\" PROCS_QDS=\"$pqds\" bench/nvmf.sh $secs $rsecs"
    echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    rep=1
    while [ "$rep" -le "$repeat" ]; do
        for w in "randread 4096" "randwrite 4096" "randread 16384" "randwrite 16384"; do
            set -- $w
            for nq in $queues; do
                for qd in $qds; do
                    for mode in off fixed adaptive; do
                        run "$poll" "$mode" "$1" "$2" "$qd" "$secs"
                    done
                done
            done
        done
        nq=1
        for pm in $lowpoll; do
            for rate in $rates; do
                for mode in off fixed adaptive; do
                    run "$pm" "$mode" randread 4096 1 "$rsecs" "$rate"
                done
            done
        done
        for w in "randread 4096" "randwrite 4096" "randread 16384" "randwrite 16384"; do
            set -- $w
            for qd in $pqds; do
                for mode in off fixed adaptive; do
                    l=$(cut -d' ' -f1 /proc/loadavg)
                    r=$(python3 bench/lib/nvmf_procs.py target/release/ustor "$mode" "$1" "$2" "$qd" "$secs" "$poll" 2>&1 | tail -1)
                    echo "rep=$rep load=$l $r"
                done
            done
        done
        rep=$((rep + 1))
    done
    echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out"
python3 - "$out" <<'EOF' | tee -a "$out"
import re, statistics as st, sys
path = sys.argv[1]
rows = []
for line in open(path):
    # A run that failed (its error text instead of results) is left out.
    if not line.startswith("rep=") or "FAILED" in line or "iops=" not in line:
        continue
    kv = dict(re.findall(r"(\w+)=(\S+)", line))
    rows.append(kv)

def med(xs):
    return st.median(xs) if xs else float("nan")

def group(pred, by_poll=False, part="lib"):
    g = {}
    for r in rows:
        if r.get("part", "lib") == part and pred(r):
            key = (r["rw"], int(r["bs"]), int(r.get("queues", "1")), int(r["qd"]), int(r["rate"]), r["mode"].lower())
            if by_poll:
                key = key + (r.get("poll", "adaptive"),)
            g.setdefault(key, []).append(r)
    return g

F = ["iops", "avg_lat_us", "p50_lat_us", "p99_lat_us", "ini_sendmsg_per_io",
     "tgt_sendmsg_per_io", "tgt_recv_per_io", "tgt_sleeps_per_io", "pace_late_avg_us", "load",
     "tgt_cpu_ns_per_io", "ini_cpu_ns_per_io"]

def summary(rs):
    return {f: med([float(r[f]) for r in rs if f in r]) for f in F} | {"n": len(rs)}

sat = {k: summary(v) for k, v in group(lambda r: r["rate"] == "0").items()}
low = {k: summary(v) for k, v in group(lambda r: r["rate"] != "0", True).items()}
procs = {k: summary(v) for k, v in group(lambda r: True, part="procs").items()}
polls = sorted({k[6] for k in low})
print()
print("## Summary (medians over repetitions)")
print()
print("| rw | bs | queues | qd/queue | mode | n | IOPS | mean µs | p50 µs | p99 µs | ini sendmsg/IO | tgt sendmsg/IO | tgt recv/IO | tgt CPU ns/IO | ini CPU ns/IO | load |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for k in sorted(sat, key=lambda k: (k[0], k[1], k[2], k[3], ["off", "fixed", "adaptive"].index(k[5]))):
    s = sat[k]
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[5]} | {s['n']} | {s['iops']:.0f} | {s['avg_lat_us']:.1f} | "
          f"{s['p50_lat_us']:.1f} | {s['p99_lat_us']:.1f} | {s['ini_sendmsg_per_io']:.3f} | "
          f"{s['tgt_sendmsg_per_io']:.3f} | {s['tgt_recv_per_io']:.3f} | {s['tgt_cpu_ns_per_io']:.0f} | "
          f"{s['ini_cpu_ns_per_io']:.0f} | {s['load']:.2f} |")
if procs:
    print()
    print("### Part 3: `ustor serve` (target, core 0) + `ustor bench` (initiator bdev, core 1), two processes")
    print()
    print("| rw | bs | qd | mode | n | IOPS | mean µs | p99 µs | tgt sendmsg/IO | tgt CPU ns/IO | ini CPU ns/IO | IOPS / off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in sorted(procs, key=lambda k: (k[0], k[1], k[3], ["off", "fixed", "adaptive"].index(k[5]))):
        s = procs[k]
        o = procs.get(k[:5] + ("off",))
        ratio = f"{s['iops'] / o['iops']:.2f}" if o and o["iops"] else "-"
        print(f"| {k[0]} | {k[1]} | {k[3]} | {k[5]} | {s['n']} | {s['iops']:.0f} | {s['avg_lat_us']:.1f} | "
              f"{s['p99_lat_us']:.1f} | {s['tgt_sendmsg_per_io']:.3f} | {s['tgt_cpu_ns_per_io']:.0f} | "
              f"{s['ini_cpu_ns_per_io']:.0f} | {ratio} |")
print()
print("### Low rate, QD1 randread 4 KiB (paced)")
print()
print("| reactors | rate | mode | n | mean µs | p50 µs | p99 µs | pacer late (mean µs) | tgt sleeps/IO | load |")
print("|---|---|---|---|---|---|---|---|---|---|")
for k in sorted(low, key=lambda k: (k[6], k[4], ["off", "fixed", "adaptive"].index(k[5]))):
    s = low[k]
    print(f"| {k[6]} | {k[4]} | {k[5]} | {s['n']} | {s['avg_lat_us']:.1f} | {s['p50_lat_us']:.1f} | "
          f"{s['p99_lat_us']:.1f} | {s['pace_late_avg_us']:.1f} | {s['tgt_sleeps_per_io']:.2f} | {s['load']:.2f} |")

print()
print("## Goals")
print()
print("| goal | point | measured | met |")
print("|---|---|---|---|")
for pm, rate in sorted({(k[6], k[4]) for k in low}):
    o = low.get(("randread", 4096, 1, 1, rate, "off", pm))
    a = low.get(("randread", 4096, 1, 1, rate, "adaptive", pm))
    if o and a:
        for f, name in (("avg_lat_us", "mean"), ("p50_lat_us", "p50"), ("p99_lat_us", "p99")):
            ratio = a[f] / o[f]
            print(f"| adaptive latency within 5% of off (low load) | {rate} IOPS QD1, {name}, {pm} reactors | "
                  f"{a[f]:.1f} vs {o[f]:.1f} µs = {ratio:.2f}x | {'yes' if ratio <= 1.05 else 'no'} |")
for (rw, bs, nq, qd) in sorted({k[:4] for k in sat if k[2] * k[3] >= 32}):
    o = sat.get((rw, bs, nq, qd, 0, "off"))
    f = sat.get((rw, bs, nq, qd, 0, "fixed"))
    a = sat.get((rw, bs, nq, qd, 0, "adaptive"))
    if not (o and f and a):
        continue
    r = a["iops"] / o["iops"]
    sys_a = a["ini_sendmsg_per_io"] + a["tgt_sendmsg_per_io"]
    sys_o = o["ini_sendmsg_per_io"] + o["tgt_sendmsg_per_io"]
    pt = f"{rw} {bs // 1024} KiB QD{qd}" + (f" x {nq} queues" if nq > 1 else "")
    print(f"| adaptive >= 1.3x off IOPS (saturation) | {pt} | {a['iops']:.0f} vs {o['iops']:.0f} = {r:.2f}x | {'yes' if r >= 1.3 else 'no'} |")
    print(f"| adaptive fewer sendmsg per I/O than off | {pt} | {sys_a:.3f} vs {sys_o:.3f} (ini+tgt) | {'yes' if sys_a < sys_o else 'no'} |")
    print(f"| adaptive >= best fixed IOPS | {pt} | {a['iops']:.0f} vs fixed {f['iops']:.0f} | {'yes' if a['iops'] >= f['iops'] else 'no'} |")

# SPDK nvmf_tgt reference: the project's reference figures for SPDK nvmf_tgt (SPDK v26.09-pre, malloc
# namespace, target on 1 core, spdk_nvme_perf on the other, 127.0.0.1).
ref = {("randread", 1): (46e3, 21.5), ("randwrite", 1): (54e3, 18.4),
       ("randread", 32): (306e3, 113.0), ("randwrite", 32): (289e3, 111.0),
       ("randread", 128): (251e3, 511.0)}
print()
print("## ustor (this run, best mode by median IOPS) vs SPDK nvmf_tgt")
print()
print("SPDK figures are REFERENCE figures from another run on a similar machine")
print("(the project's reference figures for SPDK nvmf_tgt: 2 vCPU EPYC Firecracker guest, spdk_nvme_perf as")
print("initiator), not measured in this run; the initiators differ too.")
print()
print("| workload | QD | ustor mode | ustor IOPS | ustor mean µs | SPDK ref IOPS | SPDK ref mean µs | ustor/SPDK IOPS |")
print("|---|---|---|---|---|---|---|---|")
for (rw, qd), (riops, rlat) in ref.items():
    cands = [(m, sat[(rw, 4096, 1, qd, 0, m)]) for m in ("off", "fixed", "adaptive") if (rw, 4096, 1, qd, 0, m) in sat]
    if not cands:
        continue
    m, s = max(cands, key=lambda c: c[1]["iops"])
    print(f"| {rw} 4 KiB | {qd} | {m} | {s['iops']:.0f} | {s['avg_lat_us']:.1f} | {riops:.0f} | {rlat} | {s['iops'] / riops:.2f} |")

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("\n(no matplotlib: plots skipped; `pip install matplotlib` brings them)")
    sys.exit(0)
base = path[:-4]
wls = sorted({(k[0], k[1], k[2]) for k in sat})
fig, axes = plt.subplots(1, len(wls), figsize=(5 * len(wls), 4), squeeze=False)
for ax, (rw, bs, nq) in zip(axes[0], wls):
    for m in ("off", "fixed", "adaptive"):
        pts = sorted((k[3], v["iops"]) for k, v in sat.items() if k[:3] == (rw, bs, nq) and k[5] == m)
        ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("queue depth per queue")
    ax.set_ylabel("kIOPS (median)")
    ax.set_title(f"{rw} {bs // 1024} KiB, {nq} queue(s)")
    ax.legend()
fig.suptitle("ustor NVMe/TCP via ustor initiator, coalescing mode per side (2 vCPU, noisy)")
fig.tight_layout()
fig.savefig(base + "-iops.png", dpi=90)
rts = sorted({k[4] for k in low})
fig, axes = plt.subplots(len(polls), 3, figsize=(15, 4 * len(polls)), squeeze=False)
for row, pm in zip(axes, polls):
    for ax, (f, name) in zip(row, (("avg_lat_us", "mean"), ("p50_lat_us", "p50"), ("p99_lat_us", "p99"))):
        w = 0.25
        for i, m in enumerate(("off", "fixed", "adaptive")):
            ys = [low.get(("randread", 4096, 1, 1, r, m, pm), {}).get(f, 0) for r in rts]
            ax.bar([j + (i - 1) * w for j in range(len(rts))], ys, w, label=m)
        ax.set_xticks(range(len(rts)), [f"{r} IOPS" for r in rts])
        ax.set_ylabel(f"{name} latency µs (median of runs)")
        ax.set_title(f"QD1 randread 4 KiB paced, {pm} reactors: {name}")
        ax.legend()
fig.tight_layout()
fig.savefig(base + "-lowrate.png", dpi=90)
print(f"\nplots: {base}-iops.png {base}-lowrate.png")
EOF
echo "$out"
