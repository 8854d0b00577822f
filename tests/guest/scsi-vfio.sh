#!/bin/sh
# scsi-vfio.sh: ustor's PCI SCSI LLDs over VFIO inside a q35 guest with an
# emulated Intel IOMMU. The test (crates/ustor/tests/scsi_vfio.rs) gives
# the guest a virtio-scsi-pci HBA (iommu_platform=on) at VFIO_BDF with
# three disks (target 0 LUN 0 and 1, target 2 LUN 0), an LSI 53C895A at
# WRONG_BDF for the wrong-driver check, and an LSI SAS1068 (mptsas1068) at
# MPT_BDF with two disks (targets 1 and 3, LUN 0).
#  1. `ustor serve`: attaching the HBA while the kernel's virtio-pci owns
#     it fails saying how to bind; bind it (driver_override +
#     drivers_probe); a wrong driver for a device fails; attach, the scan
#     finds the three disks; a LUN reset, an abort-free host reset; a
#     host reset once the HBA stops answering (memory decoding off) fails
#     and says why; save_config lists the attach; detach and re-attach.
#  2. `ustor bench --verify` on SCSI bdevs at OFF MiB of target 0 LUN 0 and
#     target 2 LUN 0: a write pass, then a read pass on two reactors; the
#     host checks the disk image files.
#  3. The MPT driver: a wrong driver fails, attach (IOC reset, handshake),
#     the scan finds both disks, LUN and host reset, a failing IOC reset
#     (memory decoding off), detach and re-attach,
#     then `ustor bench --verify` write and read passes on both targets.
#  4. Flush and unmap through both drivers (target 2 of the virtio-scsi
#     HBA, target 3 of the SAS1068): `ustor bench -w flush --verify`, then
#     `-w unmap` of the 1 MiB at UNMAP_OFF_MIB; the host checks zeroes.
#     Target 1 of the SAS1068 takes its passes in 1 MiB commands.
#  5. Hot-unplug (QMP device_del by the host, asked for with `qmp`) of
#     target 0 LUN 1 of the virtio-scsi HBA and target 1 of the SAS1068,
#     each under a running `ustor bench`: the disk is seen gone and the
#     bench ends with I/O errors.
#  6. Error handling for real (`escalate`): target 4 of the virtio-scsi HBA
#     and target 5 of the SAS1068 are NBD drives that `ustor serve` on the
#     host exports through delay bdevs. Once a verified QD1 read pass
#     runs, the host makes their reads slow (`qmp slow-TAG`), so one read
#     sits in QEMU's block layer, which cannot cancel it: the command
#     times out, ABORT TASK times out, then the LUN reset (virtio-scsi:
#     QEMU drains the read and answers) or, on the
#     SAS1068, whose IOC still holds the timed-out TMF's frame, a host
#     reset. The retried read (the host made reads fast again, `qmp
#     fast-TAG`) and every other block verify.
# env: VFIO_BDF, WRONG_BDF, MPT_BDF, SEED, OFF_MIB, SIZE_MIB, BENCH_S,
#      UNMAP_OFF_MIB, SHARED_BDF (function 0 of a slot whose function 1
#      stays on its kernel driver: the shared-group error)
# reports: irq, irq_wakes, mpt_irq, mpt_irq_wakes, unbound_error, wrong_driver_error,
#          group_shared_error, disks, reset_ok, dead_reset_error, mpt_dead_reset_error,
#          saved_attach, reattach_disks, {t0,t2}_{write,read}_ios,
#          zero_copy, mpt_wrong_driver_error, mpt_disks, mpt_reset_ok, mpt_events_on,
#          mpt_reattach_disks, {m1,m3}_{write,read}_ios,
#          {t2,m3}_{flush,unmap}_ios, {t0l1,m1}_gone,
#          {t0l1,m1}_unplug_{ios,errors}, {t4,m5}_read_ios,
#          {t4,m5}_eh_{timeouts,aborts,aborts_failed,device_resets,
#          device_resets_failed,host_resets,host_resets_failed},
#          {t0,m1}_zero_copy_other
. /ustor/lib.sh

U=${USTOR_BIN:-/ustor/bin/ustor}
BDF=${VFIO_BDF:-0000:00:05.0}
WRONG=${WRONG_BDF:-0000:00:06.0}
MPT=${MPT_BDF:-0000:00:07.0}
SEED=${SEED:-4242}
OFF=${OFF_MIB:-1}
LEN=${SIZE_MIB:-4}
SECS=${BENCH_S:-2}
UOFF=${UNMAP_OFF_MIB:-8}
SOCK=/tmp/ustor.sock
RT="--no-pin --mem-size 16"

