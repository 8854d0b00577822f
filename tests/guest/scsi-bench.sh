#!/bin/sh
# scsi-bench.sh: the kernel's iSCSI path against ustor's userspace one, in
# the guest, on the same tgtd LUN served by the host (bench/scsi-guest.sh).
# Both are measured by the same tool, `ustor bench --json` on one reactor:
#   kernel:  open-iscsi login (iscsi_tcp + sd), then a uring bdev over the
#            /dev/sdX it made (inline spec uring:/dev/sdX: O_DIRECT), then
#            logout;
#   ustor:   `ustor bench -c` with ustor's iSCSI LLD attached to the same
#            portal (scsi_iscsi_attach_host) and a SCSI bdev over its LUN.
# Rounds alternate which path goes first. Round 1 starts each path with a
# `--verify` randrw pass (it first writes the whole LUN with self-checking
# blocks, so every later read hits written blocks); then each WORKLOADS item
# (rw:qd, writes before reads) runs for RUNTIME seconds.
# Every run prints `USTOR-BENCH ROUND PATH LABEL QD {json}` for the host,
# and `USTOR-IRQ ROUND PATH LABEL QD RES CAL NETIRQ CTXT`: how many
# rescheduling and function-call IPIs, virtio-net interrupts and context
# switches the guest took during the run (the cost of hand-offs between
# vCPUs, which TCG on a busy host makes expensive).
# env: BENCH_PORT, BENCH_IQN (required), BENCH_HOST (10.0.2.2), ROUNDS (3),
#      RUNTIME (5), VERIFY_S (3), POLL (adaptive),
#      WORKLOADS ("randwrite:1 randwrite:32 randread:1 randread:32"),
#      KERNEL_SCHED (none: the I/O scheduler set on the kernel's disk;
#      "keep" leaves the kernel's default), USTOR_BIN (/ustor/bin/ustor)
. /ustor/lib.sh
set -u
: "${BENCH_PORT:?BENCH_PORT is required}"
: "${BENCH_IQN:?BENCH_IQN is required}"
U=${USTOR_BIN:-/ustor/bin/ustor}
PORTAL=${BENCH_HOST:-10.0.2.2}:$BENCH_PORT
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-5}
VERIFY_S=${VERIFY_S:-3}
POLL=${POLL:-adaptive}
WORKLOADS=${WORKLOADS:-"randwrite:1 randwrite:32 randread:1 randread:32"}
KERNEL_SCHED=${KERNEL_SCHED:-none}
# One run's hard limit: the verify pass writes the whole LUN first.
LIMIT=$((RUNTIME + VERIFY_S + 300))

kv guest_kernel "$(uname -r)"
kv guest_cpus "$(grep -c ^processor /proc/cpuinfo)"
run modprobe -a iscsi_tcp sd_mod
# The kernel loads crc32c by alias during login: busybox modprobe.
[ -x /sbin/modprobe ] && echo /sbin/modprobe > /proc/sys/kernel/modprobe
mkdir -p /var/lib/iscsi /run/lock/iscsi
setsid iscsid -f > /tmp/iscsid.log 2>&1 &
n=50
until iscsiadm -m session > /dev/null 2>&1 || [ $? -eq 21 ]; do
    n=$((n - 1))
    [ $n -gt 0 ] || { cat /tmp/iscsid.log; die "iscsid did not start"; }
    sleep 0.1
done
run iscsiadm -m discovery -t sendtargets -p "$PORTAL" > /tmp/discovery
grep -q " $BENCH_IQN\$" /tmp/discovery || { cat /tmp/discovery; die "$BENCH_IQN not discovered"; }
# Discovery advertises tgtd's own 127.0.0.1: record the node at the portal
# the guest reaches.
run iscsiadm -m node -o new -T "$BENCH_IQN" -p "$PORTAL" > /dev/null

cat > /tmp/ustor.json <<EOF
{"subsystems":[{"subsystem":"scsi","config":[
 {"method":"scsi_iscsi_attach_host","params":{"portal":"$PORTAL","target":"$BENCH_IQN","queue_depth":64}},
 {"method":"bdev_scsi_create","params":{"name":"iscsi0","device":"sda"}}]}]}
EOF

# counters: RES and CAL IPIs, virtio-net interrupts (all CPUs), context
# switches.
counters() {
    awk '$1 == "RES:" || $1 == "CAL:" || /virtio.*-(input|output)/ {
            s = 0
            for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i
            if ($1 == "RES:") res = s; else if ($1 == "CAL:") cal = s; else net += s
        }
        END { printf "%d %d %d", res, cal, net }' /proc/interrupts
    awk '$1 == "ctxt" { printf " %d\n", $2 }' /proc/stat
}

