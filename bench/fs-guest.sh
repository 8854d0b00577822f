#!/usr/bin/env bash
# The file service measured from inside a QEMU/TCG guest (crates/testvm):
# the kernel's NFSv3 client against nfs-ganesha, and ustor's FUSE client
# (`ustor fs mount`, classic /dev/fuse: the guest kernel has no FUSE over
# io_uring) against ustor's file server. Both servers run on the host on
# 127.0.0.1, the guest reaches them at 10.0.2.2 through QEMU's user
# network, and both keep their files on tmpfs (/dev/shm). The guest
# (tests/guest/fs-bench.sh, booted by the ignored test
# crates/ustor/tests/fs_guest_bench.rs) lays out one file per mount with a
# fio crc32c verify pass, then per round, alternating which mount goes
# first, runs fio psync QD1 O_DIRECT for each WORKS item. The summary gives
# per mount the median over rounds and the median of same-round ratios
# ustor/ganesha: p50 and mean latency (lower is better for ustor) and
# throughput (higher is better). Under TCG every guest instruction is
# emulated: the absolute figures are the guest's, only the ratios carry.
#
# Usage: [USTOR=target/release/ustor] [NOBUILD=1] [ROUNDS=3] [RUNTIME=5]
#        [SIZE_MIB=32] [WORKS="randread:4k randwrite:4k read:1m write:1m"]
#        [RESULTS_DIR=bench/results] bench/fs-guest.sh
# Needs: nfs-ganesha + nfs-ganesha-vfs, libnfs-utils (nfs-ls), fio,
# nfs-common (mount.nfs, shipped to the guest), qemu-system-x86.
set -euo pipefail
cd "$(dirname "$0")/.."

USTOR=${USTOR:-target/release/ustor}
export ROUNDS=${ROUNDS:-3}
export RUNTIME=${RUNTIME:-5}
export SIZE_MIB=${SIZE_MIB:-32}
export WORKS=${WORKS:-randread:4k randwrite:4k read:1m write:1m}
RESULTS_DIR=${RESULTS_DIR:-bench/results}
NRUNS=$(wc -w <<<"$WORKS")
export GUEST_TIMEOUT_S=${GUEST_TIMEOUT_S:-$((300 + ROUNDS * 2 * NRUNS * (RUNTIME + 20)))}

for t in ganesha.nfsd nfs-ls fio /usr/sbin/mount.nfs qemu-system-x86_64 python3; do
    command -v "$t" >/dev/null || { echo "missing $t (apt-get install -y nfs-ganesha nfs-ganesha-vfs libnfs-utils fio nfs-common qemu-system-x86)" >&2; exit 1; }
done
if [ -z "${NOBUILD:-}" ]; then
    cargo build --release -q -p ustor
fi
# The guest launcher: an ignored test (the testvm crate's runner).
cargo test --release -q -p ustor --test fs_guest_bench --no-run

W=$(mktemp -d /dev/shm/ustor-fs-guest.XXXXXX)
# The guest script runs /ustor/bin/ustor: a build saved under another name
# (ustor-<commit>) goes in as `ustor`.
if [ "$(basename "$USTOR")" != ustor ]; then
    mkdir -p "$W/bin"
    cp "$USTOR" "$W/bin/ustor"
    USTOR=$W/bin/ustor
fi
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do
        pkill -P "$p" 2>/dev/null || true
        kill "$p" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    rm -rf "$W"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

. bench/lib/ganesha.sh
. bench/lib/guest.sh
ganesha_up ganesha 127.0.0.1
for _ in $(seq 100); do timeout 5 nfs-ls "$NFS_URL" >/dev/null 2>&1 && break; sleep 0.2; done
timeout 5 nfs-ls "$NFS_URL" >/dev/null || { cat "$W/ganesha.out" "$W/ganesha.log"; exit 1; }

FS_PORT=$(free_port)
echo "guest-bench-secret" > "$W/secret"
cat > "$W/cfg.json" <<CFG
{"subsystems":[{"subsystem":"fs","config":[
 {"method":"fs_create","params":{"name":"vol","path":"$W/region","size":$(( (SIZE_MIB * 2 + 256) << 20 ))}},
 {"method":"fs_export","params":{"name":"vol","listen":"127.0.0.1:$FS_PORT","secret_file":"$W/secret"}}]}]}
