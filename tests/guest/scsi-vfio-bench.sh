#!/bin/sh
# scsi-vfio-bench.sh: the kernel's virtio_scsi + sd path against ustor's
# virtio-scsi LLD over VFIO, on the same virtio-scsi disk in the same
# guest (booted by crates/ustor/tests/scsi_vfio_bench.rs for
# bench/scsi-vfio.sh). Per round, alternating which path goes first:
#   kernel: the HBA on virtio-pci (virtio_scsi, sd), `ustor bench` on
#           uring:/dev/sdX (io_uring, O_DIRECT), and at QD1 fio with the
#           psync and io_uring engines (the study's tool; when shipped);
#   ustor:  the HBA on vfio-pci, `ustor bench -c` with
#           scsi_vfio_attach_host + a SCSI bdev over the whole disk;
#   mptsas: (with MPT_BDF) an LSI SAS1068 on vfio-pci with a disk of the
#           same size, through ustor's MPT Fusion LLD, the same way.
# Same tool, workload and disk; only the path differs. Each run prints
# `USTOR-BENCH ROUND PATH RW QD CPU_TICKS {json}`; CPU_TICKS is the guest's
# busy time (user+system+irq+softirq, in USER_HZ ticks) during the run.
# env: VFIO_BDF, MPT_BDF (optional), ROUNDS (3), RUNTIME (5), POLL (adaptive),
#      WORKLOADS ("randread:1 randwrite:1 randread:32 randwrite:32")
. /ustor/lib.sh

U=${USTOR_BIN:-/ustor/bin/ustor}
FIO=/ustor/bin/fio
BDF=${VFIO_BDF:-0000:00:05.0}
MPT_BDF=${MPT_BDF:-}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-5}
POLL=${POLL:-adaptive}
WORKLOADS=${WORKLOADS:-"randread:1 randwrite:1 randread:32 randwrite:32"}
D=/sys/bus/pci/devices/$BDF

run modprobe vfio_iommu_type1 allow_unsafe_interrupts=1
run modprobe vfio_pci
run modprobe virtio_scsi

to_driver() {
    echo "$1" > "$D/driver_override"
    if [ -e "$D/driver" ]; then echo "$BDF" > "$D/driver/unbind"; fi
    echo "$BDF" > /sys/bus/pci/drivers_probe
}

busy() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8 }' /proc/stat; }

bench() {
    _r=$1 _p=$2 _rw=$3 _qd=$4
    shift 4
    _c0=$(busy)
    "$U" bench --json --cores 0 --no-pin --mem-size 16 --poll-mode "$POLL" --bs 4K \
        -w "$_rw" -q "$_qd" -t "$RUNTIME" "$@" > /tmp/out.json 2> /tmp/err.log ||
        { cat /tmp/err.log /tmp/out.json >&2; die "bench $_p $_rw qd$_qd"; }
    _c1=$(busy)
    echo "USTOR-BENCH $_r $_p $_rw $_qd $((_c1 - _c0)) $(tr -s ' \n' ' ' < /tmp/out.json)"
}

workloads() {
    _r=$1 _p=$2
    shift 2
    for w in $WORKLOADS; do
        bench "$_r" "$_p" "${w%%:*}" "${w##*:}" "$@"
    done
}

kernel_round() {
    to_driver virtio-pci
    _n=100
    until _b=$(ls "$D"/virtio*/host*/target*/*:*/block/ 2>/dev/null) && [ -n "$_b" ] && [ -e "/dev/$_b" ]; do
        _n=$((_n - 1))
        [ $_n -gt 0 ] || die "no sd disk on $BDF"
        sleep 0.1
    done
    echo none > "/sys/block/$_b/queue/scheduler" 2>/dev/null
    [ "$1" = 1 ] && kv kernel_disk "$_b"
    workloads "$1" kernel -b "uring:/dev/$_b"
    if [ -x "$FIO" ]; then
        for w in $WORKLOADS; do
            [ "${w##*:}" = 1 ] || continue
            fio_run "$1" psync "${w%%:*}" "/dev/$_b"
            fio_run "$1" io_uring "${w%%:*}" "/dev/$_b"
        done
    fi
}

# fio at QD1 on the kernel's disk (the study's tool): one job on CPU 0,
# O_DIRECT, 4 KiB, RUNTIME seconds. Prints `USTOR-FIO ROUND ENGINE RW 1
# CPU_TICKS {fio json}`.
fio_run() {
    _r=$1 _e=$2 _rw=$3 _dev=$4
    _c0=$(busy)
    taskset -c 0 "$FIO" --name=k --filename="$_dev" --direct=1 --ioengine="$_e" \
        --iodepth=1 --rw="$_rw" --bs=4k --time_based --runtime="$RUNTIME" \
        --randrepeat=0 --norandommap --output-format=json > /tmp/fio.json 2> /tmp/fio.err ||
        { cat /tmp/fio.err >&2; die "fio $_e $_rw"; }
    _c1=$(busy)
    echo "USTOR-FIO $_r $_e $_rw 1 $((_c1 - _c0)) $(tr -s ' \n' ' ' < /tmp/fio.json)"
}

cat > /tmp/ustor.json <<EOF
{"subsystems": [{"subsystem": "scsi", "config": [
  {"method": "scsi_vfio_attach_host", "params": {"pci_address": "$BDF", "driver": "virtio-scsi"}},
  {"method": "bdev_scsi_create", "params": {"name": "vd", "device": "0:0:0:0"}}
]}]}
EOF

ustor_round() {
    to_driver vfio-pci
    workloads "$1" ustor -c /tmp/ustor.json -b vd
    if [ -n "$MPT_BDF" ]; then workloads "$1" mptsas -c /tmp/mpt.json -b vd; fi
}

if [ -n "$MPT_BDF" ]; then
    _m=/sys/bus/pci/devices/$MPT_BDF
    echo vfio-pci > "$_m/driver_override"
    if [ -e "$_m/driver" ]; then echo "$MPT_BDF" > "$_m/driver/unbind"; fi
    echo "$MPT_BDF" > /sys/bus/pci/drivers_probe
    sed -e "s/$BDF/$MPT_BDF/" -e s/virtio-scsi/mptsas/ /tmp/ustor.json > /tmp/mpt.json
fi

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
