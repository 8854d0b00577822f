#!/bin/sh
# NVMe/TCP interop: the kernel nvme-tcp host driver (driven by nvme-cli)
# against a target. Discovers, connects, identifies, checks raw I/O with
# O_DIRECT, runs the ext4 round trip on namespace 1, disconnects.
# Env: NVME_PORT (default 4420), NVME_NQN (subsystem NQN, default: first
# non-discovery entry of the discovery log), NVME_ADDR (default 10.0.2.2).
# Reports: nvme_nqn, nvme_ctrl, nvme_dev, nvme_mn, nvme_sn, ns_size,
# raw_md5, data_md5, tree_md5, files.
. /ustor/lib.sh
set -u
addr=${NVME_ADDR:-10.0.2.2}
port=${NVME_PORT:-4420}

run modprobe nvme-tcp
run nvme discover -t tcp -a "$addr" -s "$port" > /tmp/discovery
cat /tmp/discovery
nqn=${NVME_NQN:-$(awk '/^subnqn:/ && $2 !~ /discovery/ {print $2; exit}' /tmp/discovery)}
[ -n "$nqn" ] || die "discovery log names no subsystem"
grep -q "subnqn: *$nqn\$" /tmp/discovery || die "$nqn not in discovery log"
kv nvme_nqn "$nqn"
run nvme connect -t tcp -a "$addr" -s "$port" -n "$nqn"

ctrl=
n=100
while [ -z "$ctrl" ]; do
    for c in /sys/class/nvme/nvme*; do
        [ -e "$c/subsysnqn" ] && [ "$(cat "$c/subsysnqn")" = "$nqn" ] && ctrl=$(basename "$c") && break
    done
    [ -n "$ctrl" ] && break
    n=$((n - 1))
    [ $n -gt 0 ] || die "no controller for $nqn after connect"
    sleep 0.1
done
kv nvme_ctrl "$ctrl"
run nvme id-ctrl "/dev/$ctrl" > /tmp/id-ctrl
kv nvme_mn "$(awk -F: '/^mn /{gsub(/^ +| +$/, "", $2); print $2}' /tmp/id-ctrl)"
kv nvme_sn "$(awk -F: '/^sn /{gsub(/^ +| +$/, "", $2); print $2}' /tmp/id-ctrl)"

# Namespace 1's block device: nvmeXnY where X is the subsystem instance
# (native multipath) or the controller instance; take the one whose
# subsystem NQN matches.
dev=
n=100
while [ -z "$dev" ]; do
    for b in /sys/block/nvme*n1; do
        [ -e "$b" ] || continue
        # nvmeXcYnZ is a hidden per-path node under native multipath.
        case ${b##*/} in nvme*c*n*) continue ;; esac
        s=$(cat "$b/device/subsysnqn" 2>/dev/null || cat "$b/device/../subsysnqn" 2>/dev/null || true)
        [ "$s" = "$nqn" ] && dev=$(basename "$b") && break
    done
    [ -n "$dev" ] && break
    n=$((n - 1))
    [ $n -gt 0 ] || die "no namespace block device for $nqn"
    sleep 0.1
done
wait_for "/dev/$dev"
kv nvme_dev "$dev"
run nvme id-ns "/dev/$dev" > /dev/null
kv ns_size "$(size_bytes "/dev/$dev")"
raw_roundtrip "/dev/$dev" 1 4 raw_md5
fs_roundtrip "/dev/$dev" /mnt/nvme
run nvme disconnect -n "$nqn"
log "nvme-tcp ok"
