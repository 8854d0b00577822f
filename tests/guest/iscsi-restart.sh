#!/bin/sh
# open-iscsi across a target restart: discovery, login with mutual CHAP and
# CRC32C digests, ext4 with files, then fio (crc32c verify) on a file of
# that ext4 while the host restarts the target. The guest asks for the
# restart by writing RESTART_MARKER at RESTART_LBA (512-byte units) past
# the file system; the host sees it in the LUN's backing file, stops the
# target (SIGTERM: it asks us to log out) and starts it again on the same
# port. The session must recover (iscsid logs in again), fio's verify must
# pass and no I/O error may reach the file system; then the files are
# checked again after a remount, read from the restarted target.
# Env: ISCSI_PORT, ISCSI_TARGET, CHAP_USER, CHAP_SECRET, CHAP_MUSER,
# CHAP_MSECRET, RESTART_LBA, RESTART_MARKER.
# Reports: iscsi_target, disk_size, logout_requested, fio_running_at_restart,
# recovered, fio_status, fio_verify_errors, fio_phases, io_errors,
# fs_errors, data_md5, tree_md5, files.
. /ustor/lib.sh
set -u
portal=10.0.2.2:$ISCSI_PORT
mnt=/mnt/iscsi

run modprobe -a iscsi_tcp sd_mod
mkdir -p /var/lib/iscsi /run/lock/iscsi
setsid iscsid -f > /tmp/iscsid.log 2>&1 &
n=50
until iscsiadm -m session > /dev/null 2>&1 || [ $? -eq 21 ]; do
    n=$((n - 1))
    [ $n -gt 0 ] || { cat /tmp/iscsid.log; die "iscsid did not start"; }
    sleep 0.1
done

run iscsiadm -m discovery -t sendtargets -p "$portal" > /tmp/discovery
cat /tmp/discovery
grep -q " $ISCSI_TARGET\$" /tmp/discovery || die "$ISCSI_TARGET not in discovery"
kv iscsi_target "$ISCSI_TARGET"
# The target advertises 127.0.0.1 (its host address): record the node with
# the portal the guest reaches it by.
run iscsiadm -m node -o new -T "$ISCSI_TARGET" -p "$portal" > /dev/null
set_node() {
    run iscsiadm -m node -T "$ISCSI_TARGET" -p "$portal" -o update -n "$1" -v "$2"
}
set_node node.session.auth.authmethod CHAP
set_node node.session.auth.username "$CHAP_USER"
set_node node.session.auth.password "$CHAP_SECRET"
set_node node.session.auth.username_in "$CHAP_MUSER"
set_node node.session.auth.password_in "$CHAP_MSECRET"
set_node 'node.conn[0].iscsi.HeaderDigest' CRC32C
set_node 'node.conn[0].iscsi.DataDigest' CRC32C
# Queued I/O waits this long for the session to come back.
set_node node.session.timeo.replacement_timeout 120
run iscsiadm -m node -T "$ISCSI_TARGET" -p "$portal" --login

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
dev=/dev/$disk
kv disk_size "$(size_bytes "$dev")"

# ext4 on the first 48 MiB; the marker goes beyond it.
run mkfs.ext4 -q -F -E nodiscard "$dev" 48M
mkdir -p "$mnt"
run mount -t ext4 "$dev" "$mnt"
run dd if=/dev/urandom of="$mnt/data.bin" bs=64k count=64 2>/dev/null
mkdir -p "$mnt/dir"
i=0
while [ $i -lt 20 ]; do
    dd if=/dev/urandom of="$mnt/dir/f$i" bs=1k count=$((i + 1)) 2>/dev/null || die "write f$i"
    i=$((i + 1))
done
sync
(cd "$mnt" && find . -type f | sort | xargs md5sum) > /tmp/before.md5 || die "checksum before"

# fio writes 8 MiB in 4 KiB blocks at no more than 256 IOPS, so its write
# phase lasts at least 8 s whatever the speed: the restart falls inside it.
# The verify pass then reads every block back unthrottled.
/ustor/bin/fio --name=restart --filename="$mnt/fio.dat" --size=8M \
    --ioengine=libaio --direct=1 --rw=randwrite --bs=4k --iodepth=8 --rate_iops=,256 \
    --verify=crc32c --do_verify=1 --verify_fatal=1 > /tmp/fio.out 2>&1 &
fio_pid=$!
# Let fio lay its file out and start writing before asking for the restart.
n=300
until [ -s "$mnt/fio.dat" ]; do
    n=$((n - 1)); [ $n -gt 0 ] || die "fio did not start"
    sleep 0.1
done
printf '%s' "$RESTART_MARKER" > /tmp/marker
run dd if=/tmp/marker of="$dev" bs=512 seek="$RESTART_LBA" count=1 conv=sync,fsync 2>/dev/null

# The stopping target asks for a logout (Async Message); iscsid logs out
# and reconnects until the restarted target takes the login.
n=600
until grep -q 'Target requests logout' /tmp/iscsid.log; do
    n=$((n - 1)); [ $n -gt 0 ] || { cat /tmp/iscsid.log; die "no logout request"; }
    sleep 0.1
done
kv logout_requested 1
kill -0 "$fio_pid" 2>/dev/null && kv fio_running_at_restart 1 || kv fio_running_at_restart 0
n=1200
until grep -q 'operational after recovery' /tmp/iscsid.log; do
    n=$((n - 1)); [ $n -gt 0 ] || { cat /tmp/iscsid.log; die "session did not recover"; }
    sleep 0.1
done
kv recovered 1
cat /tmp/iscsid.log

wait "$fio_pid"
fio_status=$?
cat /tmp/fio.out
kv fio_status "$fio_status"
kv fio_verify_errors "$(grep -c 'verify: bad' /tmp/fio.out)"
kv fio_phases "$(grep -c -E '^ +(READ|WRITE): bw=' /tmp/fio.out)"
dmesg > /tmp/dmesg
kv io_errors "$(grep -c -i 'I/O error' /tmp/dmesg)"
kv fs_errors "$(grep -c 'EXT4-fs error' /tmp/dmesg)"

# Everything again from the restarted target, not from the page cache.
run umount "$mnt"
echo 3 > /proc/sys/vm/drop_caches
run e2fsck -f -n "$dev"
run mount -t ext4 "$dev" "$mnt"
(cd "$mnt" && find . -type f ! -name fio.dat | sort | xargs md5sum) > /tmp/after.md5 || die "checksum after"
cmp /tmp/before.md5 /tmp/after.md5 || die "file checksums differ after the restart"
kv data_md5 "$(md5_of "$mnt/data.bin")"
kv tree_md5 "$(md5sum /tmp/before.md5 | cut -d' ' -f1)"
kv files "$(wc -l < /tmp/before.md5)"
run umount "$mnt"
run iscsiadm -m node -T "$ISCSI_TARGET" -p "$portal" --logout
log "iscsi restart ok"
