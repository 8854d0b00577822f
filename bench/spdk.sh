#!/usr/bin/env bash
# Same-machine SPDK comparison (issues 3 and 6), in one run:
#
#  a. SPDK bdevperf vs `ustor bench`: null and malloc bdevs (1 GiB, 512-byte
#     blocks), 4 KiB randread/randwrite, QD1 and QD128, one core ($CORE:
#     bdevperf -m <1<<CORE>, ustor --cores $CORE --poll-mode poll).
#     IOPS, average latency as each tool reports it, and ustor/SPDK ratios.
#  b. SPDK nvmf_tgt vs `ustor serve` as NVMe/TCP target: malloc namespace
#     (1 GiB, 4 KiB blocks), TCP on 127.0.0.1, target on core $TCORE
#     (nvmf_tgt -m <1<<TCORE>, ustor serve --cores $TCORE, modes $USTOR_MODES,
#     LANoT coalescer at the transport's default), both driven by the same
#     initiator: spdk_nvme_perf -c <1<<CORE> -L, 4 KiB randread/randwrite at
#     $NVMF_QDS. IOPS, avg and p99 latency (perf's -L summary), target CPU
#     (sum of /proc/PID/task/*/schedstat run time over the perf run) per I/O
#     and as % of a core, ratios ustor/SPDK. ustor's malloc disk is created
#     with `prefault: true` (USTOR_MALLOC=prefault, the default): faulted in
#     at creation with huge pages, the state nvmf_tgt's hugepage malloc disk
#     starts in. USTOR_MALLOC=lazy measures ustor's default disk instead,
#     whose pages are faulted in by first writes during the run (and whose
#     never-written extents read as zeros without a copy).
#
# Peer and ustor are interleaved (the tool is the innermost loop, repetition
# the outermost); each point starts a fresh process (nvmf targets too). The
# summary shows medians over REPEAT and the IOPS spread (half the min-max
# range over the median). Part a also pairs each round's ustor and bdevperf
# points: the per-round IOPS ratios, their median and min-max (on a VM
# whose speed drifts by tens of percent, the paired ratio is the figure to
# trust, not the ratio of medians). Both tools run under `nice -n $NICE`.
#
# The bdevperf measured is the one in SPDK_DIR: a tree built by
# `bench/spdk-build.sh` (DPDK shared) or `STATIC=1 bench/spdk-build.sh`
# (DPDK static, as SPDK ships it); the header line says which.
#
# Needs root (hugepages), SPDK built by bench/spdk-build.sh, python3.
# Usage: sudo [REPEAT=6] [RUNTIME=3] bench/spdk.sh
# Environment:
#   SPDK_DIR=$HOME/spdk      SPDK tree built by bench/spdk-build.sh
#   REPEAT=6 RUNTIME=3       repetitions (alternating rounds), seconds per point
#   NICE=-20                 nice level of both tools (0: leave as is)
#   CORE=1 TCORE=0           benchmark / initiator core; nvmf target core
#   BDEV_QDS="1 128"  NVMF_QDS="1 32 128"  RWS="randread randwrite"
#   BDEVS="null malloc"      USTOR_MODES="adaptive poll" (nvmf target modes)
#   PARTS="bdev nvmf"        SPDK_SOCK=posix|uring (nvmf_tgt sock impl; default posix)
#   PORT=4431                ustor port; SPDK uses PORT+1
#   USTOR_MALLOC=prefault    ustor's malloc namespace: prefault | lazy
#   NOBUILD=1 USTOR=path     skip cargo build / ustor binary
# Output: bench/results/spdk-<date>.txt (raw lines, then the summary).
set -euo pipefail

SPDK_DIR=${SPDK_DIR:-$HOME/spdk}
REPEAT=${REPEAT:-6}
NICE=${NICE:--20}
RUNTIME=${RUNTIME:-3}
CORE=${CORE:-1}
TCORE=${TCORE:-0}
BDEV_QDS=${BDEV_QDS:-"1 128"}
NVMF_QDS=${NVMF_QDS:-"1 32 128"}
RWS=${RWS:-"randread randwrite"}
BDEVS=${BDEVS:-"null malloc"}
USTOR_MODES=${USTOR_MODES:-"adaptive poll"}
PARTS=${PARTS:-"bdev nvmf"}
SPDK_SOCK=${SPDK_SOCK:-posix}
USTOR_MALLOC=${USTOR_MALLOC:-prefault}
PORT=${PORT:-4431}
SPORT=$((PORT + 1))
NQN=nqn.2016-06.io.spdk:cnode1

