#!/bin/sh
# fs-bench.sh: inside the guest, the kernel's NFSv3 client against
# nfs-ganesha and ustor's FUSE client against ustor's file server, both
# servers on the host (bench/fs-guest.sh), the same tmpfs behind both.
# Each mount first gets its file laid out by fio with a crc32c verify pass
# (every block written through the mount is read back and checked), then
# per round (alternating which mount goes first) every WORKS item runs
# for RUNTIME seconds: fio psync, QD1, O_DIRECT. fio's JSON reports go to
# /mnt/share/r<round>-<mount>-<rw>-<bs>.json for the host to read.
# env: NFS_PATH, NFS_PORT, MNT_PORT, FS_PORT, FS_EXPORT, USTOR_FS_SECRET
#      (required), BENCH_HOST (10.0.2.2), ROUNDS (3), RUNTIME (5),
#      SIZE_MIB (32), WORKS ("randread:4k randwrite:4k read:1m write:1m")
. /ustor/lib.sh
set -u
: "${NFS_PATH:?}" "${NFS_PORT:?}" "${MNT_PORT:?}" "${FS_PORT:?}" "${FS_EXPORT:?}" "${USTOR_FS_SECRET:?}"
H=${BENCH_HOST:-10.0.2.2}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-5}
SIZE_MIB=${SIZE_MIB:-32}
WORKS=${WORKS:-randread:4k randwrite:4k read:1m write:1m}
OUT=/mnt/share
FIO=/ustor/bin/fio

kv guest_kernel "$(uname -r)"
kv guest_cpus "$(grep -c ^processor /proc/cpuinfo)"
run modprobe -a nfsv3 fuse
cp /ustor/netconfig /etc/netconfig
cp /ustor/protocols /etc/protocols
wait_for /dev/fuse
mkdir -p /mnt/nfs /mnt/ustor
run /ustor/bin/mount.nfs "$H:$NFS_PATH" /mnt/nfs \
    -o vers=3,proto=tcp,port=$NFS_PORT,mountport=$MNT_PORT,mountproto=tcp,nolock
/ustor/bin/ustor fs mount "$H:$FS_PORT/$FS_EXPORT" /mnt/ustor --fuse-mode classic \
    >/tmp/mount.log 2>&1 &
MOUNT_PID=$!
n=100
until grep -q " /mnt/ustor fuse" /proc/mounts; do
    n=$((n - 1))
    [ "$n" -gt 0 ] || { cat /tmp/mount.log; die "ustor fs mount did not come up"; }
    sleep 0.1
done
grep -E " /mnt/(nfs|ustor) " /proc/mounts >&2

# Lay out and verify: every block written through the mount is read back
# through it and checked (fio exits non-zero on a mismatch).
for m in nfs ustor; do
    run $FIO --name=lay --filename=/mnt/$m/bench.dat --size=${SIZE_MIB}m --rw=write \
        --bs=1m --ioengine=psync --direct=1 --verify=crc32c --do_verify=1 \
        --output-format=terse --output=/tmp/lay-$m.txt
    kv verified_$m "$SIZE_MIB MiB"
done

r=1
while [ "$r" -le "$ROUNDS" ]; do
    if [ $((r % 2)) -eq 1 ]; then order="ustor nfs"; else order="nfs ustor"; fi
    for w in $WORKS; do
        rw=${w%%:*}
        bs=${w#*:}
        for m in $order; do
            run $FIO --name=b --filename=/mnt/$m/bench.dat --size=${SIZE_MIB}m --rw=$rw \
                --bs=$bs --ioengine=psync --iodepth=1 --direct=1 --time_based \
                --runtime=$RUNTIME --output-format=json --output=$OUT/r$r-$m-$rw-$bs.json
        done
    done
    r=$((r + 1))
done

run umount /mnt/ustor
wait "$MOUNT_PID" || log "ustor fs mount exited with $?"
run umount /mnt/nfs
echo "USTOR-FS-BENCH done"
