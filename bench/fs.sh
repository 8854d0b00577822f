#!/usr/bin/env bash
# Issue 23's experiment: ustor's file service through its FUSE client
# (`ustor fs mount`) against nfs-ganesha (NFSv3, measured with libnfs: no
# kernel client), sshfs without encryption (openssh's sftp-server behind
# socat, `-o directport`), also with `-o sshfs_sync`, and against itself
# with the one-copy ablation (ustor_copy: fs_export's copy_writes, a
# write received into a buffer and copied), bounded below by the
# FUSE floor (bench/lib/fuse_floor.c: one file in memory behind FUSE) and
# local tmpfs. floor_tcp is the same floor with the file in a trivial peer
# process behind one loopback TCP connection (FLOOR_TCP=1: each request's
# payload forwarded, its reply awaited): the least any networked FUSE file
# system pays here, so ustor/floor_tcp is the part of the gap that is ours. ustor_lib is ustor's client library with no kernel
# crossing (crates/fs-client/examples/fsbench.rs, the same loop as
# nfsbench), the like-for-like peer of libnfs; ustor_lib_copy is the same
# against the one-copy export (the ablation without FUSE in the path);
# ustor_lib_zc the same against an export with send_zc (read replies of
# 16 KiB and more sent with SENDMSG_ZC; on loopback the kernel copies
# anyway, so this prices the zero-copy send's extra completion). ustor is
# the mount on classic /dev/fuse, ustor_uring the same export mounted on
# FUSE over io_uring (`--fuse-mode uring`, one queue per CPU on a thread
# pinned to it; the script sets /sys/module/fuse/parameters/enable_uring
# to Y for the run and puts it back). ustor_alt is ustor_uring from another
# build (USTOR_ALT=<binary>: its own server, export and mount), so a change
# and its base alternate in one run. Every server serves from
# /dev/shm (tmpfs), over TCP on 127.0.0.1, except the veth targets:
# ustor_xdp (the uring mount over Transport 2, AF_XDP in copy mode),
# ustor_veth (the uring mount over TCP) and ganesha_veth (libnfs), each
# with its server in one network namespace and its client in another,
# joined by a veth pair (see below).
#
# Workloads: QD1 psync O_DIRECT 4 KiB randread/randwrite, 1 KiB randwrite
# (the ablation's case) and 1 MiB
# sequential read/write (fio; ganesha: bench/lib/nfsbench.c, the same loop
# over libnfs), and meta (create + stat + unlink of NFILES files). Each
# placement is measured: "pinned" puts every process of the run (servers,
# FUSE daemons, the load generator) on CPU 0, "unpinned" lets them use all
# CPUs (a cross-CPU wake-up costs 40-80 us on a VM whose idle vCPUs halt).
# The uring mount's queue threads (named fuse-ring-N) keep their own CPU in
# both placements: a request goes to the queue of its caller's CPU.
# Rounds interleave everything: per round, per placement, per workload,
# every target in turn (the order rotates each round). Cells are medians
# over rounds of mean latency, p50, p99 and throughput.
#
# Prints one table per placement and workload, and ustor's ratios against
# each peer: latency ratio (ustor/peer, < 1: ustor faster) and throughput
# ratio (ustor/peer, > 1: ustor faster). Raw cells go to $OUT.raw.
#
# Usage: cargo build --release -p ustor -p ustor-fs-client --example fsbench
#        bench/fs.sh
#   env: USTOR=target/release/ustor ROUNDS=3 RUNTIME=3 SIZE_MIB=64
#        NFILES=300 TARGETS="ustor ustor_uring ustor_lib ustor_copy ganesha sshfs sshfs_sync floor floor_tcp tmpfs"
#        (also: ustor_alt ustor_lib_copy ustor_lib_zc ustor_xdp ustor_veth ganesha_veth)
#        FSBENCH=target/release/examples/fsbench USTOR_ALT=<another ustor build> (target ustor_alt)
#        WORKS="randread:4k randwrite:4k randwrite:1k read:1m write:1m meta"
#        PLACES="pinned unpinned" OUT=bench/results/fs-<date>.txt
#        XDP_EXPORT_JSON= (more fs_export members for ustor_xdp's export,
#        e.g. ',"spin_us":50')
#        VETH_MTU= (the veth targets' link MTU, and the xdp export's; e.g.
#        3500 for larger AF_XDP frames; default 1500)
# Needs root (mount, unshare, ip netns), fio, sshfs, socat, openssh-sftp-server,
# nfs-ganesha + nfs-ganesha-vfs, libnfs-dev, libfuse3-dev, a C compiler,
# python3 (.ci/apt/bench.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/veth.sh