cd "$(dirname "$0")/.."
root=$(pwd)
stamp=$(date +%Y%m%d-%H%M%S)
out=$root/bench/results/spdk-$stamp.txt
mkdir -p "$root/bench/results"
die() {
    echo "spdk.sh: $*" >&2
    exit 2
}
[ "$(id -u)" -eq 0 ] || die "needs root (hugepages)"
BDEVPERF=$SPDK_DIR/build/examples/bdevperf
[ -x "$BDEVPERF" ] || BDEVPERF=$SPDK_DIR/test/bdev/bdevperf/bdevperf
NVMF_TGT=$SPDK_DIR/build/bin/nvmf_tgt
PERF=$SPDK_DIR/build/bin/spdk_nvme_perf
for b in "$BDEVPERF" "$NVMF_TGT" "$PERF"; do
    [ -x "$b" ] || die "$b missing: run bench/spdk-build.sh"
done
export LD_LIBRARY_PATH=$SPDK_DIR/build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mkdir -p /dev/hugepages
mountpoint -q /dev/hugepages || mount -t hugetlbfs nodev /dev/hugepages
[ "$(cat /proc/sys/vm/nr_hugepages)" -ge 1024 ] || echo 1024 >/proc/sys/vm/nr_hugepages

if [ -z "${NOBUILD:-}" ]; then
    cargo build --release -q -p ustor
fi
USTOR=${USTOR:-$root/target/release/ustor}
[ -x "$USTOR" ] || die "$USTOR missing"

tmp=$(mktemp -d /tmp/ustor-spdk.XXXXXX)
pids=""
cleanup() {
    for p in $pids; do kill "$p" 2>/dev/null || true; done
    [ -n "${KEEPTMP:-}" ] && echo "kept $tmp" || rm -rf "$tmp"
}
trap cleanup EXIT
cmask=$(printf '0x%x' $((1 << CORE)))
tmask=$(printf '0x%x' $((1 << TCORE)))

# --- configs (SPDK JSON format; ustor reads the same format) ---
cat >"$tmp/bdev-null.json" <<EOF
{"subsystems":[{"subsystem":"bdev","config":[
 {"method":"bdev_null_create","params":{"name":"Null0","num_blocks":2097152,"block_size":512}}]}]}
EOF
cat >"$tmp/bdev-malloc.json" <<EOF
{"subsystems":[{"subsystem":"bdev","config":[
 {"method":"bdev_malloc_create","params":{"name":"Malloc0","num_blocks":2097152,"block_size":512}}]}]}
EOF
nvmf_json() { # PORT [sock subsystem] [extra malloc params]
    local sock=""
    [ "$2" = "" ] || sock="{\"subsystem\":\"sock\",\"config\":[{\"method\":\"sock_set_default_impl\",\"params\":{\"impl_name\":\"$2\"}}]},"
    cat <<EOF
{"subsystems":[$sock
 {"subsystem":"bdev","config":[{"method":"bdev_malloc_create","params":{"name":"Malloc0","num_blocks":262144,"block_size":4096${3:-}}}]},
 {"subsystem":"nvmf","config":[
  {"method":"nvmf_create_transport","params":{"trtype":"TCP"}},
  {"method":"nvmf_create_subsystem","params":{"nqn":"$NQN","allow_any_host":true,"serial_number":"SPDK00000000000001","model_number":"bench"}},
  {"method":"nvmf_subsystem_add_ns","params":{"nqn":"$NQN","namespace":{"bdev_name":"Malloc0","nsid":1}}},
  {"method":"nvmf_subsystem_add_listener","params":{"nqn":"$NQN","listen_address":{"trtype":"TCP","adrfam":"IPv4","traddr":"127.0.0.1","trsvcid":"$1"}}}]}]}
EOF
}
case $USTOR_MALLOC in
prefault) nvmf_json "$PORT" "" ',"prefault":true' >"$tmp/ustor-nvmf.json" ;;
lazy) nvmf_json "$PORT" "" >"$tmp/ustor-nvmf.json" ;;
*) echo "USTOR_MALLOC must be prefault or lazy" >&2; exit 2 ;;
esac
if [ "$SPDK_SOCK" = posix ]; then
    nvmf_json "$SPORT" "" >"$tmp/spdk-nvmf.json"
