#!/bin/sh
# vhost-user-blk interop: the guest's virtio-blk driver against a
# vhost-user-blk backend on the host (the disk is /dev/vda). Checks a region
# the host filled, writes a region the host then checks, and optionally runs
# the ext4 round trip on a second device.
# Env: VUB_DEV (default /dev/vda), VUB_READ_MIB=OFFSET:COUNT (region the host
# wrote; reported as read_md5), VUB_WRITE_MIB=OFFSET:COUNT (region the
# guest fills; reported as write_md5), VUB_FS_DEV (device for the ext4 round
# trip, e.g. /dev/vdb; none by default), VUB_DISCARD_MIB=OFFSET:COUNT
# (region discarded, then read back; reported as discard_md5),
# VUB_FIO_MIB=OFFSET:COUNT (fio writes the region with crc32c verify
# headers on two jobs at queue depth 8 and verifies it; needs
# /ustor/bin/fio; reports fio_ok=1).
# Reports: vub_size, read_md5, write_md5, discard_md5, fio_ok, and the
# fs_roundtrip values.
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
if [ -n "${VUB_DISCARD_MIB:-}" ]; then
    _o=${VUB_DISCARD_MIB%%:*}
    _c=${VUB_DISCARD_MIB##*:}
    run blkdiscard -o $((_o << 20)) -l $((_c << 20)) "$dev"
    kv discard_md5 "$(read_md5 "$dev" "$_o" "$_c")"
fi
if [ -n "${VUB_FIO_MIB:-}" ]; then
    _o=${VUB_FIO_MIB%%:*}
    _c=${VUB_FIO_MIB##*:}
    # Two jobs, each on its half of the region, 8 requests in flight each.
    run /ustor/bin/fio --name=vub --filename="$dev" --direct=1 \
        --ioengine=libaio --iodepth=8 --rw=randwrite --bs=4k \
        --offset=$((_o << 20)) --size=$((_c << 19)) --numjobs=2 \
        --offset_increment=$((_c << 19)) --verify=crc32c \
        --verify_fatal=1 --do_verify=1 --group_reporting >&2
    kv fio_ok 1
fi
if [ -n "${VUB_FS_DEV:-}" ]; then
    fs_roundtrip "$VUB_FS_DEV" /mnt/vub
fi
log "vhost-user-blk ok"