USTOR=${USTOR:-target/release/ustor}
FSBENCH=${FSBENCH:-target/release/examples/fsbench}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-3}
SIZE_MIB=${SIZE_MIB:-64}
NFILES=${NFILES:-300}
TARGETS=${TARGETS:-ustor ustor_uring ustor_lib ustor_copy ganesha sshfs sshfs_sync floor floor_tcp tmpfs}
WORKS=${WORKS:-randread:4k randwrite:4k randwrite:1k read:1m write:1m meta}
PLACES=${PLACES:-pinned unpinned}
SFTP=${SFTP:-/usr/lib/openssh/sftp-server}
OUT=${OUT:-bench/results/fs-$(date -u +%Y%m%d-%H%M).txt}
ALL_CPUS=0-$(($(nproc) - 1))
mkdir -p "$(dirname "$OUT")"
: > "$OUT.raw"

W=$(mktemp -d /dev/shm/ustor-fs-bench.XXXXXX)
PIDS=()
MOUNTS=()
# $1 and all of its descendants.
tree() {
    local c
    echo "$1"
    for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$c"; done
}
URING_PARAM=/sys/module/fuse/parameters/enable_uring
URING_WAS=
NETNS=
cleanup() {
    for m in "${MOUNTS[@]}"; do mountpoint -q "$m" && umount -l "$m" || true; done
    [ -n "$URING_WAS" ] && echo "$URING_WAS" > "$URING_PARAM"
    for p in "${PIDS[@]}"; do kill $(tree "$p") 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ -n "$NETNS" ]; then veth_del "$NSA" "$NSB"; fi
    rm -rf "$W"
}
trap cleanup EXIT
has() { [[ " $TARGETS " == *" $1 "* ]]; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_mount() {
    for _ in $(seq 100); do mountpoint -q "$1" && return 0; sleep 0.1; done
    echo "no mount at $1" >&2
    return 1
}

# Load generators.
cc -O2 -o "$W/nfsbench" bench/lib/nfsbench.c -lnfs
cc -O2 -o "$W/fuse_floor" bench/lib/fuse_floor.c $(pkg-config --cflags --libs fuse3)

if has ustor_uring; then
    [ -e "$URING_PARAM" ] || { echo "ustor_uring: this kernel has no FUSE over io_uring" >&2; exit 1; }
    URING_WAS=$(cat "$URING_PARAM")
    echo Y > "$URING_PARAM"
fi

if has ustor || has ustor_uring || has ustor_lib || has ustor_copy || has ustor_lib_copy || has ustor_lib_zc; then
    UPORT=$(free_port)
    CPORT=$(free_port)
    ZPORT=$(free_port)
    echo "secret" > "$W/secret"
    vol() { # name port copy_writes
        echo '{"method":"fs_create","params":{"name":"'$1'","path":"'$W/region-$1'","size":'$(( (SIZE_MIB * 2 + 256) << 20 ))'}},'
        echo '{"method":"fs_export","params":{"name":"'$1'","listen":"127.0.0.1:'$2'","secret_file":"'$W/secret'"'$3'}}'
    }
    VOLS=()
    (has ustor || has ustor_uring || has ustor_lib) && VOLS+=("$(vol vol $UPORT "")")
    (has ustor_copy || has ustor_lib_copy) && VOLS+=("$(vol copy $CPORT ',"copy_writes":true')")
    has ustor_lib_zc && VOLS+=("$(vol zc $ZPORT ',"send_zc":true')")
    {
        echo '{"subsystems":[{"subsystem":"fs","config":['
        (IFS=,; echo "${VOLS[*]}")
        echo ']}]}'
    } > "$W/cfg.json"
    # One reactor; placement comes from taskset below, not from ustor.
    "$USTOR" serve --cores 0 --no-pin -r "$W/rpc.sock" -c "$W/cfg.json" --log-level warn >"$W/serve.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do "$USTOR" rpc -s "$W/rpc.sock" fs_get_exports >/dev/null 2>&1 && break; sleep 0.1; done
    for t in ustor:vol:$UPORT:classic ustor_copy:copy:$CPORT:classic ustor_uring:vol:$UPORT:uring; do
        IFS=: read -r tn vn port mode <<< "$t"
        has "$tn" || continue
        mkdir -p "$W/m-$tn"
        "$USTOR" fs mount "127.0.0.1:$port/$vn" "$W/m-$tn" --secret-file "$W/secret" \
            --fuse-mode "$mode" >"$W/mount-$tn.log" 2>&1 &
        PIDS+=($!)
        MOUNTS+=("$W/m-$tn")
        wait_mount "$W/m-$tn" || { cat "$W/mount-$tn.log" "$W/serve.log"; exit 1; }
    done
fi

# ustor_alt: another ustor build (USTOR_ALT, e.g. the base of a change)
# with its own server, export and uring mount, alternated with the others
# in the same run: base and new measured side by side.
if has ustor_alt; then
    [ -n "${USTOR_ALT:-}" ] || { echo "ustor_alt: set USTOR_ALT to a ustor binary" >&2; exit 1; }
    [ -e "$URING_PARAM" ] || { echo "ustor_alt: this kernel has no FUSE over io_uring" >&2; exit 1; }
    [ -n "$URING_WAS" ] || { URING_WAS=$(cat "$URING_PARAM"); echo Y > "$URING_PARAM"; }
    APORT=$(free_port)
    echo "secret" > "$W/secret"
    cat > "$W/cfg-alt.json" <<CFG
{"subsystems":[{"subsystem":"fs","config":[
 {"method":"fs_create","params":{"name":"alt","path":"$W/region-alt","size":$(( (SIZE_MIB * 2 + 256) << 20 ))}},
 {"method":"fs_export","params":{"name":"alt","listen":"127.0.0.1:$APORT","secret_file":"$W/secret"}}]}]}
CFG
    "$USTOR_ALT" serve --cores 0 --no-pin -r "$W/rpc-alt.sock" -c "$W/cfg-alt.json" --log-level warn >"$W/serve-alt.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do "$USTOR_ALT" rpc -s "$W/rpc-alt.sock" fs_get_exports >/dev/null 2>&1 && break; sleep 0.1; done
    mkdir -p "$W/m-ustor_alt"
    "$USTOR_ALT" fs mount "127.0.0.1:$APORT/alt" "$W/m-ustor_alt" --secret-file "$W/secret" \
        --fuse-mode uring >"$W/mount-ustor_alt.log" 2>&1 &
    PIDS+=($!)
    MOUNTS+=("$W/m-ustor_alt")
    wait_mount "$W/m-ustor_alt" || { cat "$W/mount-ustor_alt.log" "$W/serve-alt.log"; exit 1; }
fi

. bench/lib/ganesha.sh
if has ganesha; then
    ganesha_up ganesha 127.0.0.1
    NFS_URL_LO=$NFS_URL
    for _ in $(seq 100); do timeout 5 nfs-ls "$NFS_URL" >/dev/null 2>&1 && break; sleep 0.2; done
    timeout 5 nfs-ls "$NFS_URL" >/dev/null || { cat "$W/ganesha.out" "$W/ganesha.log"; exit 1; }
fi

# Across a veth pair between two network namespaces: the servers in
# $NSA (10.99.7.1 on veth $VA), the clients in $NSB (10.99.7.2 on $VB).
# ustor_xdp: a `ustor serve` in $NSA exporting over Transport 2 (raw
# Ethernet, AF_XDP; on a veth in copy mode: no zero-copy driver) and the
# uring mount over xdp://$VB in $NSB (nsenter --net: the mount is in this
# mount namespace, so fio runs here as for the others); ustor_veth: the
# same server's TCP export on 10.99.7.1 mounted from $NSB (the same veth,
# TCP: separates the transport from the link); ganesha_veth: ganesha in
# $NSA, nfsbench (libnfs) in $NSB.
NSA=ufsA$$ NSB=ufsB$$ VA=ufsa$$ VB=ufsb$$
if has ustor_xdp || has ustor_veth || has ganesha_veth; then
    NETNS=1
    veth_pair "$NSA" "$NSB" "$VA" "$VB" 10.99.7.1/24 10.99.7.2/24
fi
if has ustor_xdp || has ustor_veth; then
    [ -e "$URING_PARAM" ] || { echo "ustor_xdp: this kernel has no FUSE over io_uring" >&2; exit 1; }
    [ -n "$URING_WAS" ] || { URING_WAS=$(cat "$URING_PARAM"); echo Y > "$URING_PARAM"; }
    echo "secret" > "$W/secret"
    cat > "$W/cfg-veth.json" <<CFG
{"subsystems":[{"subsystem":"fs","config":[
 {"method":"fs_create","params":{"name":"xv","path":"$W/region-xv","size":$(( (SIZE_MIB * 2 + 256) << 20 ))}},
 {"method":"fs_export","params":{"name":"xv","listen":"$VA","transport":"xdp","secret_file":"$W/secret"$(xdp_mtu_param)${XDP_EXPORT_JSON:-}}},
 {"method":"fs_create","params":{"name":"tv","path":"$W/region-tv","size":$(( (SIZE_MIB * 2 + 256) << 20 ))}},
 {"method":"fs_export","params":{"name":"tv","listen":"10.99.7.1:4800","secret_file":"$W/secret"}}]}]}
CFG
    ip netns exec "$NSA" "$USTOR" serve --cores 0 --no-pin -r "$W/rpc-veth.sock" -c "$W/cfg-veth.json" \
        --log-level warn >"$W/serve-veth.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do "$USTOR" rpc -s "$W/rpc-veth.sock" fs_get_exports >/dev/null 2>&1 && break; sleep 0.1; done
    for t in ustor_xdp:xdp://$VB/xv ustor_veth:10.99.7.1:4800/tv; do
        tn=${t%%:*} target=${t#*:}
        has "$tn" || continue
        mkdir -p "$W/m-$tn"
        nsenter --net=/run/netns/"$NSB" "$USTOR" fs mount "$target" "$W/m-$tn" --secret-file "$W/secret" \
            --fuse-mode uring >"$W/mount-$tn.log" 2>&1 &
        PIDS+=($!)
        MOUNTS+=("$W/m-$tn")
        wait_mount "$W/m-$tn" || { cat "$W/mount-$tn.log" "$W/serve-veth.log"; exit 1; }
    done
fi
if has ganesha_veth; then
    ganesha_up ganesha_veth 10.99.7.1 "$NSA"
    NFS_URL_VETH=$NFS_URL
    NFS_URL=${NFS_URL_LO:-}
    inb() { ip netns exec "$NSB" "$@"; }
    for _ in $(seq 100); do inb timeout 5 nfs-ls "$NFS_URL_VETH" >/dev/null 2>&1 && break; sleep 0.2; done
    inb timeout 5 nfs-ls "$NFS_URL_VETH" >/dev/null || { cat "$W/ganesha_veth.out" "$W/ganesha_veth.log"; exit 1; }
fi

if has sshfs || has sshfs_sync; then
    SPORT=$(free_port)
    (cd "$W" && exec socat TCP-LISTEN:$SPORT,bind=127.0.0.1,reuseaddr,fork EXEC:"$SFTP") &
    PIDS+=($!)
    for _ in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$SPORT) 2>/dev/null && break; sleep 0.1; done
    for t in sshfs sshfs_sync; do
        has $t || continue
        mkdir -p "$W/$t-data" "$W/m-$t"
        opt=""
        [ $t = sshfs_sync ] && opt="-o sshfs_sync"
        sshfs -f -o directport=$SPORT $opt "127.0.0.1:$W/$t-data" "$W/m-$t" &
        PIDS+=($!)
        MOUNTS+=("$W/m-$t")
        wait_mount "$W/m-$t"
    done
fi

for t in floor floor_tcp; do
    has $t || continue
    mkdir -p "$W/m-$t"
    tcp=""
    [ $t = floor_tcp ] && tcp=1
    # floor_tcp forks its peer: a child of this pid, placed with it.
    FLOOR_TCP=$tcp "$W/fuse_floor" "$SIZE_MIB" "$W/m-$t" -f -s &
    PIDS+=($!)
    MOUNTS+=("$W/m-$t")
    wait_mount "$W/m-$t"
done
has tmpfs && mkdir -p "$W/m-tmpfs"

# Every process of the run and all of its threads onto $1's CPUs.
# The uring mount's queue threads stay on their CPUs.
place() {
    local p q t
    for p in "${PIDS[@]}"; do
        for q in $(tree "$p"); do
            for t in /proc/"$q"/task/*; do
                [[ $(cat "$t/comm" 2>/dev/null) == fuse-ring-* ]] && continue
                taskset -p -c "$1" "${t##*/}" >/dev/null 2>&1 || true
            done
        done
    done
}

