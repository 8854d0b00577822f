#!/usr/bin/env bash
# Ceph RBD client cost (issue 22), in one run against one one-node cluster
# (scripts/ceph-cluster.sh, memstore OSD, no auth) on 1..4 images:
#
#   4 KiB randread / randwrite at QD1 and QD32 on N images (IMAGES) through
#   - ustor:      `ustor bench` on an rbd bdev (reactor on CORE, librados
#                 threads on the cores without a reactor: the default),
#   - ustor-same: the same with the cluster's core_mask = CORE (reactor and
#                 librados threads share one core: the placement experiment),
#   - ustor-poll: as ustor, the reactor in poll mode (never sleeps),
#   - ustor-intr: as ustor, the reactor in interrupt mode (sleeps as soon
#                 as it has nothing to do: no spin while Ceph works),
#   - ustor-same-intr: ustor-same with the reactor in interrupt mode,
#   - ustor-event: as ustor, completions through librbd's event socket
#                 (`completion: "event"`) instead of its callback,
#   - fio:        fio's rbd engine (librbd, fio's own thread; N jobs, one
#                 per image, each its own connection, all on CORE),
#   - fio-rados:  fio's rados engine (librados only, no librbd: the cost
#                 floor of a client that maps blocks to objects itself);
#                 per image a job over 64 objects of 4 MiB (the image's
#                 256 MiB), written once before the rounds,
#   - floor, floor-wait: bench/lib/rbd_floor.c, a bare C loop over
#                 librados' C API at QD1 on image 0's data objects (what ustor's
#                 direct path calls, nothing around it; `floor`: completion
#                 callback and a futex wake, ustor's hand-offs; `floor-wait`:
#                 no callback, rados_aio_wait_for_complete, one hand-off
#                 fewer): the floor of any librados client; QD1, 1 image only,
#   - bdevperf:   SPDK bdevperf with bdev_rbd (when SPDK_DIR has it; N
#                 bdevs on one reactor, one shared cluster),
#   - bdevperf-same: the same with the cluster's core_mask = CORE (every
#                 thread of the client on one core, as fio and ustor-same),
#   - any ustor tool prefixed `alt-` (`alt-ustor-same`): that tool with
#     the binary USTOR_ALT names (a code change A/B'd in one run),
#   - any ustor tool suffixed `-librbd` (`ustor-same-librbd`): that tool
#     with `rbd_direct: false` (librbd's data path; without the suffix
#     ustor takes the direct librados path where the image allows it:
#     FEATURES=layering makes images that do),
#   - any ustor tool suffixed `-batch` (`ustor-same-batch`, also before
#     `-librbd`): that tool with the cluster's `batch_completions: true`
#     (ustor's own option: the completion thread runs SCHED_BATCH), for a
#     same-binary A/B of the option,
#   - any ustor tool with `:key=value,key=value` appended (for example
#     `ustor-same:rbd_non_blocking_aio=true`): that tool with these Ceph
#     options in the cluster's config_param (over ustor's defaults); for
#     fio (`fio:rbd_cache=false`) they are appended to the config file its
#     librados reads; `debug0`, `debugdef` and `ustordef` stand for sets
#     of options (see `expand` below),
#   rounds alternating tool by tool. Per point: IOPS, mean latency, and the
#   client's CPU per I/O, from the process's user+system time (/usr/bin/time,
#   so every tool is measured the same way, connect included). The summary
#   gives medians over REPEAT and ratios against fio and bdevperf
#   (SPDK_REF).
#   The OSD runs on the same machine, so IOPS are the OSD's limit; client
#   CPU per I/O is the figure that compares the clients. ustor's reactor
#   runs in its default adaptive mode (it sleeps while waiting on Ceph);
#   SPDK's reactor polls, so bdevperf's CPU includes its spinning.
#   With N > 1 images ustor benches one raid0 bdev (4 KiB strips) over the
#   N rbd bdevs (one `ustor bench` drives one bdev): every 4 KiB I/O goes to
#   one image, spread evenly; QD is the total over the images for every
#   tool (fio and bdevperf: QD/N per image, rounded up).
#
# Usage: [REPEAT=3] [RUNTIME=5] bench/rbd.sh
# Environment: CORE=1 QDS="1 32" RWS="randread randwrite"
#   TOOLS="ustor ustor-same ustor-poll ustor-intr ustor-event fio bdevperf bdevperf-same"
#   IMAGES="1 2 4"
#   SPDK_DIR=../spdk NOBUILD=1 USTOR=path USTOR_ALT=path
#   FEATURES="" (`rbd create --image-feature`, comma-separated; empty:
#   Ceph's default features, which keep ustor on librbd's data path)
#   SPDK_REF=bdevperf (the tool the iops/spdk and cpu/spdk columns divide by;
#   bdevperf-same for the every-client-on-one-core comparison)
#   PAIR_BASES="fio" (tools each other tool is also compared with round by
#   round: the paired table)
#   SUMMARY=file: only print the tables for the raw lines in file (a
#   results file) and exit
# Output: bench/results/rbd-<date>.txt (raw lines, then the summary).
set -euo pipefail

