#!/bin/sh
# scsi-sg.sh: ustor's SG_IO LLD inside the guest, against a scsi_debug disk
# and a virtio-scsi disk (GuestBuilder::virtio_scsi_disk).
#  1. `ustor serve` loads a config that attaches every /dev/sg* over RPC
#     (scsi_sg_attach_host "all"); rpc checks devices, a SCSI bdev, a LUN
#     reset, a host reset and save_config.
#  2. Per disk: `ustor bench --verify` on a SCSI bdev mapped at OFF MiB,
#     a write pass, then a read pass on two reactors (the second forwards to
#     the host's reactor), which leaves verify blocks of generation 1 for
#     seed SEED over the whole bdev; dd reads that region back from /dev/sdX
#     (O_DIRECT) for the host to compare with what it computes.
# env: USTOR_BIN (/ustor/bin/ustor), SG_SEED, SG_OFFSET_MIB (1),
#      SG_SIZE_MIB (4), SG_BENCH_S (2)
# reports: sg_nodes, serve_disks, saved_attach, reset_ok,
#          {debug,virtio}_{sg,write_ios,read_ios,md5}
. /ustor/lib.sh

U=${USTOR_BIN:-/ustor/bin/ustor}
SEED=${SG_SEED:-4242}
OFF=${SG_OFFSET_MIB:-1}
LEN=${SG_SIZE_MIB:-4}
SECS=${SG_BENCH_S:-2}
SOCK=/tmp/ustor.sock
RT="--no-pin --mem-size 16"

run modprobe sg
run modprobe scsi_debug dev_size_mb=16

# find_sg MODEL: sets SG (/dev/sgN) and SD (/dev/sdX) of the disk whose
# SCSI model contains MODEL.
find_sg() {
    _n=100
    while [ "$_n" -gt 0 ]; do
        for _d in /sys/class/scsi_generic/sg*; do
            [ -e "$_d/device/model" ] || continue
            case "$(cat "$_d/device/model")" in
            *"$1"*)
                _b=$(ls "$_d/device/block" 2>/dev/null)
                [ -n "$_b" ] || continue
                SG=/dev/${_d##*/}
                SD=/dev/$_b
                wait_for "$SG" 10
                wait_for "$SD" 10
                return 0
                ;;
            esac
        done
        _n=$((_n - 1))
        sleep 0.1
    done
    die "no sg node with model $1"
}

find_sg scsi_debug
DEBUG_SG=$SG DEBUG_SD=$SD
find_sg "QEMU HARDDISK"
VIRTIO_SG=$SG VIRTIO_SD=$SD
kv debug_sg "$DEBUG_SG"
kv virtio_sg "$VIRTIO_SG"
kv sg_nodes "$(ls /dev/sg* | wc -l)"

# ---- 1. serve with the sg LLD attached by config, driven over RPC -------
cat > /tmp/serve.json <<EOF
{"subsystems": [{"subsystem": "scsi", "config": [
  {"method": "scsi_sg_attach_host", "params": {"name": "guest", "devices": "all", "cmd_timeout_ms": 20000}}
]}]}
EOF
"$U" serve -c /tmp/serve.json -r "$SOCK" $RT --log-level warn > /tmp/serve.log 2>&1 &
SERVE=$!
wait_for "$SOCK" 60
rpc() { "$U" rpc -s "$SOCK" "$@"; }
rpc scsi_get_devices > /tmp/devs.json || die "scsi_get_devices"
DISKS=$(grep -c '"driver": "sd"' /tmp/devs.json)
kv serve_disks "$DISKS"
run rpc bdev_scsi_create --json '{"name": "probe", "device": "sda", "size": "1M"}'
rpc scsi_device_reset --json '{"device": "sda"}' | grep -q true || die "device reset"
rpc scsi_host_reset --json '{"host": 0}' | grep -q true || die "host reset"
kv reset_ok 1
"$U" save-config -s "$SOCK" > /tmp/saved.json || die "save-config"
grep -q scsi_sg_attach_host /tmp/saved.json && grep -q '"probe"' /tmp/saved.json &&
    kv saved_attach 1
run rpc bdev_scsi_delete --json '{"name": "probe"}'
kill "$SERVE"
wait "$SERVE" || log "serve exited with $?"

# ---- 2. verified I/O through the sg LLD, then dd through the kernel -----
# bench PASS TAG SG ARGS...: one bench run on a SCSI bdev over SG.
bench() {
    _pass=$1 _tag=$2 _sg=$3
    shift 3
    cat > /tmp/bench.json <<EOF
{"subsystems": [{"subsystem": "scsi", "config": [
  {"method": "scsi_sg_attach_host", "params": {"devices": ["$_sg"]}},
  {"method": "bdev_scsi_create", "params": {"name": "sgd", "device": "sda", "offset": "${OFF}M", "size": "${LEN}M"}}
]}]}
EOF
    echo "+ ustor bench $_pass on $_sg $*" >&2
    "$U" bench $RT --json -c /tmp/bench.json -b sgd --bs 4K -t "$SECS" --verify \
        --seed "$SEED" "$@" > /tmp/out.json 2> /tmp/err.log
    _st=$?
    cat /tmp/err.log >&2
    [ "$_st" = 0 ] || { cat /tmp/out.json >&2; die "bench $_pass on $_sg: status $_st"; }
    grep -q '"verify_errors": [1-9]' /tmp/out.json && die "bench $_pass: verify errors"
    _ios=$(sed -n '/"total"/,/}/p' /tmp/out.json | grep '"ios"' | head -n 1 | tr -dc 0-9)
    [ "${_ios:-0}" -gt 0 ] || { cat /tmp/out.json >&2; die "bench $_pass: no I/O"; }
    kv "${_tag}_${_pass}_ios" "$_ios"
}

disk_pass() {
    _tag=$1 _sg=$2 _sd=$3
    bench write "$_tag" "$_sg" -w write -q 8 --cores 0
    bench read "$_tag" "$_sg" -w read -q 4 --cores 0,1
    run sync
    _md5=$(dd if="$_sd" bs=1M skip="$OFF" count="$LEN" iflag=direct 2>/dev/null |
        md5sum | cut -d' ' -f1)
    kv "${_tag}_md5" "$_md5"
}

disk_pass debug "$DEBUG_SG" "$DEBUG_SD"
disk_pass virtio "$VIRTIO_SG" "$VIRTIO_SD"
exit 0