fio_run() { # cpus dir rw bs -> "iops mean_us p50_us p99_us MiB/s"
    taskset -c "$1" fio --name=b --directory="$2" --filename=bench.dat --size=${SIZE_MIB}m \
        --ioengine=psync --iodepth=1 --direct=1 --rw="$3" --bs="$4" --time_based \
        --runtime="$RUNTIME" --lat_percentiles=1 --percentile_list=50:99 \
        --output-format=json 2>/dev/null | python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
k = "read" if j["read"]["io_bytes"] else "write"
l = j[k]["lat_ns"]
p = l["percentile"]
print("%.0f %.1f %.1f %.1f %.1f" % (j[k]["iops"], l["mean"] / 1e3, p["50.000000"] / 1e3,
      p["99.000000"] / 1e3, j[k]["bw_bytes"] / 1048576))'
}

lib_run() { # cpus rw bs port export -> same columns (ustor's client library)
    local r kib=${3%k}
    [[ $3 == *m ]] && kib=$(( ${3%m} * 1024 ))
    r=$(USTOR_FS_SECRET=secret taskset -c "$1" "$FSBENCH" "127.0.0.1:$4" "$5" libbench.dat \
        "$2" "$kib" "$SIZE_MIB" "$RUNTIME")
    set -- $r
    echo "$1 $2 $4 $5 $3"
}

