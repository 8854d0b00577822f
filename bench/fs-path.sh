#!/usr/bin/env bash
# Where a 4 KiB QD1 request through `ustor fs mount` goes: per request, the
# thread switches of each thread of the server (`ustor serve`) and of the
# mount process (voluntary context switches from /proc: a thread that
# blocks and is woken again, i.e. one hand-off to it), and the system calls
# of each process (strace -c -f, in a second pass: tracing slows it down).
# fio psync QD1 O_DIRECT 4 KiB random reads and writes of N requests each,
# on a region in /dev/shm, over TCP on 127.0.0.1, every process pinned to
# CPU 0 (PIN=0-1 to let them spread). Latency and CPU time per request (of
# each process, from /proc/PID/task/*/schedstat) come from the untraced
# pass. COPY=1 exports with copy_writes (the one-copy ablation); BS sets
# the request size; MODE=uring mounts on FUSE over io_uring (the queue
# threads, fuse-ring-N, stay on their own CPUs as in bench/fs.sh).
# XDP=1 puts the server in one network namespace exporting over Transport
# 2 (AF_XDP on a veth, copy mode) and the mount (over xdp://) in another;
# XDP=tcp the same namespaces and veth with the export over TCP (10.99.8.1).
#
# Usage: bench/fs-path.sh
#   env: USTOR=target/release/ustor N=3000 PIN=0 BS=4k COPY=0 MODE=classic
#        SERVE_ARGS= (more `ustor serve` options, e.g. "--poll-mode interrupt")
#        EXPORT_JSON= (more fs_export members, e.g. ',"spin_us":50')
#        MALLOC=1 (the traced pass also counts each process's malloc calls,
#        with a perf uprobe on libc's malloc, added for the run)
#        PERF= (a percentage: a third pass profiles the mount and the
#        server with perf, and each one's functions over that share of
#        its samples are listed)
#        RWS="randread randwrite" XDP=0 VETH_MTU= (XDP=1 or tcp: the veth's
#        MTU, and with 1 the export's; default 1500)
# Needs root (FUSE, ip netns), fio, strace, python3.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/veth.sh

USTOR=${USTOR:-target/release/ustor}
N=${N:-3000}
PIN=${PIN:-0}
BS=${BS:-4k}
COPY=${COPY:-0}
XDP=${XDP:-0}
RWS=${RWS:-randread randwrite}
MODE=${MODE:-classic}
URING_PARAM=/sys/module/fuse/parameters/enable_uring
URING_WAS=
if [ "$MODE" = uring ]; then
    URING_WAS=$(cat "$URING_PARAM")
    echo Y > "$URING_PARAM"
fi
copy=""
[ "$COPY" = 1 ] && copy=',"copy_writes":true'
W=$(mktemp -d /dev/shm/ustor-fs-path.XXXXXX)
PIDS=()
cleanup() {
    mountpoint -q "$W/m" && umount -l "$W/m" || true
    [ -n "$URING_WAS" ] && echo "$URING_WAS" > "$URING_PARAM"
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ "$XDP" != 0 ]; then veth_del "$NSA" "$NSB"; fi
    [ -n "$PROBE_ADDED" ] && perf probe -q -d probe_libc:malloc
    rm -rf "$W"
}
trap cleanup EXIT
LIBC=$(ldconfig -p | awk '/libc\.so\.6 .*x86-64/ {l = $NF} END {print l}')
PROBE_ADDED=
if [ "${MALLOC:-0}" = 1 ] && ! perf probe -l 2>/dev/null | grep -q 'probe_libc:malloc '; then
    perf probe -q -x "$LIBC" -a malloc
    PROBE_ADDED=1
fi
NSA=ufpA$$ NSB=ufpB$$ VA=ufpa$$ VB=ufpb$$
# INA, INB: what runs the server, the mount (in their namespaces when XDP=1).
INA=() INB=()
listen=""
if [ "$XDP" != 0 ]; then
    veth_pair "$NSA" "$NSB" "$VA" "$VB" 10.99.8.1/24 10.99.8.2/24
    INA=(ip netns exec "$NSA")
    INB=(nsenter --net=/run/netns/"$NSB")
    listen='"listen":"10.99.8.1:4800"'
    [ "$XDP" = 1 ] && listen='"listen":"'$VA'","transport":"xdp"'$(xdp_mtu_param)
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
[ -n "$listen" ] || listen='"listen":"127.0.0.1:'$port'"'
echo secret > "$W/secret"
cat > "$W/cfg.json" <<CFG
{"subsystems":[{"subsystem":"fs","config":[
 {"method":"fs_create","params":{"name":"vol","path":"$W/region","size":$((128 << 20))}},
 {"method":"fs_export","params":{"name":"vol",$listen,"secret_file":"$W/secret"$copy${EXPORT_JSON:-}}}]}]}
CFG
"${INA[@]}" taskset -c "$PIN" "$USTOR" serve --cores 0 --no-pin ${SERVE_ARGS:-} -r "$W/rpc.sock" -c "$W/cfg.json" \
    --log-level warn >"$W/serve.log" 2>&1 &
SERVE=$!
PIDS+=($SERVE)
for _ in $(seq 100); do "$USTOR" rpc -s "$W/rpc.sock" fs_get_exports >/dev/null 2>&1 && break; sleep 0.1; done
mkdir -p "$W/m"
target=127.0.0.1:$port/vol
[ "$XDP" = 1 ] && target=xdp://$VB/vol
[ "$XDP" = tcp ] && target=10.99.8.1:4800/vol
"${INB[@]}" taskset -c "$PIN" "$USTOR" fs mount "$target" "$W/m" --secret-file "$W/secret" \
    --fuse-mode "$MODE" >"$W/mount.log" 2>&1 &