# The emulated IOMMU runs without interrupt remapping (intremap=off);
# ustor polls and enables no interrupts, so this is safe here.
run modprobe vfio_iommu_type1 allow_unsafe_interrupts=1
run modprobe vfio_pci

bind_vfio() {
    _d=/sys/bus/pci/devices/$1
    echo vfio-pci > "$_d/driver_override" || die "driver_override $1"
    if [ -e "$_d/driver" ]; then echo "$1" > "$_d/driver/unbind"; fi
    echo "$1" > /sys/bus/pci/drivers_probe
    _g=$(readlink "$_d/iommu_group")
    wait_for "/dev/vfio/${_g##*/}" 10
    log "$1 bound to vfio-pci, IOMMU group ${_g##*/}"
}

# ---- 1. serve, driven over RPC -------------------------------------------
echo '{"subsystems": []}' > /tmp/empty.json
"$U" serve -c /tmp/empty.json -r "$SOCK" $RT --log-level warn > /tmp/serve.log 2>&1 &
SERVE=$!
_i=600
while [ ! -S "$SOCK" ] && [ "$_i" -gt 0 ]; do sleep 0.1; _i=$((_i - 1)); done
[ -S "$SOCK" ] || { cat /tmp/serve.log >&2; die "serve did not start"; }
rpc() { "$U" rpc -s "$SOCK" "$@"; }
ATTACH="{\"pci_address\": \"$BDF\", \"driver\": \"virtio-scsi\"}"

rpc scsi_vfio_attach_host --json "$ATTACH" > /tmp/e1 2>&1 && die "attach of an unbound HBA worked"
cat /tmp/e1 >&2
grep -q "not vfio-pci" /tmp/e1 && grep -q driver_override /tmp/e1 && kv unbound_error 1

bind_vfio "$BDF"
bind_vfio "$WRONG"
# Function 0 of a two-function slot (one IOMMU group) while function 1
# stays on virtio-pci: refused, naming the other device.
if [ -n "${SHARED_BDF:-}" ]; then
    bind_vfio "$SHARED_BDF"
    rpc scsi_vfio_attach_host --json "{\"pci_address\": \"$SHARED_BDF\", \"driver\": \"virtio-scsi\"}" \
        > /tmp/e4 2>&1 && die "attach with a shared IOMMU group worked"
    cat /tmp/e4 >&2
    grep -q "also holds" /tmp/e4 && grep -q "virtio-pci" /tmp/e4 && kv group_shared_error 1
fi
rpc scsi_vfio_attach_host --json "{\"pci_address\": \"$WRONG\", \"driver\": \"virtio-scsi\"}" \
    > /tmp/e2 2>&1 && die "virtio-scsi attached to an LSI HBA"
cat /tmp/e2 >&2
grep -q "not a virtio-scsi controller" /tmp/e2 && kv wrong_driver_error 1

