#!/bin/sh
# dm-poll-bench.sh: the kernel's polled device mapper against ustor's polled
# composite bdevs, on the same two emulated NVMe disks in the same guest
# (booted by crates/ustor/tests/dm_poll_bench.rs for bench/dm-poll.sh).
# The NVMe driver is loaded with poll queues, so io_uring IOPOLL works on the
# disks and, since Linux 5.18, on dm-linear and dm-stripe over them.
#
# Per round, alternating which side goes first, for each layout
# (linear = dm-linear vs ustor concat; stripe = dm-stripe vs ustor raid0,
# both with 64 KiB chunks) and each queue depth, 4 KiB random reads:
#   fio-poll   fio, io_uring, hipri (polled), on /dev/mapper/LAYOUT
#   fio-irq    fio, io_uring, interrupts, on /dev/mapper/LAYOUT
#   kdm-poll   `ustor bench` on a uring bdev with IOPOLL over /dev/mapper/LAYOUT
#              (the same tool as the ustor row: only the composite differs)
#   ustor      `ustor bench` on a concat/raid0 of two IOPOLL uring bdevs
# Each run prints `DMPOLL ROUND LAYOUT PATH QD CPU_TICKS {json}`; CPU_TICKS
# is the guest's busy time (user+system+irq+softirq, USER_HZ ticks) during
# the run; the JSON is fio's or ustor bench's report.
# Before the rounds the script checks that polling is real: io_poll is 1 on
# the disks and the DM devices, and ustor's uring bdevs report
# `"iopoll": true` (a fallback to interrupts fails the run).
# env: ROUNDS (3), RUNTIME (5), QDS ("1 32"), LAYOUTS ("linear stripe"),
#      USTOR_BIN (/ustor/bin/ustor)
. /ustor/lib.sh

U=${USTOR_BIN:-/ustor/bin/ustor}
FIO=/ustor/bin/fio
DMSETUP=/ustor/bin/dmsetup
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-5}
QDS=${QDS:-"1 32"}
LAYOUTS=${LAYOUTS:-"linear stripe"}
CHUNK_SECTORS=128 # 64 KiB: dm-stripe's chunk and ustor's strip_size_kb

run modprobe nvme poll_queues=2
run modprobe dm_mod
wait_for /dev/nvme0n1
wait_for /dev/nvme1n1
mkdir -p /dev/mapper
for d in nvme0n1 nvme1n1; do
    [ "$(cat /sys/block/$d/queue/io_poll)" = 1 ] || die "$d: io_poll is not 1 (no poll queues)"
    echo none > /sys/block/$d/queue/scheduler 2>/dev/null
done

S0=$(blockdev --getsz /dev/nvme0n1)
S1=$(blockdev --getsz /dev/nvme1n1)
[ "$S0" = "$S1" ] || die "the two disks differ in size ($S0, $S1 sectors)"
printf '0 %s linear /dev/nvme0n1 0\n%s %s linear /dev/nvme1n1 0\n' "$S0" "$S0" "$S1" |
    run "$DMSETUP" create linear
echo "0 $((S0 + S1)) striped 2 $CHUNK_SECTORS /dev/nvme0n1 0 /dev/nvme1n1 0" |
    run "$DMSETUP" create stripe
run "$DMSETUP" mknodes
wait_for /dev/mapper/linear
wait_for /dev/mapper/stripe
for m in linear stripe; do
    # No udev: /dev/mapper/NAME is a node, the sysfs name is dm-MINOR.
    dm=dm-$("$DMSETUP" info -c --noheadings -o minor "$m" | tr -d ' ')
    [ "$(cat /sys/block/$dm/queue/io_poll)" = 1 ] || die "/dev/mapper/$m ($dm): io_poll is not 1"
    kv "${m}_io_poll" 1
done

