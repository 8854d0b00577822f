#!/bin/sh
# vhost-user-scsi interop: the guest's virtio-scsi driver against a
# vhost-user-scsi backend on the host with targets 0 and 1 (LUN 0 each).
#  1. Both disks appear; each gets a raw O_DIRECT round trip (reported as
#     t0_md5 / t1_md5 for the host to compare with its files) and fio
#     with crc32c verify runs on target 0.
#  2. A LUN reset (sg_reset -d, a LOGICAL UNIT RESET TMF on the control
#     queue) on target 0; the disk still reads back what was written.
#  3. Hot-plug: the guest writes a marker at MARK_MIB on target 1, the
#     host adds target 2; the driver must see it from the event queue
#     (no manual rescan) and a round trip runs on it (t2_md5). Then a
#     marker on target 2, the host removes target 1, and its disk must go
#     away.
# Env: VUS_MIB=OFFSET:COUNT (round-trip region), VUS_FIO_MIB=OFFSET:COUNT,
#      VUS_MARK_MIB (marker offset).
# Reports: t0_size, t1_size, t0_md5, t1_md5, fio_ok, reset_ok, t2_md5,
#          t1_removed.
. /ustor/lib.sh
set -u
OFF=${VUS_MIB%%:*}
CNT=${VUS_MIB##*:}
MARK=${VUS_MARK_MIB:-48}

# disk_of T [SECONDS]: prints /dev/sdX of target T's LUN 0 once it exists.
disk_of() {
    _n=$(( ${2:-30} * 10 ))
    while [ "$_n" -gt 0 ]; do
        for _b in /sys/bus/scsi/devices/*:0:"$1":0/block/*; do
            if [ -e "$_b" ] && [ -e "/dev/${_b##*/}" ]; then
                echo "/dev/${_b##*/}"
                return 0
            fi
        done
        _n=$((_n - 1))
        sleep 0.1
    done
    return 1
}

# gone T [SECONDS]: waits until target T's LUN 0 is no more.
gone() {
    _n=$(( ${2:-30} * 10 ))
    while ls -d /sys/bus/scsi/devices/*:0:"$1":0 >/dev/null 2>&1; do
        _n=$((_n - 1))
        [ "$_n" -gt 0 ] || return 1
        sleep 0.1
    done
}

# mark DEV TEXT: writes TEXT in the first sector at MARK MiB (O_DIRECT).
mark() {
    printf '%s' "$2" > /tmp/mark
    run dd if=/tmp/mark of="$1" bs=512 count=1 seek=$((MARK * 2048)) conv=sync oflag=direct 2>/dev/null
}

D0=$(disk_of 0) || die "no disk for target 0"
D1=$(disk_of 1) || die "no disk for target 1"
kv t0_size "$(size_bytes "$D0")"
kv t1_size "$(size_bytes "$D1")"
raw_roundtrip "$D0" "$OFF" "$CNT" t0_md5
T0=$(md5_of /tmp/raw.bin)
raw_roundtrip "$D1" "$OFF" "$CNT" t1_md5
if [ -n "${VUS_FIO_MIB:-}" ]; then
    _o=${VUS_FIO_MIB%%:*}
    _c=${VUS_FIO_MIB##*:}
    run /ustor/bin/fio --name=vus --filename="$D0" --direct=1 \
        --ioengine=libaio --iodepth=8 --rw=randwrite --bs=4k \
        --offset=$((_o << 20)) --size=$((_c << 20)) --verify=crc32c \
        --verify_fatal=1 --do_verify=1 >&2
    kv fio_ok 1
fi

run /ustor/bin/sg_reset -d "$D0"
[ "$(read_md5 "$D0" "$OFF" "$CNT")" = "$T0" ] || die "target 0 differs after the LUN reset"
kv reset_ok 1

mark "$D1" USTOR-ADD-TARGET
D2=$(disk_of 2 60) || die "hot-plugged target 2 never appeared"
raw_roundtrip "$D2" "$OFF" "$CNT" t2_md5
mark "$D2" USTOR-DEL-TARGET
gone 1 60 || die "target 1 is still there after its removal"
kv t1_removed 1
log "vhost-user-scsi ok"
