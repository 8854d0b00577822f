#!/bin/sh
# vhost-user-blk interop: the guest's virtio-blk driver against a
# vhost-user-blk backend on the host (the disk is /dev/vda). Checks a region
# the host filled, writes a region the host then checks, and optionally runs
# the ext4 round trip on a second device.
# Env: VUB_DEV (default /dev/vda), VUB_READ_MIB=OFFSET:COUNT (region the host
# wrote; reported as read_md5), VUB_WRITE_MIB=OFFSET:COUNT (region the
# guest fills; reported as write_md5), VUB_FS_DEV (device for the ext4 round
# trip, e.g. /dev/vdb; none by default).
# Reports: vub_size, read_md5, write_md5, and the fs_roundtrip values.
. /ustor/lib.sh
set -u
dev=${VUB_DEV:-/dev/vda}
wait_for "$dev"
size=$(size_bytes "$dev")
[ "$size" -gt 0 ] || die "$dev has size 0"
kv vub_size "$size"
if [ -n "${VUB_READ_MIB:-}" ]; then
    kv read_md5 "$(read_md5 "$dev" "${VUB_READ_MIB%%:*}" "${VUB_READ_MIB##*:}")"
fi
if [ -n "${VUB_WRITE_MIB:-}" ]; then
    raw_roundtrip "$dev" "${VUB_WRITE_MIB%%:*}" "${VUB_WRITE_MIB##*:}" write_md5
fi
if [ -n "${VUB_FS_DEV:-}" ]; then
    fs_roundtrip "$VUB_FS_DEV" /mnt/vub
fi
log "vhost-user-blk ok"
