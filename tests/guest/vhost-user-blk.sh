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
# /ustor/bin/fio; reports fio_ok=1; with VUB_FIO_SPLIT=1 each job is pinned
# to a CPU of its own, 0 and 1, so a two-queue device gets I/O on both
# queues), VUB_RESIZE_DEV and VUB_RESIZE_BYTES
# (a device the host grows while the rest runs: its size at start, then,
# after waiting up to 120 s for the config-change interrupt, its size
# and a direct read of its new last MiB).
# Reports: vub_size, read_md5, write_md5, discard_md5, fio_ok,
# resize_before, resize_after, resize_read_ok, and the fs_roundtrip
# values.
. /ustor/lib.sh
set -u
dev=${VUB_DEV:-/dev/vda}
wait_for "$dev"
size=$(size_bytes "$dev")
[ "$size" -gt 0 ] || die "$dev has size 0"
kv vub_size "$size"
if [ -n "${VUB_RESIZE_DEV:-}" ]; then
    wait_for "$VUB_RESIZE_DEV"
    kv resize_before "$(size_bytes "$VUB_RESIZE_DEV")"
fi
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
    _split=
    [ "${VUB_FIO_SPLIT:-}" != 1 ] || _split="--cpus_allowed=0-1 --cpus_allowed_policy=split"
    # shellcheck disable=SC2086 # _split is two options or none
    run /ustor/bin/fio --name=vub --filename="$dev" --direct=1 $_split \
        --ioengine=libaio --iodepth=8 --rw=randwrite --bs=4k \
        --offset=$((_o << 20)) --size=$((_c << 19)) --numjobs=2 \
        --offset_increment=$((_c << 19)) --verify=crc32c \
        --verify_fatal=1 --do_verify=1 --group_reporting >&2
    kv fio_ok 1
fi
if [ -n "${VUB_FS_DEV:-}" ]; then
    fs_roundtrip "$VUB_FS_DEV" /mnt/vub
fi
if [ -n "${VUB_RESIZE_DEV:-}" ]; then
    _n=1200
    while [ "$(size_bytes "$VUB_RESIZE_DEV")" != "$VUB_RESIZE_BYTES" ]; do
        _n=$((_n - 1))
        [ "$_n" -gt 0 ] || die "$VUB_RESIZE_DEV never became $VUB_RESIZE_BYTES bytes"
        sleep 0.1
    done
    kv resize_after "$(size_bytes "$VUB_RESIZE_DEV")"
    run dd if="$VUB_RESIZE_DEV" of=/dev/null bs=1M iflag=direct \
        skip=$((VUB_RESIZE_BYTES / 1048576 - 1)) count=1
    kv resize_read_ok 1
fi
log "vhost-user-blk ok"
