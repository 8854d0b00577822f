# shellcheck shell=bash
# Sourced by the vhost benchmarks: `vhost_null_config FILE [BLOCKS]` writes
# the `ustor serve` configuration they share, a null bdev (BLOCKS blocks
# of 512 bytes, default 2097152: 1 GiB that touches no data) behind one
# vhost-user-blk controller, vb0; `vhost_null_config FILE BLOCKS scsi`: the
# same bdev as target 0 of a vhost-user-scsi controller, vb0.
vhost_null_config() {
    if [ "${3:-blk}" = scsi ]; then
        cat >"$1" <<J
{"subsystems": [
  {"subsystem": "bdev", "config": [{"method": "bdev_null_create", "params": {"name": "Null0", "num_blocks": ${2:-2097152}, "block_size": 512}}]},
  {"subsystem": "vhost_scsi", "config": [{"method": "vhost_create_scsi_controller", "params": {"ctrlr": "vb0"}},
    {"method": "vhost_scsi_controller_add_target", "params": {"ctrlr": "vb0", "scsi_target_num": 0, "bdev_name": "Null0"}}]}
]}
J
        return
    fi
    cat >"$1" <<J
{"subsystems": [
  {"subsystem": "bdev", "config": [{"method": "bdev_null_create", "params": {"name": "Null0", "num_blocks": ${2:-2097152}, "block_size": 512}}]},
  {"subsystem": "vhost_blk", "config": [{"method": "vhost_create_blk_controller", "params": {"ctrlr": "vb0", "dev_name": "Null0"}}]}
]}
J
}