# Failed attaches used host numbers too: take the one this attach got.
H=$(rpc scsi_vfio_attach_host --json "$ATTACH") || die "attach"
log "attached as host $H"
rpc scsi_get_devices > /tmp/devs.json || die "scsi_get_devices"
cat /tmp/devs.json >&2
kv disks "$(grep -c '"driver": "sd"' /tmp/devs.json)"
rpc scsi_get_hosts > /tmp/hosts.json && cat /tmp/hosts.json >&2
# The reactor may sleep (adaptive mode): an MSI-X vector wakes it.
irq_kv() {
    kv "${1}irq" "$(sed -n 's/.*"irq": "\([a-z]*\)".*/\1/p' /tmp/hosts.json | head -n 1)"
    kv "${1}irq_wakes" "$(sed -n 's/.*"irq_wakes": \([0-9]*\).*/\1/p' /tmp/hosts.json | head -n 1)"
}
irq_kv ""
rpc scsi_device_reset --json '{"device": "'"$H"':0:0:1"}' | grep -q true || die "LUN reset"
rpc scsi_host_reset --json '{"host": '"$H"'}' | grep -q true || die "host reset"
kv reset_ok 1
# dead_reset BDF HOST PREFIX REASON: a controller that fails its reset.
# Its memory decoding is turned off behind ustor's back (a config write
# through sysfs), so its registers read as zeroes, as from a card that
# stopped answering: the host reset must fail (an RPC error) with REASON
# in serve's log, and return. The detach and re-attach that follow turn
# decoding on again (attach enables memory space and bus mastering).
dead_reset() {
    printf '\000' | dd of="/sys/bus/pci/devices/$1/config" bs=1 seek=4 count=1 conv=notrunc \
        2>/dev/null || die "memory decoding off on $1"
    rpc scsi_host_reset --json '{"host": '"$2"'}' > /tmp/e5 2>&1 &&
        die "host reset of $1 worked with its memory decoding off"
    cat /tmp/e5 >&2
    grep "host reset failed" /tmp/serve.log >&2
    grep -q "reset failed" /tmp/e5 && grep -q "$4" /tmp/serve.log && kv "${3}dead_reset_error" 1
}
dead_reset "$BDF" "$H" "" "does not respond"
"$U" save-config -s "$SOCK" > /tmp/saved.json || die "save-config"
grep -q scsi_vfio_attach_host /tmp/saved.json && kv saved_attach 1
run rpc scsi_vfio_detach_host --json "{\"pci_address\": \"$BDF\"}"
run rpc scsi_vfio_attach_host --json "$ATTACH"
kv reattach_disks "$(rpc scsi_get_devices | grep -c '"driver": "sd"')"
kill "$SERVE"
wait "$SERVE" || log "serve exited with $?"

# ---- 2. verified I/O ---------------------------------------------------
# bench PASS TAG HCTL ARGS...: one bench run on a SCSI bdev of BLEN MiB at
# BOFF MiB (default: LEN at OFF) of the HBA that $ATTACH names, I/O size
# BBS (4K).
bench() {
    _pass=$1 _tag=$2 _dev=$3
    shift 3
    cat > /tmp/bench.json <<EOF
{"subsystems": [{"subsystem": "scsi", "config": [
  {"method": "scsi_vfio_attach_host", "params": $ATTACH},
  {"method": "bdev_scsi_create", "params": {"name": "vd", "device": "$_dev", "offset": "${BOFF:-$OFF}M", "size": "${BLEN:-$LEN}M"}}
]}]}
EOF
    echo "+ ustor bench $_pass on $_dev $*" >&2
    "$U" bench $RT --json -c /tmp/bench.json -b vd --bs "${BBS:-4K}" -t "$SECS" \
        --seed "$SEED" "$@" > /tmp/out.json 2> /tmp/err.log
    _st=$?
    cat /tmp/err.log >&2
    [ "$_st" = 0 ] || { cat /tmp/out.json >&2; die "bench $_pass on $_dev: status $_st"; }
    grep -q '"verify_errors": [1-9]' /tmp/out.json && die "bench $_pass: verify errors"
    _ios=$(sed -n '/"total"/,/}/p' /tmp/out.json | grep '"ios"' | head -n 1 | tr -dc 0-9)
    [ "${_ios:-0}" -gt 0 ] || { cat /tmp/out.json >&2; die "bench $_pass: no I/O"; }
    kv "${_tag}_${_pass}_ios" "$_ios"
}

bench write t0 0:0:0:0 -w write -q 8 --cores 0 --verify
bench read t0 0:0:0:0 -w read -q 4 --cores 0,1 --verify --log-level info
# Reactor 1's buffers reached the device zero-copy (every pool is mapped).
zc_other() {
    kv "${1}_zero_copy_other" "$(grep 'scsi_get_hosts' /tmp/err.log | tail -n 1 |
        sed -n 's/.*"zero_copy_other_pool_cmds": *\([0-9]*\).*/\1/p')"
}
zc_other t0
bench write t2 0:0:2:0 -w write -q 8 --cores 0 --verify
bench read t2 0:0:2:0 -w read -q 4 --cores 0 --verify
# flush_unmap TAG HCTL: SYNCHRONIZE CACHE with every flushed unit read back
# intact (--verify writes them first), then UNMAP of the whole 1 MiB at
# UOFF MiB, which the host then finds deallocated (zeroes) in the image.
# QEMU's disks report no LBPRZ, so ustor promises no zeroes itself.
flush_unmap() {
    BOFF=$UOFF BLEN=1 _secs=$SECS SECS=1
    bench flush "$1" "$2" -w flush -q 2 --cores 0 --verify
    BBS=1M
    bench unmap "$1" "$2" -w unmap -q 1 --cores 0
    BOFF= BLEN= BBS= SECS=$_secs
}
flush_unmap t2 0:0:2:0