nfs_run() { # cpus rw bs url [ip netns exec NS] -> same columns
    local r kib=${3%k} url=$4
    [[ $3 == *m ]] && kib=$(( ${3%m} * 1024 ))
    r=$("${@:5}" taskset -c "$1" "$W/nfsbench" "$url" /bench.dat "$2" "$kib" "$SIZE_MIB" "$RUNTIME")
    # nfsbench prints iops mean MiB/s p50 p99.
    set -- $r
    echo "$1 $2 $4 $5 $3"
}

meta_run() { # cpus dir -> ops/s (create + stat + unlink = 3 ops per file)
    taskset -c "$1" python3 - "$2" "$NFILES" <<'PY'
import os, sys, time
d, n = os.path.join(sys.argv[1], "meta"), int(sys.argv[2])
os.makedirs(d, exist_ok=True)
t = time.perf_counter()
for i in range(n):
    os.close(os.open(os.path.join(d, "f%d" % i), os.O_CREAT | os.O_WRONLY, 0o644))
for i in range(n):
    os.stat(os.path.join(d, "f%d" % i))
for i in range(n):
    os.unlink(os.path.join(d, "f%d" % i))
print("%.0f" % (3 * n / (time.perf_counter() - t)))
PY
}

cell() { # cpus target work -> columns
    local cpus=$1 t=$2 w=$3 rw=${3%%:*} bs=${3##*:}
    if [ "$w" = meta ]; then
        case $t in
            ganesha) taskset -c "$cpus" "$W/nfsbench" "$NFS_URL" /meta meta "$NFILES" ;;
            ganesha_veth) ip netns exec "$NSB" taskset -c "$cpus" "$W/nfsbench" "$NFS_URL_VETH" /meta meta "$NFILES" ;;
            floor | floor_tcp | ustor_lib | ustor_lib_copy | ustor_lib_zc) echo "-" ;;
            *) meta_run "$cpus" "$W/m-$t" ;;
        esac
    elif [ "$t" = ganesha ]; then
        nfs_run "$cpus" "$rw" "$bs" "$NFS_URL"
    elif [ "$t" = ganesha_veth ]; then
        nfs_run "$cpus" "$rw" "$bs" "$NFS_URL_VETH" ip netns exec "$NSB"
    elif [ "$t" = ustor_lib ]; then
        lib_run "$cpus" "$rw" "$bs" "$UPORT" vol
    elif [ "$t" = ustor_lib_copy ]; then
        lib_run "$cpus" "$rw" "$bs" "$CPORT" copy
    elif [ "$t" = ustor_lib_zc ]; then
        lib_run "$cpus" "$rw" "$bs" "$ZPORT" zc
    else
        fio_run "$cpus" "$W/m-$t" "$rw" "$bs"
    fi
}

