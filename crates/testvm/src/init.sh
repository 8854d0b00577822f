#!/bin/sh
# PID 1 of the ustor test guest (busybox ash). Brings up just enough of a
# system for the kernel initiators, runs /ustor/test.sh as a child (so an
# `exit` in it cannot kill init), then prints the exit marker the host
# parses and powers off. Anything that fails here is reported with exit
# status 200+ so it is never mistaken for the script's own status.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
umask 022

mount -t proc proc /proc
echo "USTOR-GUEST-INIT uptime=$(cut -d' ' -f1 /proc/uptime)"
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /run/lock/iscsi /var/lib/iscsi /tmp
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd 2>/dev/null
hostname ustor-guest

finish() {
    sync
    echo "USTOR-GUEST-EXIT=$1"
    poweroff -f
    # poweroff returned: nothing else to do but wait for QEMU to stop us.
    while :; do sleep 1; done
}

# The kernel requests modules by alias (crypto-crc32c for iSCSI digests and
# ext4); point it at busybox modprobe, which reads our modules.dep.
echo /sbin/modprobe > /proc/sys/kernel/modprobe
modprobe -a $(cat /etc/ustor-boot-modules /ustor/modules 2>/dev/null) || echo "ustor-init: some boot modules failed to load"

ip link set lo up
if ip link set eth0 up 2>/dev/null; then
    # QEMU user networking: fixed addresses; 10.0.2.2 is the host's loopback.
    ip addr add 10.0.2.15/24 dev eth0
    ip route add default via 10.0.2.2
fi

if [ -f /ustor/shares ]; then
    while read -r tag mnt; do
        [ -n "$tag" ] || continue
        mkdir -p "$mnt"
        mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 "$tag" "$mnt" ||
            { echo "ustor-init: mount 9p $tag on $mnt failed"; finish 201; }
    done < /ustor/shares
fi

[ -f /ustor/env ] && . /ustor/env
[ -f /ustor/test.sh ] || { echo "ustor-init: no /ustor/test.sh"; finish 202; }

echo "USTOR-GUEST-START uptime=$(cut -d' ' -f1 /proc/uptime)"
cd /ustor
/bin/sh /ustor/test.sh
rc=$?
echo "USTOR-GUEST-END uptime=$(cut -d' ' -f1 /proc/uptime)"
finish $rc
