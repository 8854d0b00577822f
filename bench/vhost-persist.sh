#!/usr/bin/env bash
# Usage (root): SPDK_DIR=<SPDK with vhost> N=8 bench/vhost-persist.sh
# Test of the per-point spread of bench/vhost.sh. One SPDK vhost backend (core 0); QD32 randread 1 s points: N fresh bdevperf processes alternating
# with N perform_tests runs of one long-lived bdevperf (core 1). Does the per-point spread follow the frontend process?
set -euo pipefail
S=${SPDK_DIR:?}; export LD_LIBRARY_PATH=$S/build/lib:$S/dpdk/build/lib
N=${N:-8}; t=$(mktemp -d)
nice -n -20 taskset -c 0 $S/build/bin/vhost -m 0x1 --disable-cpumask-locks --no-huge -s 512 -S $t -r $t/be.rpc >$t/be.log 2>&1 & be=$!
# The frontend is kept stopped between its runs: a SIGTERM stays pending on
# a stopped process, so the exit trap also continues it (a stopped orphan
# kept the bench lock of its caller once).
trap 'kill $fe $be 2>/dev/null; [ -n "$fe" ] && kill -CONT $fe 2>/dev/null; wait; rm -rf $t' EXIT; fe=
for _ in $(seq 100); do [ -S $t/be.rpc ] && break; sleep 0.1; done
python3 $S/scripts/rpc.py -s $t/be.rpc -t 30 framework_wait_init >/dev/null
python3 $S/scripts/rpc.py -s $t/be.rpc bdev_null_create Null0 1024 512 >/dev/null
python3 $S/scripts/rpc.py -s $t/be.rpc vhost_create_blk_controller --cpumask 0x1 vb0 Null0 >/dev/null
python3 $S/scripts/rpc.py -s $t/be.rpc bdev_null_create Null1 1024 512 >/dev/null
python3 $S/scripts/rpc.py -s $t/be.rpc vhost_create_blk_controller --cpumask 0x1 vb1 Null1 >/dev/null
cat >$t/fe.json <<J
{"subsystems": [{"subsystem": "bdev", "config": [{"method": "bdev_virtio_attach_controller", "params": {"name": "V", "trtype": "user", "traddr": "$t/vb0", "dev_type": "blk", "vq_count": 2}}]}]}
J
sed "s#$t/vb0#$t/vb1#" $t/fe.json >$t/fe1.json
nice -n -20 taskset -c 1 $S/build/examples/bdevperf -m 0x2 --disable-cpumask-locks -g --huge-dir /dev/hugepages -s 512 -r $t/fe.rpc --json $t/fe.json -z -q 32 -o 4096 -w randread -t 1 >$t/persist.log 2>&1 & fe=$!
for _ in $(seq 100); do python3 $S/scripts/rpc.py -s $t/fe.rpc -t 2 bdev_get_bdevs -b V >/dev/null 2>&1 && break; sleep 0.1; done
echo "# uptime: $(uptime)"
kill -STOP $fe
for i in $(seq $N); do
  f=$(nice -n -20 taskset -c 1 $S/build/examples/bdevperf -m 0x2 --disable-cpumask-locks -g --huge-dir /dev/hugepages -s 512 --no-rpc-server --json $t/fe1.json -q 32 -o 4096 -w randread -t 1 2>&1 | tr -d '\r' | awk '/^ *Total +:/ {print $3}')
  kill -CONT $fe
  p=$(python3 $S/examples/bdev/bdevperf/bdevperf.py -s $t/fe.rpc -t 30 perform_tests -q 32 -o 4096 -w randread -t 1 2>&1 | grep -o '"iops": [0-9.]*' | tail -1 | awk '{print $2}')
  kill -STOP $fe
  echo "pair $i fresh_iops=$f persistent_iops=$p"
done
echo "# uptime: $(uptime)"
