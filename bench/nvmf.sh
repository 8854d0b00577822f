#!/bin/sh
# NVMe/TCP LANoT experiment through ustor's own initiator bdev.
# Target: a runtime on core 0 (malloc namespace). Initiator bdev + in-reactor
# load generator: a second runtime on core 1 (examples/nvmf_initiator_load.rs),
# one I/O queue, same coalescing mode on both sides:
# off / fixed(degree 16, timer 50 us) / adaptive.
# Part 1: randread/randwrite 4 KiB and randread 16 KiB, QD 1..128.
# Part 2: QD1 paced at fixed low rates (50..500 IOPS): latency per mode.
# Usage: bench/nvmf.sh [SECS] [RATE_SECS]; results in bench/results/nvmf-init-<date>.txt
# (the older raw-client run is examples/nvmf_load.rs).
set -eu
secs=${1:-2}
rsecs=${2:-4}
cd "$(dirname "$0")/.."
[ -n "${NOBUILD:-}" ] || cargo build --release -q -p ustor-nvme --example nvmf_initiator_load
bin=target/release/examples/nvmf_initiator_load
out=bench/results/nvmf-init-$(date +%Y%m%d-%H%M%S).txt
{
    echo "# $(date -u) $(uname -r) $(nproc) cpus $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); secs=$secs rate_secs=$rsecs"
    echo "# cmd: bench/nvmf.sh $secs $rsecs"
    for w in "randread 4096" "randwrite 4096" "randread 16384"; do
        set -- $w
        for qd in 1 8 32 128; do
            for mode in off fixed adaptive; do
                "$bin" "$mode" "$1" "$2" "$qd" "$secs" 2>/dev/null || echo "mode=$mode rw=$1 bs=$2 qd=$qd FAILED"
            done
        done
    done
    for rate in 50 200 500; do
        for mode in off fixed adaptive; do
            "$bin" "$mode" randread 4096 1 "$rsecs" "$rate" 2>/dev/null || echo "mode=$mode rate=$rate FAILED"
        done
    done
} | tee "$out"
echo "$out"
