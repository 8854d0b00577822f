#!/usr/bin/env bash
# QD1 4 KiB latency of the file service over TCP and over raw Ethernet
# (AF_XDP), the same client library loop (crates/fs-client/examples/
# fs_xdp_lat.rs) on both, between two network namespaces joined by a veth
# pair: `ustor serve` in one with two volumes on /dev/shm, one exported
# over TCP on the veth's address, one over xdp on the veth; the client in
# the other. Rounds alternate tcp/xdp; prints each round and the ratio of
# medians (xdp/tcp). AF_XDP on a veth is copy mode (no zero-copy driver).
#
# Usage (as root):
#   cargo build --release -p ustor -p ustor-fs-client --example fs_xdp_lat
#   USTOR=target/release/ustor LAT=target/release/examples/fs_xdp_lat \
#     N=2000 ROUNDS=3 bench/fs-xdp.sh
set -euo pipefail
. "$(dirname "$0")/lib/veth.sh"
USTOR=${USTOR:-target/release/ustor}
LAT=${LAT:-target/release/examples/fs_xdp_lat}
N=${N:-2000}
ROUNDS=${ROUNDS:-3}
tag=ufsxdp$$
A=$tag-a B=$tag-b
dir=$(mktemp -d)
export USTOR_FS_SECRET=bench
cleanup() {
    [ -n "${srv:-}" ] && kill "$srv" 2>/dev/null && wait "$srv" 2>/dev/null || true
    veth_del "$A" "$B"
    rm -f "/dev/shm/$tag-t.img" "/dev/shm/$tag-x.img"
    rm -rf "$dir"
}
trap cleanup EXIT
veth_pair "$A" "$B" veth-a veth-b 10.99.0.1/24 10.99.0.2/24
echo '{"subsystems": []}' > "$dir/empty.json"
ip netns exec "$A" "$USTOR" serve -r "$dir/rpc.sock" -c "$dir/empty.json" --no-pin --log-level warn >/dev/null &
srv=$!
for _ in $(seq 200); do [ -S "$dir/rpc.sock" ] && break; sleep 0.05; done
rpc() { "$USTOR" rpc -s "$dir/rpc.sock" "$@" >/dev/null; }
rpc fs_create --name t --path "/dev/shm/$tag-t.img" --size $((256 << 20))
rpc fs_create --name x --path "/dev/shm/$tag-x.img" --size $((256 << 20))
rpc fs_export --name t --listen 10.99.0.1:4800 --secret bench
rpc fs_export --name x --listen veth-a --transport xdp --secret bench
echo "# $(date -u +%FT%TZ) N=$N ROUNDS=$ROUNDS $(uname -r), AF_XDP copy mode on veth, load $(cut -d' ' -f1 /proc/loadavg)"
echo "# op round transport p50_us p99_us mean_us"
for op in read write; do
    t50=() x50=()
    for r in $(seq "$ROUNDS"); do
        t=$(ip netns exec "$B" "$LAT" 10.99.0.1:4800 t "$op" "$N")
        x=$(ip netns exec "$B" "$LAT" xdp://veth-b/x x "$op" "$N")
        echo "$op $r tcp $t"
        echo "$op $r xdp $x"
        t50+=("${t%% *}") x50+=("${x%% *}")
    done
    med() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
    tm=$(med "${t50[@]}") xm=$(med "${x50[@]}")
    echo "$op median p50: tcp $tm us, xdp $xm us, xdp/tcp $(awk -v a="$xm" -v b="$tm" 'BEGIN {printf "%.2f", a/b}')"
done