# Lay the data file out once per target.
for t in $TARGETS; do
    case $t in
        ganesha) "$W/nfsbench" "$NFS_URL" /bench.dat lay "$SIZE_MIB" ;;
        ganesha_veth) ip netns exec "$NSB" "$W/nfsbench" "$NFS_URL_VETH" /bench.dat lay "$SIZE_MIB" ;;
        ustor_lib) USTOR_FS_SECRET=secret "$FSBENCH" "127.0.0.1:$UPORT" vol libbench.dat lay "$SIZE_MIB" ;;
        ustor_lib_copy) USTOR_FS_SECRET=secret "$FSBENCH" "127.0.0.1:$CPORT" copy libbench.dat lay "$SIZE_MIB" ;;
        ustor_lib_zc) USTOR_FS_SECRET=secret "$FSBENCH" "127.0.0.1:$ZPORT" zc libbench.dat lay "$SIZE_MIB" ;;
        floor | floor_tcp) ;;
        *) fio --name=lay --directory="$W/m-$t" --filename=bench.dat --size=${SIZE_MIB}m \
               --rw=write --bs=1m >/dev/null ;;
    esac
done

{
    echo "# bench/fs.sh $(date -u +%FT%TZ) on $(uname -r), $(nproc) CPUs, load: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "# USTOR=$USTOR${USTOR_ALT:+ USTOR_ALT=$USTOR_ALT}${XDP_EXPORT_JSON:+ XDP_EXPORT_JSON=$XDP_EXPORT_JSON} ROUNDS=$ROUNDS RUNTIME=$RUNTIME SIZE_MIB=$SIZE_MIB NFILES=$NFILES"
    echo "# TARGETS=$TARGETS"
    echo "# ganesha $(dpkg-query -W -f='${Version}' nfs-ganesha 2>/dev/null), $(sshfs --version 2>&1 | grep -i '^sshfs version')"
} | tee "$OUT"