# ustor's configs: the composite over the two disks, and one uring bdev
# over each DM device.
uring() { echo "{\"method\": \"bdev_uring_create\", \"params\": {\"name\": \"$1\", \"filename\": \"$2\", \"iopoll\": true}}"; }
raid() {
    echo "{\"method\": \"bdev_raid_create\", \"params\": {\"name\": \"c\", \"raid_level\": \"$1\", \"strip_size_kb\": 64, \"base_bdevs\": [\"n0\", \"n1\"]}}"
}
for l in linear stripe; do
    lvl=concat
    [ $l = stripe ] && lvl=raid0
    echo "{\"subsystems\": [{\"subsystem\": \"bdev\", \"config\": [$(uring n0 /dev/nvme0n1), $(uring n1 /dev/nvme1n1), $(raid $lvl)]}]}" > /tmp/ustor-$l.json
    echo "{\"subsystems\": [{\"subsystem\": \"bdev\", \"config\": [$(uring c /dev/mapper/$l)]}]}" > /tmp/kdm-$l.json
done

# IOPOLL really used: every uring bdev of both configs says so over RPC.
check_iopoll() {
    "$U" serve -c "$1" --cores 0 --no-pin --mem-size 16 -r /tmp/check.sock > /tmp/serve.log 2>&1 &
    _pid=$!
    _n=100
    until "$U" rpc -s /tmp/check.sock bdev_get_bdevs > /tmp/bdevs.json 2>/dev/null; do
        _n=$((_n - 1))
        [ $_n -gt 0 ] || { cat /tmp/serve.log >&2; die "ustor serve -c $1 did not answer"; }
        sleep 0.1
    done
    kill "$_pid"
    wait "$_pid"
    _want=$(grep -o bdev_uring_create "$1" | wc -l)
    _got=$(tr -d ' \n' < /tmp/bdevs.json | grep -o '"iopoll":true' | wc -l)
    [ "$_got" = "$_want" ] || { cat /tmp/bdevs.json >&2; die "$1: $_got of $_want uring bdevs poll"; }
}
for l in linear stripe; do
    check_iopoll /tmp/ustor-$l.json
    check_iopoll /tmp/kdm-$l.json
done
kv ustor_iopoll 1

busy() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8 }' /proc/stat; }

report() { # ROUND LAYOUT PATH QD TICKS FILE
    echo "DMPOLL $1 $2 $3 $4 $5 $(tr -s ' \n\t' ' ' < "$6")"
}

fio_run() { # ROUND LAYOUT PATH QD HIPRI
    _c0=$(busy)
    "$FIO" --name=dm --filename="/dev/mapper/$2" --ioengine=io_uring --hipri="$5" \
        --fixedbufs=1 --registerfiles=1 --direct=1 --rw=randread --bs=4k \
        --iodepth="$4" --time_based --runtime="$RUNTIME" --cpus_allowed=0 \
        --randrepeat=0 --output-format=json > /tmp/fio.json 2> /tmp/fio.err ||
        { cat /tmp/fio.err /tmp/fio.json >&2; die "fio $2 $3 qd$4"; }
    _c1=$(busy)
    report "$1" "$2" "$3" "$4" $((_c1 - _c0)) /tmp/fio.json
}

bench_run() { # ROUND LAYOUT PATH QD CONFIG
    _c0=$(busy)
    "$U" bench --json --cores 0 --mem-size 16 --poll-mode poll --bs 4K -w randread \
        -q "$4" -t "$RUNTIME" -c "$5" -b c > /tmp/out.json 2> /tmp/err.log ||
        { cat /tmp/err.log /tmp/out.json >&2; die "ustor bench $2 $3 qd$4"; }
    _c1=$(busy)
    report "$1" "$2" "$3" "$4" $((_c1 - _c0)) /tmp/out.json
}

kernel_side() { # ROUND LAYOUT QD
    fio_run "$1" "$2" fio-poll "$3" 1
    fio_run "$1" "$2" fio-irq "$3" 0
    bench_run "$1" "$2" kdm-poll "$3" /tmp/kdm-$2.json
}

r=1
while [ "$r" -le "$ROUNDS" ]; do
    for l in $LAYOUTS; do
        for q in $QDS; do
            if [ $((r % 2)) = 1 ]; then
                kernel_side "$r" "$l" "$q"
                bench_run "$r" "$l" ustor "$q" /tmp/ustor-$l.json
            else
                bench_run "$r" "$l" ustor "$q" /tmp/ustor-$l.json
                kernel_side "$r" "$l" "$q"
            fi
        done
    done
    log "round $r done at uptime $(cut -d' ' -f1 /proc/uptime)"
    r=$((r + 1))
done
kv rounds_done "$ROUNDS"
exit 0