else
    nvmf_json "$SPORT" "$SPDK_SOCK" >"$tmp/spdk-nvmf.json"
fi

load() { cut -d' ' -f1 /proc/loadavg; }

# --- part a: bdevperf / ustor bench ---
# bdev_point TOOL BDEV RW QD
bdev_point() {
    local tool=$1 bdev=$2 rw=$3 qd=$4 l r
    l=$(load)
    if [ "$tool" = bdevperf ]; then
        local name=Null0
        [ "$bdev" = malloc ] && name=Malloc0
        timeout $((RUNTIME + 60)) nice -n "$NICE" "$BDEVPERF" --no-pci --json "$tmp/bdev-$bdev.json" -m "$cmask" \
            -q "$qd" -o 4096 -w "$rw" -t "$RUNTIME" -T "$name" >"$tmp/bdevperf.out" 2>&1 || true
        # the table lines start with \r (bdevperf's live counter)
        r=$(tr -d '\r' <"$tmp/bdevperf.out" | awk '/^ *Total +:/ {print "iops=" $3 " lat_avg_us=" $7 " lat_max_us=" $9}')
        [ -n "$r" ] || r="FAILED $( (grep -E 'ERROR|rror' "$tmp/bdevperf.out" || true) | head -3 | tr '\n\t' '  ' | cut -c1-400)"
    else
        r=$(timeout $((RUNTIME + 60)) nice -n "$NICE" "$USTOR" bench -b "$bdev:1G" --cores "$CORE" --poll-mode poll \
            -w "$rw" --bs 4096 -q "$qd" -t "$RUNTIME" --json 2>/dev/null |
            python3 -c 'import json,sys; d=json.load(sys.stdin); t=d["total"]; print("iops=%.1f lat_avg_us=%.3f lat_max_us=%.3f lat_p99_us=%.3f cpu_ns_per_io=%.1f" % (t["iops"], t["lat_avg_us"], t["lat_max_us"], t["lat_p99_us"], d["cpu_ns_per_io"]))') || true
    fi
    [ -n "$r" ] || r="FAILED"
    echo "rep=$rep load=$l part=bdev tool=$tool bdev=$bdev rw=$rw qd=$qd $r"
}