read -r -a TARR <<< "$TARGETS"
for r in $(seq "$ROUNDS"); do
    # Rotate the order of the targets each round.
    n=${#TARR[@]}
    order=()
    for i in $(seq 0 $((n - 1))); do order+=("${TARR[$(((i + r - 1) % n))]}"); done
    for p in $PLACES; do
        cpus=0
        [ "$p" = unpinned ] && cpus=$ALL_CPUS
        place "$cpus"
        for w in $WORKS; do
            for t in "${order[@]}"; do
                v=$(cell "$cpus" "$t" "$w")
                printf '%s\t%s\t%s\t%s\t%s\n' "$r" "$p" "$w" "$t" "$v" >> "$OUT.raw"
            done
        done
    done
    echo "round $r done ($(cut -d' ' -f1-3 /proc/loadavg))" >&2
done
echo "# load at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"

python3 - "$OUT.raw" "$TARGETS" <<'PY' | tee -a "$OUT"
import collections, statistics, sys
rows = collections.defaultdict(list)
order = []
for line in open(sys.argv[1]):
    r, p, w, t, v = line.rstrip("\n").split("\t")
    if v.strip() == "-":
        continue
    rows[(p, w, t)].append([float(x) for x in v.split()])
    if (p, w) not in order:
        order.append((p, w))
targets = sys.argv[2].split()
for p, w in order:
    med = {}
    for t in targets:
        if (p, w, t) in rows:
            med[t] = [statistics.median(c) for c in zip(*rows[(p, w, t)])]
    print()
    if w == "meta":
        print("%s %s (ops/s, median of %d)" % (p, w, len(rows[(p, w, targets[0])])))
        for t, m in med.items():
            print("  %-11s %10.0f" % (t, m[0]))
        for t, m in med.items():
            if t != "ustor" and "ustor" in med:
                print("  ustor/%-11s throughput %.2fx" % (t, med["ustor"][0] / m[0]))
        continue
    print("%s %s: %-11s %8s %9s %9s %9s %9s" % (p, w, "target", "IOPS", "mean us", "p50 us", "p99 us", "MiB/s"))
    for t, m in med.items():
        print("  %-25s %8.0f %9.1f %9.1f %9.1f %9.1f" % (t, m[0], m[1], m[2], m[3], m[4]))
    for a, b in (("ustor", "ustor_copy"), ("ustor_lib", "ustor_lib_copy")):
        if a in med and b in med:
            print("  zero/one copy %-16s latency mean %.2fx p50 %.2fx, throughput %.2fx"
                  % (a, med[a][1] / med[b][1], med[a][2] / med[b][2], med[a][4] / med[b][4]))
    if "ustor_lib_zc" in med and "ustor_lib" in med:
        z, b = med["ustor_lib_zc"], med["ustor_lib"]
        print("  send_zc/plain ustor_lib     latency mean %.2fx p50 %.2fx p99 %.2fx, throughput %.2fx"
              % (z[1] / b[1], z[2] / b[2], z[3] / b[3], z[4] / b[4]))
    if "ustor_uring" in med:
        u = med["ustor_uring"]
        for t in ("ustor_alt", "ustor", "floor", "floor_tcp", "ganesha", "ganesha_veth"):
            if t in med:
                m = med[t]
                print("  ustor_uring/%-9s latency mean %.2fx p50 %.2fx p99 %.2fx, throughput %.2fx"
                      % (t, u[1] / m[1], u[2] / m[2], u[3] / m[3], u[4] / m[4]))
    if "ustor_xdp" in med:
        u = med["ustor_xdp"]
        for t in ("ustor_uring", "ustor_veth", "ganesha", "ganesha_veth"):
            if t in med:
                m = med[t]
                print("  ustor_xdp/%-11s latency mean %.2fx p50 %.2fx p99 %.2fx, throughput %.2fx"
                      % (t, u[1] / m[1], u[2] / m[2], u[3] / m[3], u[4] / m[4]))
    if "floor_tcp" in med and "floor" in med:
        z, b = med["floor_tcp"], med["floor"]
        print("  floor_tcp/floor (one TCP round trip) latency mean %.2fx p50 %.2fx, +%.1f us p50"
              % (z[1] / b[1], z[2] / b[2], z[2] - b[2]))
    if "ustor" in med:
        u = med["ustor"]
        for t, m in med.items():
            if t == "ustor":
                continue
            print("  ustor/%-11s latency mean %.2fx p50 %.2fx p99 %.2fx, throughput %.2fx"
                  % (t, u[1] / m[1], u[2] / m[2], u[3] / m[3], u[4] / m[4]))
PY
echo "raw cells: $OUT.raw"