# escalate TAG HCTL: see 6. above. A QD1 verified read pass on a 1 MiB
# SCSI bdev whose commands time out after 1 s and TMFs after 1 s. Reads
# are made slow only once its read phase runs ("bench progress"): before
# it come the raid examine's read of the new bdev and the verify prefill
# (a read pass with --verify writes its region first: those are the
# WRITEs in the log), and a stuck examine read would leave the verified
# reads untouched. The next read then sits in QEMU's block layer for the
# host's delay (5 s), past the command timeout and the abort's TMF
# timeout; once its abort is logged (a new "EH: abort" line: a command
# that timed out under load before may have logged one), the host makes
# reads fast again, before any retry. Reports the host's EH counters (scsi_get_stats, which
# the bench logs at info level after the run).
escalate() {
    _att=$(echo "$ATTACH" | sed 's/}$/, "cmd_timeout_ms": 1000, "tmf_timeout_ms": 1000}/')
    cat > /tmp/esc.json <<EOF
{"subsystems": [{"subsystem": "scsi", "config": [
  {"method": "scsi_vfio_attach_host", "params": $_att},
  {"method": "bdev_scsi_create", "params": {"name": "esc", "device": "$2", "offset": "${OFF}M", "size": "1M"}}
]}]}
EOF
    echo "+ ustor bench read on $2, one read stuck on the host" >&2
    _out=/tmp/esc-$1.out _err=/tmp/esc-$1.err
    "$U" bench $RT --json -c /tmp/esc.json -b esc --bs 4K -t 4 -w read -q 1 \
        --cores 0 --seed "$SEED" --verify --log-level info > "$_out" 2> "$_err" &
    _b=$!
    _i=900
    until grep -q "bench progress" "$_err" 2>/dev/null; do
        kill -0 "$_b" 2>/dev/null || { cat "$_err" >&2; die "bench on $2 ended before its reads"; }
        _i=$((_i - 1))
        [ "$_i" -gt 0 ] || { cat "$_err" >&2; die "bench on $2 shows no progress"; }
        sleep 0.1
    done
    _n=$(grep -c "EH: abort tag" "$_err")
    qmp "slow-$1"
    until [ "$(grep -c "EH: abort tag" "$_err")" -gt "$_n" ]; do
        kill -0 "$_b" 2>/dev/null || break
        sleep 0.1
    done
    qmp "fast-$1"
    wait "$_b"
    _st=$?
    cat "$_err" >&2
    cat "$_out" >&2
    [ "$_st" = 0 ] || die "bench read through EH on $2: status $_st"
    grep -q '"verify_errors": [1-9]' "$_out" && die "escalate $2: verify errors"
    _ios=$(sed -n '/"total"/,/}/p' "$_out" | grep '"ios"' | head -n 1 | tr -dc 0-9)
    kv "${1}_read_ios" "${_ios:-0}"
    _stats=$(grep 'scsi_get_stats' "$_err" | tail -n 1)
    for _k in timeouts aborts aborts_failed device_resets device_resets_failed \
        host_resets host_resets_failed; do
        kv "${1}_eh_$_k" "$(echo "$_stats" | sed -n "s/.*\"$_k\": *\([0-9]*\).*/\1/p")"
    done
}
escalate t4 0:0:4:0