MOUNT=$!
PIDS+=($MOUNT)
for _ in $(seq 100); do mountpoint -q "$W/m" && break; sleep 0.1; done
mountpoint -q "$W/m" || { cat "$W/mount.log" "$W/serve.log"; exit 1; }
fio --name=lay --directory="$W/m" --filename=f --size=16m --rw=write --bs=1m >/dev/null

# "thread-name voluntary nonvoluntary" summed over threads of one name.
switches() {
    local t
    for t in /proc/"$1"/task/*; do
        printf '%s %s %s\n' "$(tr ' ' _ < "$t/comm")" \
            "$(awk '/^voluntary_ctxt_switches/ {print $2}' "$t/status")" \
            "$(awk '/^nonvoluntary_ctxt_switches/ {print $2}' "$t/status")"
    done | awk '{v[$1] += $2; n[$1] += $3} END {for (k in v) print k, v[k], n[k]}' | sort
}

# CPU time of all threads of a process so far, in ns.
cpu_ns() { cat /proc/"$1"/task/*/schedstat | awk '{s += $1} END {printf "%d", s}'; }

run_fio() { # rw -> "mean_us p50_us"
    taskset -c "$PIN" fio --name=p --directory="$W/m" --filename=f --size=16m --ioengine=psync \
        --iodepth=1 --direct=1 --rw="$1" --bs="$BS" --io_size=1t --number_ios="$N" --lat_percentiles=1 \
        --percentile_list=50 --output-format=json 2>/dev/null | python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
k = "read" if j["read"]["io_bytes"] else "write"
l = j[k]["lat_ns"]
print("%.1f %.1f" % (l["mean"] / 1e3, l["percentile"]["50.000000"] / 1e3))'
}

echo "# bench/fs-path.sh $(date -u +%FT%TZ), $(uname -r), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# USTOR=$USTOR N=$N PIN=$PIN BS=$BS COPY=$COPY MODE=$MODE XDP=$XDP${EXPORT_JSON:+ EXPORT_JSON=$EXPORT_JSON}"
for rw in $RWS; do
    run_fio "$rw" >/dev/null # warm
    s0=$( { switches $SERVE | sed 's/^/serve:/'; switches $MOUNT | sed 's/^/mount:/'; } | sort)
    c0="$(cpu_ns $SERVE) $(cpu_ns $MOUNT)"
    lat=$(run_fio "$rw")
    c1="$(cpu_ns $SERVE) $(cpu_ns $MOUNT)"
    s1=$( { switches $SERVE | sed 's/^/serve:/'; switches $MOUNT | sed 's/^/mount:/'; } | sort)
    echo
    echo "$rw $BS QD1: mean/p50 latency $lat us (untraced)"
    echo "$c0 $c1" | awk -v n="$N" '{printf "  CPU per request: serve %.1f us, mount %.1f us\n", ($3 - $1) / n / 1e3, ($4 - $2) / n / 1e3}'
    echo "  thread switches per request (voluntary = blocked and woken; involuntary):"
    join <(echo "$s0") <(echo "$s1") | awk -v n="$N" \
        '{v = ($4 - $2) / n; i = ($5 - $3) / n; if (v + i >= 0.05) printf "    %-28s %5.2f %5.2f\n", $1, v, i}'
    for p in serve:$SERVE mount:$MOUNT; do
        strace -c -f -p "${p#*:}" -o "$W/strace-${p%%:*}" 2>/dev/null &
        PIDS+=($!)
        if [ "${MALLOC:-0}" = 1 ]; then
            perf stat -x, -e probe_libc:malloc -p "${p#*:}" -o "$W/malloc-${p%%:*}" 2>/dev/null &
            PIDS+=($!)
        fi
    done
    sleep 1
    run_fio "$rw" >/dev/null
    for p in "${PIDS[@]:2}"; do kill -INT "$p" 2>/dev/null || true; done
    wait "${PIDS[@]:2}" 2>/dev/null || true
    PIDS=("${PIDS[@]:0:2}")
    echo "  system calls per request (strace -c -f; the traced pass):"
    for p in serve mount; do
        awk -v n="$N" -v p="$p" 'NF >= 5 && $1 ~ /^[0-9.]+$/ && $NF != "total" {
            if ($4 / n >= 0.05) printf "    %-6s %-16s %5.2f\n", p, $NF, $4 / n }' \
            "$W/strace-$p"
    done
    if [ "${MALLOC:-0}" = 1 ]; then
        for p in serve mount; do
            awk -F, -v n="$N" -v p="$p" '/malloc/ {printf "  %s malloc calls per request: %.2f (traced pass)\n", p, $1 / n}' \
                "$W/malloc-$p"
        done
    fi
    if [ -n "${PERF:-}" ]; then
        # A third pass under `perf record -g` of the mount and the server:
        # where their CPU goes.
        for p in serve:$SERVE mount:$MOUNT; do
            perf record -q -g -p "${p#*:}" -o "$W/perf-$rw-${p%%:*}.data" 2>/dev/null &
            PIDS+=($!)
        done
        sleep 1
        run_fio "$rw" >/dev/null
        for p in "${PIDS[@]:2}"; do kill -INT "$p" 2>/dev/null || true; done
        wait "${PIDS[@]:2}" 2>/dev/null || true
        PIDS=("${PIDS[@]:0:2}")
        for p in mount serve; do
            echo "  $p's CPU by function (perf, the third pass; self, over ${PERF}%):"
            perf report -i "$W/perf-$rw-$p.data" --no-children --sort dso,sym --percent-limit "$PERF" \
                --stdio -g none 2>/dev/null | awk '/%/ && !/^#/ {printf "    %s\n", $0}'
        done
    fi
done
