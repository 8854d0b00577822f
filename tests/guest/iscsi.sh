#!/bin/sh
# iSCSI interop: open-iscsi (iscsid + iscsi_tcp) against a target on the
# host. Discovers, records the node with the address the guest can reach,
# logs in, runs the ext4 round trip on the LUN's disk, logs out.
# Env: ISCSI_PORT (required), ISCSI_TARGET (IQN, default: first target
# from SendTargets discovery), ISCSI_HOST (default 10.0.2.2).
# Reports: iscsi_target, iscsi_disk, disk_size, data_md5, tree_md5, files.
. /ustor/lib.sh
set -u
: "${ISCSI_PORT:?ISCSI_PORT is required}"
host=${ISCSI_HOST:-10.0.2.2}
portal="$host:$ISCSI_PORT"

run modprobe -a iscsi_tcp sd_mod
mkdir -p /var/lib/iscsi /run/lock/iscsi
# iscsid in the foreground, in its own session so it outlives nothing it
# should not; logs go to a file we print on failure.
setsid iscsid -f > /tmp/iscsid.log 2>&1 &
iscsid_pid=$!
n=50
until iscsiadm -m session > /dev/null 2>&1 || [ $? -eq 21 ]; do
    n=$((n - 1))
    [ $n -gt 0 ] || { cat /tmp/iscsid.log; die "iscsid did not start"; }
    sleep 0.1
done

run iscsiadm -m discovery -t sendtargets -p "$portal" > /tmp/discovery
cat /tmp/discovery
target=${ISCSI_TARGET:-$(awk '{print $2; exit}' /tmp/discovery)}
[ -n "$target" ] || die "discovery found no target"
grep -q " $target\$" /tmp/discovery || die "$target not in discovery output"
kv iscsi_target "$target"
# The target advertises the address it listens on (127.0.0.1 on the host),
# which the guest cannot reach: record the node with the portal we used.
run iscsiadm -m node -o new -T "$target" -p "$portal"
run iscsiadm -m node -T "$target" -p "$portal" --login

disk=
n=100
while [ -z "$disk" ]; do
    for b in /sys/class/iscsi_session/session*/device/target*/*/block/*; do
        [ -e "$b" ] && disk=$(basename "$b") && break
    done
    [ -n "$disk" ] && break
    n=$((n - 1))
    [ $n -gt 0 ] || die "no disk appeared after iSCSI login"
    sleep 0.1
done
wait_for "/dev/$disk"
kv iscsi_disk "$disk"
kv disk_size "$(size_bytes "/dev/$disk")"
fs_roundtrip "/dev/$disk" /mnt/iscsi
run iscsiadm -m node -T "$target" -p "$portal" --logout
kill "$iscsid_pid" 2>/dev/null
log "iscsi ok"
