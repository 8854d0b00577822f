#!/bin/sh
# NVMe/TCP target, LANoT coalescing modes compared in one run.
# Target: one reactor (core 0), malloc namespace. Client: a pipelined raw
# NVMe/TCP client thread (examples/nvmf_load.rs) on the other core, one I/O
# queue, 4 KiB random reads/writes. Reports IOPS, average latency and the
# target's sendmsg calls per I/O, for modes off / fixed(8, 20us) / adaptive.
# Usage: bench/nvmf.sh [SECS]   (results also go to bench/results/nvmf-<date>.txt)
set -eu
secs=${1:-3}
cd "$(dirname "$0")/.."
cargo build --release -q -p ustor-nvme --example nvmf_load
bin=target/release/examples/nvmf_load
out=bench/results/nvmf-$(date +%Y%m%d-%H%M%S).txt
{
    echo "# $(date -u) $(uname -r) $(nproc) cpus; secs=$secs"
    for rw in read write; do
        for qd in 1 32 128; do
            for mode in off fixed adaptive; do
                taskset -c 1 "$bin" "$mode" "$qd" "$secs" "$rw" 2>/dev/null || echo "mode=$mode qd=$qd rw=$rw FAILED"
            done
        done
    done
} | tee "$out"
