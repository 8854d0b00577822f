# shellcheck shell=bash
# Sourced by the vhost benchmarks: `vhost_null_config FILE [BLOCKS]` writes
# the `ustor serve` configuration they share, a null bdev (BLOCKS blocks
# of 512 bytes, default 2097152: 1 GiB that touches no data) behind one
# vhost-user-blk controller, vb0.
vhost_null_config() {
    cat >"$1" <<J
{"subsystems": [
  {"subsystem": "bdev", "config": [{"method": "bdev_null_create", "params": {"name": "Null0", "num_blocks": ${2:-2097152}, "block_size": 512}}]},
  {"subsystem": "vhost_blk", "config": [{"method": "vhost_create_blk_controller", "params": {"ctrlr": "vb0", "dev_name": "Null0"}}]}
]}
J
}
