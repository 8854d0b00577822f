#!/usr/bin/env bash
# File service through FUSE: `ustor fs mount` (ustor serve's file service on
# a region in /dev/shm) against sshfs without encryption (sftp-server behind
# socat, `-o directport`) on a directory in /dev/shm, so both serve from
# the same kind of storage (RAM), both over TCP on 127.0.0.1, both through
# the kernel's FUSE.
# Workloads: fio psync QD1 4 KiB randread and randwrite, 1 MiB sequential
# read and write (buffered: FUSE's page cache is part of what a client
# sees, reads of a file just written may hit it for both), and metadata
# (create + stat + unlink of N files, timed by python).
# Rounds alternate the two mounts; each cell is the median of ROUNDS.
# Prints ustor/sshfs ratios (> 1: ustor faster).
#
# Usage: bench/fs.sh   (env: USTOR=target/release/ustor ROUNDS=3 RUNTIME=3
#                       SIZE_MIB=64 NFILES=500 CORES=<taskset list for servers>)
# Needs: fio, sshfs, socat, openssh-sftp-server, python3, root (mount).
set -euo pipefail
cd "$(dirname "$0")/.."

USTOR=${USTOR:-target/release/ustor}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-3}
SIZE_MIB=${SIZE_MIB:-64}
NFILES=${NFILES:-500}
CORES=${CORES:-0}
SFTP=${SFTP:-/usr/lib/openssh/sftp-server}

W=$(mktemp -d /dev/shm/ustor-fs-bench.XXXXXX)
PIDS=()
cleanup() {
    for m in "$W/m-ustor" "$W/m-sshfs"; do
        mountpoint -q "$m" && umount -l "$m" || true
    done
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$W"
}
trap cleanup EXIT
mkdir -p "$W/m-ustor" "$W/m-sshfs" "$W/sshfs-data"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# ustor: serve + fs_create/fs_export, then the FUSE client.
UPORT=$(free_port)
echo "secret" > "$W/secret"
cat > "$W/cfg.json" <<JSON
{"subsystems":[{"subsystem":"fs","config":[
 {"method":"fs_create","params":{"name":"vol","path":"$W/region","size":$(( (SIZE_MIB * 4 + 256) << 20 ))}},
 {"method":"fs_export","params":{"name":"vol","listen":"127.0.0.1:$UPORT","secret_file":"$W/secret"}}]}]}
JSON
taskset -c "$CORES" "$USTOR" serve -r "$W/rpc.sock" -c "$W/cfg.json" --log-level warn >"$W/serve.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do "$USTOR" rpc -s "$W/rpc.sock" fs_get_exports >/dev/null 2>&1 && break; sleep 0.1; done
"$USTOR" fs mount "127.0.0.1:$UPORT/vol" "$W/m-ustor" --secret-file "$W/secret" >"$W/mount.log" 2>&1 &
PIDS+=($!)

# sshfs: sftp-server behind socat, no ssh, no encryption.
SPORT=$(free_port)
(cd "$W/sshfs-data" && exec taskset -c "$CORES" socat TCP-LISTEN:$SPORT,bind=127.0.0.1,reuseaddr,fork EXEC:"$SFTP") &
PIDS+=($!)
for _ in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$SPORT) 2>/dev/null && break; sleep 0.1; done
sshfs -o directport=$SPORT "127.0.0.1:$W/sshfs-data" "$W/m-sshfs"

for _ in $(seq 100); do mountpoint -q "$W/m-ustor" && break; sleep 0.1; done
mountpoint -q "$W/m-ustor" || { cat "$W/mount.log"; exit 1; }

fio_run() { # mount rw bs -> "iops lat_us"
    fio --name=b --directory="$1" --filename=bench.dat --size=${SIZE_MIB}m \
        --ioengine=psync --iodepth=1 --rw="$2" --bs="$3" --time_based \
        --runtime="$RUNTIME" --output-format=json 2>/dev/null | python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
k = "read" if j["read"]["io_bytes"] else "write"
print("%.0f %.1f %.1f" % (j[k]["iops"], j[k]["lat_ns"]["mean"] / 1e3, j[k]["bw_bytes"] / 1048576))'
}

meta_run() { # mount -> operations per second (create+stat+unlink = 3 ops)
    python3 - "$1" "$NFILES" <<'PY'
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

# Lay the fio file out once per mount.
for m in ustor sshfs; do
    fio --name=lay --directory="$W/m-$m" --filename=bench.dat --size=${SIZE_MIB}m --rw=write --bs=1m >/dev/null
done

declare -A R
WORKS="randread:4k randwrite:4k read:1m write:1m meta"
for r in $(seq "$ROUNDS"); do
    for w in $WORKS; do
        for m in ustor sshfs; do
            if [ "$w" = meta ]; then v=$(meta_run "$W/m-$m"); else v=$(fio_run "$W/m-$m" "${w%%:*}" "${w##*:}"); fi
            R[$w,$m]="${R[$w,$m]:-}$v;"
        done
    done
    echo "round $r done" >&2
done

python3 - "$WORKS" <<PY
import statistics, sys
R = {$(for k in "${!R[@]}"; do printf '"%s": "%s", ' "$k" "${R[$k]}"; done)}
print("%-14s %-6s %10s %10s %10s" % ("workload", "mount", "IOPS|ops/s", "lat us", "MiB/s"))
for w in sys.argv[1].split():
    med = {}
    for m in ("ustor", "sshfs"):
        rows = [list(map(float, x.split())) for x in R[w + "," + m].split(";") if x]
        cols = [statistics.median(c) for c in zip(*rows)]
        med[m] = cols
        print("%-14s %-6s %10.0f %10s %10s" % (w, m, cols[0],
              "%.1f" % cols[1] if len(cols) > 1 else "-", "%.1f" % cols[2] if len(cols) > 2 else "-"))
    print("%-14s ratio ustor/sshfs (throughput): %.2fx" % (w, med["ustor"][0] / med["sshfs"][0]))
PY