CFG
"$USTOR" serve --cores 0 --no-pin -r "$W/rpc.sock" -c "$W/cfg.json" --log-level warn >"$W/serve.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do "$USTOR" rpc -s "$W/rpc.sock" fs_get_exports >/dev/null 2>&1 && break; sleep 0.1; done
"$USTOR" rpc -s "$W/rpc.sock" fs_get_exports >/dev/null || { cat "$W/serve.log"; exit 1; }

mkdir -p "$W/share" "$RESULTS_DIR"
STAMP=$(date -u +%Y%m%d-%H%M)
RAW="$RESULTS_DIR/fs-guest-$STAMP.txt"
GUEST_LOG="$W/guest.log"
FS_GUEST_SHARE=$W/share USTOR_BIN=$(realpath "$USTOR") FS_GUEST_LOG=$GUEST_LOG \
  NFS_PATH=$W/ganesha-data NFS_PORT=$NFS_PORT MNT_PORT=$MNT_PORT FS_PORT=$FS_PORT FS_EXPORT=vol \
  USTOR_FS_SECRET=$(cat "$W/secret") \
  guest_runner "$W" --release -q -p ustor --test fs_guest_bench || exit 1

{
    guest_raw_header fs-guest.sh \
        "# ganesha $(dpkg-query -W -f='${Version}' nfs-ganesha 2>/dev/null), fio $(fio --version)" \
        "ROUNDS=$ROUNDS RUNTIME=$RUNTIME SIZE_MIB=$SIZE_MIB WORKS=$WORKS"
    guest_raw_log
} >"$RAW"

grep -o 'USTOR-KV verified_.*' "$GUEST_LOG" | sed 's/USTOR-KV verified_/layout written and verified with fio crc32c: /' | tee -a "$RAW"
python3 - "$W/share" <<'PY' | tee -a "$RAW"
import glob, json, os, re, statistics as st, sys
runs = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "r*.json"))):
    m = re.match(r"r(\d+)-(\w+)-(\w+)-(\w+)\.json$", os.path.basename(f))
    rnd, mount, rw, bs = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    j = json.load(open(f))["jobs"][0]
    d = j["read" if "read" in rw else "write"]
    if j["error"] or d["total_ios"] == 0:
        print(f"warning: round {rnd} {mount} {rw} {bs}: error {j['error']}, {d['total_ios']} I/Os")
        continue
    c = d["clat_ns"]
    runs[(rw, bs, mount, rnd)] = {
        "p50": c["percentile"]["50.000000"] / 1e3, "p99": c["percentile"]["99.000000"] / 1e3,
        "mean": c["mean"] / 1e3, "mibs": d["bw_bytes"] / 2**20, "ios": d["total_ios"]}
cells = sorted({(rw, bs) for (rw, bs, _, _) in runs}, key=lambda c: (c[1], c[0]))
rounds = sorted({r for (*_, r) in runs})
print("fio psync QD1 O_DIRECT in the guest; medians over rounds (latency us, MiB/s)")
print(f"{'workload':<14}{'mount':<8}{'p50':>9}{'mean':>9}{'p99':>9}{'MiB/s':>9}   ustor/ganesha same-round medians")
for rw, bs in cells:
    for mount in ("nfs", "ustor"):
        rs = [runs[(rw, bs, mount, r)] for r in rounds if (rw, bs, mount, r) in runs]
        if not rs:
            print(f"{rw+' '+bs:<14}{mount:<8} no runs")
            continue
        med = lambda k: st.median(x[k] for x in rs)
        extra = ""
        if mount == "ustor":
            pairs = [(runs[(rw, bs, "ustor", r)], runs[(rw, bs, "nfs", r)]) for r in rounds
                     if (rw, bs, "ustor", r) in runs and (rw, bs, "nfs", r) in runs]
            if pairs:
                ratio = lambda k: st.median(u[k] / n[k] for u, n in pairs)
                extra = (f"   p50 {ratio('p50'):.2f}x, mean {ratio('mean'):.2f}x, "
                         f"throughput {ratio('mibs'):.2f}x ({len(pairs)} rounds)")
        name = "ganesha" if mount == "nfs" else "ustor"
        print(f"{rw+' '+bs:<14}{name:<8}{med('p50'):>9.1f}{med('mean'):>9.1f}{med('p99'):>9.1f}{med('mibs'):>9.1f}{extra}")
PY
echo "raw: $RAW"