REPEAT=${REPEAT:-3}
RUNTIME=${RUNTIME:-5}
CORE=${CORE:-1}
QDS=${QDS:-"1 32"}
RWS=${RWS:-"randread randwrite"}
TOOLS=${TOOLS:-"ustor ustor-same ustor-poll ustor-event fio bdevperf"}
IMAGES=${IMAGES:-1}
MAXIMG=$(tr ' ' '\n' <<<"$IMAGES" | sort -n | tail -1)

# summary RAW: the tables from a run's raw lines (medians and ratios, then
# paired ratios against each tool in PAIR_BASES).
summary() {
python3 - "$1" "${SPDK_REF:-bdevperf}" "${PAIR_BASES:-fio}" <<'PY'
import re, statistics, sys
pts, rounds = {}, {}
for line in open(sys.argv[1]):
    if line.startswith("#"):
        continue
    kv = dict(re.findall(r"(\w+)=(\S+)", line))
    if "iops" not in kv:
        continue
    pts.setdefault((kv["tool"], kv.get("imgs", "1"), kv["rw"], kv["qd"]), []).append(kv)
    rounds[(kv["rep"], kv["tool"], kv.get("imgs", "1"), kv["rw"], kv["qd"])] = kv
def med(k, f):
    v = [float(p[f]) for p in pts.get(k, []) if f in p and p[f] != "nan"]
    return statistics.median(v) if v else None
def ratio(a, b):
    return "%.2f" % (a / b) if a is not None and b else "-"
def num(v, f):
    return f % v if v is not None else "-"
w = max([11] + [len(k[0]) for k in pts])
print("\n%-*s %4s %-9s %4s %9s %9s %9s %9s %9s %9s %9s %9s" % (w, "tool", "imgs", "rw", "qd", "iops", "lat_us",
      "p99_us", "cpu_us/io", "iops/fio", "cpu/fio", "iops/spdk", "cpu/spdk"))
for (tool, n, rw, qd) in sorted(pts, key=lambda k: (k[2], int(k[3]), int(k[1]), k[0])):
    k = (tool, n, rw, qd)
    iops, lat, cpu = med(k, "iops"), med(k, "lat_avg_us"), med(k, "cpu_us_per_io")
    fio, spdk = ("fio", n, rw, qd), (sys.argv[2], n, rw, qd)
    print("%-*s %4s %-9s %4s %9s %9s %9s %9s %9s %9s %9s %9s" % (w, tool, n, rw, qd, num(iops, "%.0f"),
          num(lat, "%.1f"), num(med(k, "lat_p99_us"), "%.0f"), num(cpu, "%.2f"),
          ratio(iops, med(fio, "iops")), ratio(cpu, med(fio, "cpu_us_per_io")),
          ratio(iops, med(spdk, "iops")), ratio(cpu, med(spdk, "cpu_us_per_io"))))
# Paired: per round, the tool's figure over the base's in the same round
# (the runs next to each other), then the median over rounds: steadier
# than a ratio of medians when the machine's load drifts between rounds.
def paired(k, base, f):
    v = []
    for (rep, *rest), a in rounds.items():
        b = rounds.get((rep, base, *rest[1:]))
        if tuple(rest) == k and b and f in a and f in b and a[f] != "nan" and b[f] != "nan" and float(b[f]) > 0:
            v.append(float(a[f]) / float(b[f]))
    return v
for base in sys.argv[3].split():
    print("\npaired with %s (median over rounds of the same-round ratio; n rounds; rounds with lower CPU)" % base)
    print("%-*s %4s %-9s %4s %9s %9s %4s %5s" % (w, "tool", "imgs", "rw", "qd", "iops/b", "cpu/b", "n", "lower"))
    for (tool, n, rw, qd) in sorted(pts, key=lambda k: (k[2], int(k[3]), int(k[1]), k[0])):
        if tool == base:
            continue
        c, i = paired((tool, n, rw, qd), base, "cpu_us_per_io"), paired((tool, n, rw, qd), base, "iops")
        if c:
            print("%-*s %4s %-9s %4s %9.2f %9.2f %4d %5d" % (w, tool, n, rw, qd, statistics.median(i),
                  statistics.median(c), len(c), sum(x < 1 for x in c)))
PY
}