# hot_unplug TAG HCTL NAME: a randread `ustor bench` on HCTL while the
# host deletes that disk (the QMP action NAME: device_del). The mid-layer
# sees it gone (virtio-scsi: a hot-unplug event; MPT: DEVICE_NOT_THERE),
# rescans, and the SCSI bdev is hot-removed: the bench ends early with
# errors instead of running out its 60 s or hanging.
hot_unplug() {
    cat > /tmp/hp.json <<EOF
{"subsystems": [{"subsystem": "scsi", "config": [
  {"method": "scsi_vfio_attach_host", "params": $ATTACH},
  {"method": "bdev_scsi_create", "params": {"name": "hp", "device": "$2", "offset": "${OFF}M", "size": "${LEN}M"}}
]}]}
EOF
    echo "+ ustor bench on $2 while the host unplugs it" >&2
    # Files of this run only: a stale one would let the wait below pass
    # before this bench has started.
    _out=/tmp/hp-$1.out _err=/tmp/hp-$1.err
    "$U" bench $RT --json -c /tmp/hp.json -b hp --bs 4K -t 60 -w randread -q 2 \
        --cores 0 --log-level info > "$_out" 2> "$_err" &
    _b=$!
    _i=900
    until grep -q "bench progress" "$_err" 2>/dev/null; do
        kill -0 "$_b" 2>/dev/null || { cat "$_err" >&2; die "bench on $2 ended before the unplug"; }
        _i=$((_i - 1))
        [ "$_i" -gt 0 ] || die "bench on $2 shows no progress"
        sleep 0.1
    done
    qmp "$3"
    wait "$_b"
    _st=$?
    cat "$_err" >&2
    cat "$_out" >&2
    [ "$_st" = 1 ] || die "bench on unplugged $2: status $_st, want 1 (I/O errors)"
    grep -q "($2) is gone" "$_err" && kv "${1}_gone" 1
    _tot=$(sed -n '/"total"/,/}/p' "$_out")
    kv "${1}_unplug_ios" "$(echo "$_tot" | grep '"ios"' | head -n 1 | tr -dc 0-9)"
    kv "${1}_unplug_errors" "$(echo "$_tot" | grep '"errors"' | head -n 1 | tr -dc 0-9)"
}
hot_unplug t0l1 0:0:0:1 unplug-t0l1

# ---- 3. the MPT Fusion SAS driver ------------------------------------------
bind_vfio "$MPT"
"$U" serve -c /tmp/empty.json -r "$SOCK" $RT --log-level warn > /tmp/serve.log 2>&1 &
SERVE=$!
_i=600
while [ ! -S "$SOCK" ] && [ "$_i" -gt 0 ]; do sleep 0.1; _i=$((_i - 1)); done
[ -S "$SOCK" ] || { cat /tmp/serve.log >&2; die "serve did not start"; }
rpc scsi_vfio_attach_host --json "{\"pci_address\": \"$WRONG\", \"driver\": \"mptsas\"}" \
    > /tmp/e3 2>&1 && die "mptsas attached to an LSI 53C895A"
cat /tmp/e3 >&2
grep -q "not an LSI SAS1068" /tmp/e3 && kv mpt_wrong_driver_error 1
ATTACH="{\"pci_address\": \"$MPT\", \"driver\": \"mptsas\"}"
H=$(rpc scsi_vfio_attach_host --json "$ATTACH") || { cat /tmp/serve.log >&2; die "mptsas attach"; }
log "MPT attached as host $H"
rpc scsi_get_devices > /tmp/devs.json || die "scsi_get_devices"
cat /tmp/devs.json >&2
kv mpt_disks "$(grep -c '"driver": "sd"' /tmp/devs.json)"
rpc scsi_get_hosts > /tmp/hosts.json && cat /tmp/hosts.json >&2
irq_kv mpt_
# Event notification is on: the IOC answered EventNotification with an
# EVENT_CHANGE reply (QEMU's SAS1068 sends no device events after it).
kv mpt_events_on "$(sed -n 's/.*"event_notification": \([a-z]*\).*/\1/p' /tmp/hosts.json | head -n 1)"
rpc scsi_device_reset --json '{"device": "'"$H"':0:3:0"}' | grep -q true || die "MPT LUN reset"
rpc scsi_host_reset --json '{"host": '"$H"'}' | grep -q true || die "MPT host reset"
kv mpt_reset_ok 1
# The IOC reads as zeroes: its interrupt mask does not keep what the
# reset writes, so the reset fails at once.
dead_reset "$MPT" "$H" mpt_ "controller failed its reset"
run rpc scsi_vfio_detach_host --json "{\"pci_address\": \"$MPT\"}"
run rpc scsi_vfio_attach_host --json "$ATTACH"
kv mpt_reattach_disks "$(rpc scsi_get_devices | grep -c '"driver": "sd"')"
kill "$SERVE"
wait "$SERVE" || log "serve exited with $?"

# 1 MiB commands on target 1: zero-copy from both reactors' pools.
BBS=1M
bench write m1 0:0:1:0 -w write -q 2 --cores 0 --verify
bench read m1 0:0:1:0 -w read -q 2 --cores 0,1 --verify --log-level info
zc_other m1
BBS=
bench write m3 0:0:3:0 -w write -q 8 --cores 0 --verify
bench read m3 0:0:3:0 -w read -q 4 --cores 0 --verify
flush_unmap m3 0:0:3:0
escalate m5 0:0:5:0
hot_unplug m1 0:0:1:0 unplug-m1
exit 0