# --- part b: nvmf_tgt / ustor serve, driven by spdk_nvme_perf ---
cpu_ns() { # PID: run time of all its threads, ns
    local s=0 t
    for t in /proc/"$1"/task/*/schedstat; do
        s=$((s + $(cut -d' ' -f1 "$t" 2>/dev/null || echo 0)))
    done
    echo "$s"
}
wait_listen() { # PORT PID
    local i
    for i in $(seq 200); do
        ss -Hltn "sport = :$1" | grep -q LISTEN && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.05
    done
    return 1
}
# nvmf_point TOOL RW QD
nvmf_point() {
    local tool=$1 rw=$2 qd=$3 l pid port c0 c1 t0 t1 r log=$tmp/target.log
    l=$(load)
    if ss -Hltn "sport = :$PORT or sport = :$SPORT" | grep -q LISTEN; then
        echo "rep=$rep load=$l part=nvmf tool=$tool rw=$rw qd=$qd FAILED port busy"
        return
    fi
    if [ "$tool" = nvmf_tgt ]; then
        port=$SPORT
        "$NVMF_TGT" -m "$tmask" --no-pci -r "$tmp/spdk.sock" --json "$tmp/spdk-nvmf.json" >"$log" 2>&1 &
    else
        port=$PORT
        "$USTOR" serve --cores "$TCORE" --poll-mode "${tool#ustor-}" -c "$tmp/ustor-nvmf.json" \
            -r "$tmp/ustor.sock" --log-level warn >"$log" 2>&1 &
    fi
    pid=$!
    pids="$pids $pid"
    if ! wait_listen "$port" "$pid"; then
        echo "rep=$rep load=$l part=nvmf tool=$tool rw=$rw qd=$qd FAILED target did not listen: $(tail -3 "$log" | tr '\n' ' ')"
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        return
    fi
    # The target's CPU is sampled from perf's "Launching workers" (after
    # connect; stdout line-buffered to see it) to perf's exit.
    c0=$(cpu_ns "$pid")
    t0=$(date +%s%N)
    timeout $((RUNTIME + 60)) stdbuf -oL "$PERF" -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$NQN" \
        -q "$qd" -o 4096 -w "$rw" -t "$RUNTIME" -c "$cmask" -L >"$tmp/perf.out" 2>&1 &
    local ppid=$! i
    for i in $(seq 400); do
        grep -q 'Launching workers' "$tmp/perf.out" && break
        kill -0 "$ppid" 2>/dev/null || break
        sleep 0.02
    done
    c0=$(cpu_ns "$pid")
    t0=$(date +%s%N)
    wait "$ppid" || true
    t1=$(date +%s%N)
    c1=$(cpu_ns "$pid")
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    r=$(python3 - "$tmp/perf.out" "$((c1 - c0))" "$((t1 - t0))" "$RUNTIME" <<'EOF'
import re, sys
txt = open(sys.argv[1]).read()
cpu, wall, secs = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
m = re.search(r"^Total\s*:\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", txt, re.M)
if not m:
    err = [l for l in txt.splitlines() if "ERROR" in l or "rror" in l][:3]
    print("FAILED " + " | ".join(err)[:400])
    sys.exit()
iops, avg, mx = float(m.group(1)), float(m.group(3)), float(m.group(5))
secs = min(secs, wall / 1e9) if wall else secs
p = {float(k): float(v) for k, v in re.findall(r"^\s*([\d.]+)%\s*:\s*([\d.]+)us", txt, re.M)}
p50, p99 = p.get(50.0, 0.0), p.get(99.0, 0.0)
ios = iops * secs
print("iops=%.1f lat_avg_us=%.2f lat_p50_us=%.2f lat_p99_us=%.2f lat_max_us=%.1f tgt_cpu_ns_per_io=%.0f tgt_cpu_pct=%.1f"
      % (iops, avg, p50, p99, mx, cpu / ios if ios else 0, 100.0 * cpu / wall))
EOF
)
    echo "rep=$rep load=$l part=nvmf tool=$tool rw=$rw qd=$qd $r"
}

{
    echo "# $(date -u) $(uname -r) $(nproc) cpus $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
    echo "# ustor $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD -- crates || echo '+dirty'); SPDK $(git -C "$SPDK_DIR" describe --tags 2>/dev/null) $(git -C "$SPDK_DIR" rev-parse --short HEAD); DPDK $(pkg-config --modversion libdpdk 2>/dev/null) ($(ldd "$BDEVPERF" | grep -q librte_eal && echo shared || echo static) in bdevperf)"
    echo "# cmd: USTOR_MALLOC=$USTOR_MALLOC REPEAT=$REPEAT RUNTIME=$RUNTIME NICE=$NICE CORE=$CORE TCORE=$TCORE BDEV_QDS=\"$BDEV_QDS\" NVMF_QDS=\"$NVMF_QDS\" USTOR_MODES=\"$USTOR_MODES\" SPDK_SOCK=$SPDK_SOCK bench/spdk.sh"
    echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    rep=1
    while [ "$rep" -le "$REPEAT" ]; do
        if [[ " $PARTS " == *" bdev "* ]]; then
            for bdev in $BDEVS; do
                for rw in $RWS; do
                    for qd in $BDEV_QDS; do
                        for tool in bdevperf ustor-bench; do
                            bdev_point "$tool" "$bdev" "$rw" "$qd"
                        done
                    done
                done
            done
        fi
        if [[ " $PARTS " == *" nvmf "* ]]; then
            for rw in $RWS; do
                for qd in $NVMF_QDS; do
                    for tool in nvmf_tgt $(for m in $USTOR_MODES; do echo "ustor-$m"; done); do
                        nvmf_point "$tool" "$rw" "$qd"
                    done
                done
            done
        fi
        rep=$((rep + 1))
    done
    echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out"

python3 - "$out" <<'EOF' | tee -a "$out"
import re, statistics as st, sys
rows = []
for line in open(sys.argv[1]):
    if not line.startswith("rep=") or "FAILED" in line:
        continue
    rows.append(dict(kv.split("=", 1) for kv in line.split() if "=" in kv))
def med(rs, k):
    v = [float(r[k]) for r in rs if k in r]
    return st.median(v) if v else float("nan")
def spread(rs):
    v = [float(r["iops"]) for r in rs]
    m = st.median(v)
    return 100 * (max(v) - min(v)) / 2 / m if m else 0
def fm(x):
    return "%.2f M" % (x / 1e6) if x >= 1e6 else "%.1f K" % (x / 1e3)
def group(part, keys):
    g = {}
    for r in rows:
        if r["part"] == part:
            g.setdefault(tuple(r[k] for k in keys), []).append(r)
    return g
failed = sum(1 for l in open(sys.argv[1]) if l.startswith("rep=") and "FAILED" in l)
print()
print("## a. SPDK bdevperf vs ustor bench (poll mode), 4 KiB, 1 core (medians of %s)" % (max((int(r["rep"]) for r in rows), default=0)))
print("| bdev | workload | QD | tool | IOPS | avg lat µs (tool's own) | QD/IOPS µs | ustor CPU ns/I/O | IOPS ustor/SPDK |")
print("|---|---|---|---|---|---|---|---|---|")
g = group("bdev", ["bdev", "rw", "qd", "tool"])
keys = sorted({k[:3] for k in g}, key=lambda k: (k[0] != "null", k[1], int(k[2])))
for k in keys:
    base = med(g.get(k + ("bdevperf",), []), "iops")
    for tool in ("bdevperf", "ustor-bench"):
        rs = g.get(k + (tool,))
        if not rs:
            continue
        i = med(rs, "iops")
        cpu = med(rs, "cpu_ns_per_io") if tool != "bdevperf" else None
        print("| %s | %s | %s | %s | %s ±%.0f%% | %.3f | %.3f | %s | %s |" % (
            k[0], k[1], k[2], tool, fm(i), spread(rs), med(rs, "lat_avg_us"), int(k[2]) / i * 1e6,
            "%.0f" % cpu if cpu is not None else "(spins: 1e9/IOPS = %.0f)" % (1e9 / i),
            "1.00" if tool == "bdevperf" else ("%.2f" % (i / base) if base == base else "n/a")))
print()
print("### a. paired rounds: ustor IOPS / bdevperf IOPS in the same round")
print("| bdev | workload | QD | rounds | per-round ratios | median | min-max |")
print("|---|---|---|---|---|---|---|")
for k in keys:
    b = {r["rep"]: float(r["iops"]) for r in g.get(k + ("bdevperf",), [])}
    u = {r["rep"]: float(r["iops"]) for r in g.get(k + ("ustor-bench",), [])}
    rat = [u[n] / b[n] for n in sorted(b, key=int) if n in u and b[n] > 0]
    if rat:
        print("| %s | %s | %s | %d | %s | %.2f | %.2f-%.2f |" % (k[0], k[1], k[2], len(rat),
              " ".join("%.2f" % x for x in rat), st.median(rat), min(rat), max(rat)))
print()
g = group("nvmf", ["rw", "qd", "tool"])
if g:
    print("## b. NVMe/TCP target, malloc namespace, target 1 core, spdk_nvme_perf initiator on the other core, 127.0.0.1 (medians)")
    print("| workload | QD | target | IOPS | avg lat µs | p50 µs | p99 µs | target CPU ns/I/O | target CPU % | IOPS per target core | IOPS ratio | avg lat ratio | CPU/I/O ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    keys = sorted({k[:2] for k in g}, key=lambda k: (k[0], int(k[1])))
    for k in keys:
        b = g.get(k + ("nvmf_tgt",), [])
        bi, bl, bc = med(b, "iops"), med(b, "lat_avg_us"), med(b, "tgt_cpu_ns_per_io")
        for tool in sorted({t[2] for t in g if t[:2] == k}, key=lambda t: (t != "nvmf_tgt", t)):
            rs = g[k + (tool,)]
            i, la, c = med(rs, "iops"), med(rs, "lat_avg_us"), med(rs, "tgt_cpu_ns_per_io")
            print("| %s | %s | %s | %s ±%.0f%% | %.1f | %.1f | %.1f | %.0f | %.0f | %s | %.2f | %.2f | %.2f |" % (
                k[0], k[1], tool, fm(i), spread(rs), la, med(rs, "lat_p50_us"), med(rs, "lat_p99_us"),
                c, med(rs, "tgt_cpu_pct"), fm(1e9 / c) if c else "-", i / bi, la / bl, c / bc))
    print()
    print("Ratios are ustor/SPDK (nvmf_tgt row = 1.00). IOPS per target core = 1e9 / (target CPU ns per I/O).")
print("failed points: %d" % failed)
EOF
echo "raw + summary: $out"