if [ -n "${SUMMARY:-}" ]; then
    grep '^#' "$SUMMARY" | head -1
    summary "$SUMMARY"
    exit 0
fi

cd "$(dirname "$0")/.."
root=$(pwd)
SPDK_DIR=${SPDK_DIR:-$root/../spdk}
stamp=$(date +%Y%m%d-%H%M%S)
out=$root/bench/results/rbd-$stamp.txt
mkdir -p "$root/bench/results"
tmp=$(mktemp -d)
cleanup() {
    scripts/ceph-cluster.sh stop "$tmp/ceph" >/dev/null 2>&1 || true
    rm -rf "$tmp"
}
trap cleanup EXIT

if [ -z "${NOBUILD:-}" ]; then
    cargo build --release -q -p ustor
fi
USTOR=${USTOR:-$root/target/release/ustor}
[ -x "$USTOR" ] || { echo "rbd.sh: $USTOR missing" >&2; exit 2; }
BDEVPERF=$SPDK_DIR/build/examples/bdevperf
[ -x "$BDEVPERF" ] || { echo "rbd.sh: no $BDEVPERF, bdevperf skipped" >&2; BDEVPERF=""; }

scripts/ceph-cluster.sh start "$tmp/ceph" --store memstore --auth none >/dev/null
export CEPH_CONF=$tmp/ceph/ceph.conf
for i in $(seq 0 $((MAXIMG - 1))); do
    rbd create --size 256M ${FEATURES:+--image-feature "$FEATURES"} rbd/img$i
    # Written once, so reads return data rather than holes.
    rbd bench --io-type write --io-pattern seq --io-size 4M --io-total 256M rbd/img$i >/dev/null
    if [[ " $TOOLS " == *" fio-rados"* ]]; then
        (cd "$tmp" && fio --ioengine=rados --conf="$CEPH_CONF" --clientname=admin --pool=rbd --rw=write \
            --bs=4M --name="rados$i" --nrfiles=64 --size=256M >/dev/null)
    fi
done

if [[ " $TOOLS " == *" floor"* ]]; then
    cc -O2 -o "$tmp/rbd_floor" bench/lib/rbd_floor.c -lrados
    FLOOR_OBJ=$(rbd info --format json rbd/img0 | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["block_name_prefix"], j["size"], j["object_size"])')
fi

# config MASK N [COMPLETION] [RAID] [PARAMS] [LIBRBD] [BATCH]: ustor/SPDK
# config with one cluster (core_mask MASK, or the default placement when
# empty; PARAMS: `k=v,k=v` Ceph options; with BATCH: `batch_completions`),
# rbd bdevs r0..rN-1 (with LIBRBD: `rbd_direct: false`) and, with RAID, a
# raid0 "all" over them.
config() {
    local mask="" comp="" n=$2 i sep="" bases="" params="" kv
    [ -n "$1" ] && mask=", \"core_mask\": \"$1\""
    [ -n "${7:-}" ] && mask="$mask, \"batch_completions\": true"
    [ -n "${3:-}" ] && comp=", \"completion\": \"$3\""
    [ -n "${6:-}" ] && comp="$comp, \"rbd_direct\": false"
    if [ -n "${5:-}" ]; then
        for kv in ${5//,/ }; do
            params="$params${params:+, }\"${kv%%=*}\": \"${kv#*=}\""
        done
        params=", \"config_param\": {$params}"
    fi
    {
        echo '{"subsystems": [{"subsystem": "bdev", "config": ['
        echo "  {\"method\": \"bdev_rbd_register_cluster\", \"params\": {\"name\": \"c1\", \"config_file\": \"$CEPH_CONF\"$mask$params}}"
        for i in $(seq 0 $((n - 1))); do
            echo "  ,{\"method\": \"bdev_rbd_create\", \"params\": {\"name\": \"r$i\", \"cluster_name\": \"c1\", \"pool_name\": \"rbd\", \"rbd_name\": \"img$i\", \"block_size\": 4096$comp}}"
            bases="$bases$sep\"r$i\""
            sep=", "
        done
        if [ -n "${4:-}" ]; then
            echo "  ,{\"method\": \"bdev_raid_create\", \"params\": {\"name\": \"all\", \"raid_level\": \"raid0\", \"strip_size_kb\": 4, \"base_bdevs\": [$bases]}}"
        fi
        echo ']}]}'
    } >"$tmp/cfg.json"
}

# cpu_us_per_io IOPS: client CPU per I/O from /usr/bin/time's output.
cpu_per_io() {
    awk -v iops="$1" -v t="$RUNTIME" '/^CPU / {u=$2; s=$3} END {if (iops > 0) printf "%.2f", (u + s) * 1e6 / (iops * t); else print "nan"}' "$tmp/time"
}

# Ceph's client-side debug subsystems (what a librbd client logs), at
# their Ceph 16 defaults (level/gather: entries up to the gather level are
# built in memory even when nothing is written) and at 0/0.
DEBUG_DEFAULTS="rbd=0/5 rados=0/5 objecter=0/1 ms=0/0 monc=0/10 auth=1/5 finisher=1/1
 throttle=1/1 timer=0/1 tp=0/5 buffer=0/1 context=0/1 objectcacher=0/5 striper=0/1 crypto=1/5
 asok=1/5 perfcounter=1/5 journaler=0/5 heartbeatmap=1/5 none=0/5 optracker=0/5 filer=0/1"
# expand PARAMS: `debug0` / `debugdef` stand for every subsystem above at
# 0/0 / at Ceph's defaults; `ustordef` for ustor's own defaults (for fio).
expand() {
    local out="" p d
    for p in ${1//,/ }; do
        case $p in
        debug0) for d in $DEBUG_DEFAULTS; do out="$out,debug_${d%%=*}=0/0"; done ;;
        debugdef) for d in $DEBUG_DEFAULTS; do out="$out,debug_$d"; done ;;
        ustordef) out="$out,rbd_cache=false,librados_thread_count=1,ms_async_op_threads=1,admin_socket=" ;;
        *) out="$out,$p" ;;
        esac
    done
    echo "${out#,}"
}