# bench ROUND PATH LABEL RW QD ARGS...: one `ustor bench --json` run.
bench() {
    _r=$1 _p=$2 _l=$3 _rw=$4 _qd=$5
    shift 5
    echo "+ round $_r $_p $_l qd$_qd: ustor bench -w $_rw -q $_qd $*" >&2
    _c0=$(counters)
    timeout "$LIMIT" "$U" bench --json --cores 0 --poll-mode "$POLL" --bs 4K \
        -w "$_rw" -q "$_qd" "$@" > /tmp/out.json 2> /tmp/err.log
    _st=$?
    _c1=$(counters)
    cat /tmp/err.log >&2
    [ "$_st" = 0 ] || { cat /tmp/out.json >&2; die "bench $_p $_l qd$_qd: status $_st"; }
    grep -q '"total"' /tmp/out.json || die "bench $_p $_l qd$_qd: no report"
    echo "USTOR-BENCH $_r $_p $_l $_qd $(tr -s ' \n' ' ' < /tmp/out.json)"
    # shellcheck disable=SC2086
    set -- $_c0 $_c1
    echo "USTOR-IRQ $_r $_p $_l $_qd $(($5 - $1)) $(($6 - $2)) $(($7 - $3)) $(($8 - $4))"
    if [ "$_l" = verify ]; then
        grep -q '"verify_errors": [1-9]' /tmp/out.json && die "$_p: verify errors"
        grep -q '"errors": [1-9]' /tmp/out.json && die "$_p: I/O errors in the verify pass"
        kv "${_p}_verify" ok
    fi
    return 0
}

# workloads ROUND PATH ARGS...: the verify pass (round 1), then WORKLOADS.
workloads() {
    _wr=$1 _wp=$2
    shift 2
    if [ "$_wr" = 1 ]; then
        bench "$_wr" "$_wp" verify randrw 32 -t "$VERIFY_S" --verify "$@"
    fi
    for _wl in $WORKLOADS; do
        bench "$_wr" "$_wp" "${_wl%:*}" "${_wl%:*}" "${_wl#*:}" -t "$RUNTIME" "$@"
    done
}

kernel_disk() {
    _n=200
    while :; do
        for _b in /sys/class/iscsi_session/session*/device/target*/*/block/*; do
            [ -e "$_b" ] && { basename "$_b"; return 0; }
        done
        _n=$((_n - 1))
        [ $_n -gt 0 ] || return 1
        sleep 0.1
    done
}

kernel_round() {
    run iscsiadm -m node -T "$BENCH_IQN" -p "$PORTAL" --login > /dev/null
    disk=$(kernel_disk) || die "no disk appeared after iSCSI login"
    wait_for "/dev/$disk"
    q=/sys/block/$disk/queue
    if [ "$KERNEL_SCHED" != keep ]; then
        echo "$KERNEL_SCHED" > "$q/scheduler" || log "cannot set scheduler $KERNEL_SCHED on $disk"
    fi
    if [ "$1" = 1 ]; then
        kv kernel_disk "$disk"
        kv kernel_disk_bytes "$(size_bytes "/dev/$disk")"
        kv kernel_scheduler "$(cat "$q/scheduler")"
        kv kernel_nr_requests "$(cat "$q/nr_requests")"
        kv kernel_device_queue_depth "$(cat "/sys/block/$disk/device/queue_depth" 2>/dev/null)"
        iscsiadm -m session -P 2 >&2 || true
    fi
    workloads "$1" kernel -b "uring:/dev/$disk"
    run iscsiadm -m node -T "$BENCH_IQN" -p "$PORTAL" --logout > /dev/null
    _n=100
    while [ -e "/dev/$disk" ]; do
        _n=$((_n - 1))
        [ $_n -gt 0 ] || die "/dev/$disk still there after logout"
        sleep 0.1
    done
}

ustor_round() {
    workloads "$1" ustor -c /tmp/ustor.json -b iscsi0
}

r=1
while [ "$r" -le "$ROUNDS" ]; do
    if [ $((r % 2)) = 1 ]; then
        kernel_round "$r"
        ustor_round "$r"
    else
        ustor_round "$r"
        kernel_round "$r"
    fi
    log "round $r done at uptime $(cut -d' ' -f1 /proc/uptime)"
    r=$((r + 1))
done
kv rounds_done "$ROUNDS"
exit 0