point() { # TOOL RW QD N
    local tool=$1 rw=$2 qd=$3 n=$4 r="" iops i params=""
    # `tool:k=v,...`: the tool with these Ceph options.
    if [[ $tool == *:* ]]; then params=$(expand "${tool#*:}") tool=${tool%%:*}; fi
    # `alt-ustor...`: that ustor tool with the USTOR_ALT binary (A/B of a
    # code change in one run).
    local bin=$USTOR librbd="" batch=""
    if [[ $tool == alt-* ]]; then bin=${USTOR_ALT:?alt- tools need USTOR_ALT} tool=${tool#alt-}; fi
    if [[ $tool == ustor*-librbd ]]; then librbd=1 tool=${tool%-librbd}; fi
    if [[ $tool == ustor*-batch ]]; then batch=1 tool=${tool%-batch}; fi
    local timed=(/usr/bin/time -o "$tmp/time" -f "CPU %U %S" timeout $((RUNTIME + 60)))
    local raid="" bdev=r0 mask="" comp="" perimg=$(((qd + n - 1) / n))
    if [ "$n" -gt 1 ]; then raid=1 bdev=all; fi
    case $tool in
    ustor | ustor-same | ustor-poll | ustor-intr | ustor-same-intr | ustor-event)
        local mode=adaptive
        [ "$tool" = ustor-poll ] && mode=poll
        [[ $tool == *-intr ]] && mode=interrupt
        [[ $tool == ustor-same* ]] && mask="[$CORE]"
        [ "$tool" = ustor-event ] && comp=event
        config "$mask" "$n" "$comp" "$raid" "$params" "$librbd" "$batch"
        r=$("${timed[@]}" "$bin" bench -c "$tmp/cfg.json" -b "$bdev" --cores "$CORE" --poll-mode "$mode" \
            -w "$rw" --bs 4096 -q "$qd" -t "$RUNTIME" --json 2>/dev/null |
            python3 -c 'import json,sys; t=json.load(sys.stdin)["total"]; print("iops=%.1f lat_avg_us=%.1f lat_p99_us=%.1f" % (t["iops"], t["lat_avg_us"], t["lat_p99_us"]))') || true
        ;;
    fio)
        local jobs=()
        for i in $(seq 0 $((n - 1))); do jobs+=(--name="rbd$i" --rbdname="img$i"); done
        # `fio:k=v,...`: these Ceph options appended to the config file
        # fio's librados reads (ustor's tools get them as config_param).
        local conf=$CEPH_CONF
        if [ -n "$params" ]; then
            conf=$tmp/fio-ceph.conf
            { cat "$CEPH_CONF"; tr ',' '\n' <<<"$params" | sed 's/=/ = /'; } >"$conf"
        fi
        r=$(CEPH_CONF=$conf "${timed[@]}" taskset -c "$CORE" fio --ioengine=rbd --clientname=admin \
            --pool=rbd --rw="$rw" --bs=4k --iodepth="$perimg" --direct=1 --group_reporting \
            --time_based --runtime="$RUNTIME" --output-format=json "${jobs[@]}" 2>/dev/null |
            python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; d=j["read"] if j["read"]["iops"] > 0 else j["write"]; print("iops=%.1f lat_avg_us=%.1f lat_p99_us=%.1f" % (d["iops"], d["clat_ns"]["mean"] / 1000, d["clat_ns"]["percentile"]["99.000000"] / 1000))') || true
        ;;
    fio-rados)
        local jobs=()
        for i in $(seq 0 $((n - 1))); do jobs+=(--name="rados$i" --nrfiles=64 --size=256M); done
        local conf=$CEPH_CONF
        if [ -n "$params" ]; then
            conf=$tmp/fio-ceph.conf
            { cat "$CEPH_CONF"; tr ',' '\n' <<<"$params" | sed 's/=/ = /'; } >"$conf"
        fi
        r=$(cd "$tmp" && "${timed[@]}" taskset -c "$CORE" fio --ioengine=rados --conf="$conf" --clientname=admin \
            --pool=rbd --rw="$rw" --bs=4k --iodepth="$perimg" --group_reporting \
            --time_based --runtime="$RUNTIME" --output-format=json "${jobs[@]}" 2>/dev/null |
            python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; d=j["read"] if j["read"]["iops"] > 0 else j["write"]; print("iops=%.1f lat_avg_us=%.1f lat_p99_us=%.1f" % (d["iops"], d["clat_ns"]["mean"] / 1000, d["clat_ns"]["percentile"]["99.000000"] / 1000))') || true
        ;;
    floor | floor-wait)
        [ "$qd" = 1 ] && [ "$n" = 1 ] || return 0
        local mode=cb
        [ "$tool" = floor-wait ] && mode=wait
        # shellcheck disable=SC2086 # FLOOR_OBJ: prefix, image and object size
        r=$("${timed[@]}" taskset -c "$CORE" "$tmp/rbd_floor" $FLOOR_OBJ "${rw#rand}" "$mode" "$RUNTIME" ${params//,/ }) || true
        ;;
    bdevperf | bdevperf-same)
        [ -n "$BDEVPERF" ] || return 0
        [ "$tool" = bdevperf-same ] && mask="[$CORE]"
        config "$mask" "$n" "" "" "$params"
        LD_LIBRARY_PATH=$SPDK_DIR/build/lib:$SPDK_DIR/dpdk/build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
            "${timed[@]}" "$BDEVPERF" --no-pci --json "$tmp/cfg.json" -m $((1 << CORE)) \
            -q "$perimg" -o 4096 -w "$rw" -t "$RUNTIME" >"$tmp/bdevperf.out" 2>&1 || true
        r=$(tr -d '\r' <"$tmp/bdevperf.out" | awk '/^ *Total +:/ {print "iops=" $3 " lat_avg_us=" $7}')
        [ -n "$r" ] || tail -5 "$tmp/bdevperf.out" >&2
        ;;
    esac
    iops=$(sed -n 's/.*iops=\([0-9.]*\).*/\1/p' <<<"$r")
    if [ -n "$iops" ]; then r="$r cpu_us_per_io=$(cpu_per_io "$iops")"; fi
    echo "rep=$rep tool=$1 imgs=$n rw=$rw qd=$qd ${r:-FAILED}"
}

{
    echo "# rbd.sh $stamp $(uname -r) $(nproc) cpus; ustor $(git rev-parse --short HEAD); runtime ${RUNTIME}s, client core $CORE${FEATURES:+; image features $FEATURES}${USTOR_ALT:+; alt- tools: $(basename "$USTOR_ALT")}; ustor: $(basename "$USTOR")"
    echo "# start: $(uptime)"
    for rep in $(seq "$REPEAT"); do
        for rw in $RWS; do
            for qd in $QDS; do
                for n in $IMAGES; do
                    for tool in $TOOLS; do
                        point "$tool" "$rw" "$qd" "$n"
                    done
                done
            done
        done
    done
    echo "# end: $(uptime)"
} | tee "$out.raw"

{
    cat "$out.raw"
    summary "$out.raw"
} >"$out"
sed -n '/^$/,$p' "$out"
rm -f "$out.raw"
