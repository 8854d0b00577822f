#!/usr/bin/env bash
# NVMe fused Compare + Write from a real initiator (issue 22): SPDK's
# bdev_nvme sends a fused Compare + Write pair for a bdev compare-and-write
# when the controller reports FUSES, so this chain puts SPDK in front of
# ustor's NVMe/TCP target:
#
#   libiscsi iscsi-test-cu (SCSI COMPARE AND WRITE)
#     -> SPDK iscsi_tgt, a LUN on a bdev_nvme bdev
#       -> NVMe/TCP: fused Compare (FUSE 01b) + Write (FUSE 10b)
#         -> `ustor serve`: NVMe-oF target, namespace on an rbd bdev
#            (512-byte blocks: librbd compares within one sector)
#           -> librbd rbd_aio_compare_and_write -> a one-node Ceph cluster
#
# and checks with libiscsi's CompareAndWrite tests that a match writes and
# a miscompare leaves the data (libiscsi reads every block back), and that
# every pair reached the rbd bdev as one compare-and-write (its iostat
# counters: without FUSES, SPDK's bdev layer would emulate them with a
# plain Compare and a Write), with no other error on the way.
#
# Usage: SPDK_DIR=<an SPDK build (bench/spdk-build.sh)> scripts/spdk-fused-check.sh
# Environment: USTOR=<ustor binary> (default target/debug/ustor), KEEP=1
#   keeps the work directory.
# Needs: SPDK's iscsi_tgt and scripts/rpc.py; libiscsi-bin (iscsi-test-cu,
# iscsi-inq); ceph-mon, ceph-osd, ceph-common; python3. Exit 0 when every
# check passes.
set -euo pipefail
cd "$(dirname "$0")/.."
SPDK_DIR=${SPDK_DIR:?set SPDK_DIR to an SPDK build}
USTOR=${USTOR:-target/debug/ustor}
TGT=$SPDK_DIR/build/bin/iscsi_tgt
for x in "$TGT" "$USTOR"; do [ -x "$x" ] || { echo "missing: $x" >&2; exit 2; }; done
for c in iscsi-test-cu iscsi-inq ceph-mon ceph-osd rbd python3; do
    command -v "$c" >/dev/null || { echo "missing: $c" >&2; exit 2; }
done
export LD_LIBRARY_PATH=$SPDK_DIR/build/lib:$SPDK_DIR/dpdk/build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

tmp=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    scripts/ceph-cluster.sh stop "$tmp/ceph" >/dev/null 2>&1 || true
    if [ -n "${KEEP:-}" ]; then echo "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { # what cmd...: up to 60 s
    local what=$1 i
    shift
    for i in $(seq 600); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
    fail "$what"
}
ustor_rpc() { python3 -c '
import json, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": sys.argv[2],
                      "params": json.loads(sys.argv[3])}).encode())
buf = b""
while True:
    buf += s.recv(65536)
    try:
        r = json.loads(buf); break
    except ValueError:
        continue
if "error" in r: sys.exit("rpc error: %s" % r["error"])
print(json.dumps(r["result"]))' "$tmp/ustor.sock" "$1" "${2:-null}"; }

scripts/ceph-cluster.sh start "$tmp/ceph" --store memstore --auth none >/dev/null
conf=$tmp/ceph/ceph.conf
rbd -c "$conf" create --size 16M rbd/caw

NQN=nqn.2016-06.io.spdk:ustor-caw
NPORT=$(free_port)
cat >"$tmp/ustor.json" <<JSON
{"subsystems": [
 {"subsystem": "bdev", "config": [
  {"method": "bdev_rbd_register_cluster", "params": {"name": "c1", "config_file": "$conf"}},
  {"method": "bdev_rbd_create", "params": {"name": "r0", "cluster_name": "c1", "pool_name": "rbd",
   "rbd_name": "caw", "block_size": 512}}]},
 {"subsystem": "nvmf", "config": [
  {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
  {"method": "nvmf_create_subsystem", "params": {"nqn": "$NQN", "allow_any_host": true}},
  {"method": "nvmf_subsystem_add_ns", "params": {"nqn": "$NQN", "namespace": {"bdev_name": "r0"}}},
  {"method": "nvmf_subsystem_add_listener", "params": {"nqn": "$NQN", "listen_address":
   {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "$NPORT"}}}]}]}
JSON
"$USTOR" serve --no-pin -r "$tmp/ustor.sock" -c "$tmp/ustor.json" --log-level warn >"$tmp/ustor.log" 2>&1 &
pids+=($!)
wait_for "ustor's NVMe/TCP listener" python3 -c "import socket; socket.create_connection(('127.0.0.1', $NPORT))"

IQN=iqn.2016-06.io.spdk:caw
IPORT=$(free_port)
cat >"$tmp/spdk.json" <<JSON
{"subsystems": [
 {"subsystem": "bdev", "config": [
  {"method": "bdev_nvme_attach_controller", "params": {"name": "U", "trtype": "tcp", "adrfam": "ipv4",
   "traddr": "127.0.0.1", "trsvcid": "$NPORT", "subnqn": "$NQN"}}]},
 {"subsystem": "iscsi", "config": [
  {"method": "iscsi_set_options", "params": {"max_sessions": 4, "max_connections_per_session": 2,
   "max_queue_depth": 32, "pdu_pool_size": 1024, "immediate_data_pool_size": 128, "data_out_pool_size": 128}},
  {"method": "iscsi_create_portal_group", "params": {"tag": 1, "portals": [{"host": "127.0.0.1", "port": "$IPORT"}]}},
  {"method": "iscsi_create_initiator_group", "params": {"tag": 1, "initiators": ["ANY"], "netmasks": ["ANY"]}},
  {"method": "iscsi_create_target_node", "params": {"name": "caw", "alias_name": "caw",
   "pg_ig_maps": [{"pg_tag": 1, "ig_tag": 1}], "luns": [{"bdev_name": "Un1", "lun_id": 0}],
   "queue_depth": 32, "disable_chap": true}}]}]}
JSON
"$TGT" -m 0x1 --disable-cpumask-locks --no-huge -s 512 -r "$tmp/spdk.sock" --json "$tmp/spdk.json" >"$tmp/spdk.log" 2>&1 &
pids+=($!)
URL=iscsi://127.0.0.1:$IPORT/$IQN/0
wait_for "SPDK iscsi_tgt's LUN" iscsi-inq "$URL"

# (Small iSCSI pools: the target runs in 512 MiB without hugepages.)
# SPDK's iscsi_tgt takes COMPARE AND WRITE of one block only, though its
# Block Limits page says 255 (its own malloc LUN fails the same way), so:
# Unwritten (256 one-block compare-and-writes that miscompare, each block
# read back unchanged) must pass, and Simple must get its one-block round
# through (all 'A' overwritten with 'B' and read back) and fail first at
# two blocks, SPDK's refusal.
before=$(ustor_rpc bdev_get_iostat '{"name": "r0"}')
run() { # TEST: iscsi-test-cu -V, output in $tmp/TEST.log
    iscsi-test-cu -V -d -i iqn.2007-10.com.github:caw-1 -I iqn.2007-10.com.github:caw-2 \
        -t "SCSI.CompareAndWrite.$1" "$URL" >"$tmp/$1.log" 2>&1 || true
}
run Unwritten
# CUnit's summary line: tests Total Ran Passed Failed.
grep -Eq '^ +tests +1 +1 +1 +0' "$tmp/Unwritten.log" || { cat "$tmp/Unwritten.log"; fail "Unwritten"; }
grep -q "COMPARE AND WRITE not supported" "$tmp/Unwritten.log" && fail "compare-and-write not offered"
run Simple
python3 - "$tmp/Simple.log" <<'PY' || { cat "$tmp/Simple.log"; fail "Simple's one-block round"; }
import sys
log = open(sys.argv[1]).read()
one = log.index("Overwrite 1 blocks with 'B' at LBA:0")
two = log.index("Write 2 blocks of 'A' at LBA:0")
first_fail = log.find("[FAILED]")
assert "verify they are all 'B'" in log[one:two], "no read-back after the one-block compare-and-write"
assert first_fail == -1 or first_fail > two, "failed before two blocks"
PY
after=$(ustor_rpc bdev_get_iostat '{"name": "r0"}')
python3 - "$before" "$after" "$(ustor_rpc bdev_get_bdevs '{"name": "r0"}')" <<'PY'
import json, sys
b, a = (json.loads(x)["bdevs"][0] for x in sys.argv[1:3])
d = lambda k: a[k] - b[k]
ok, bad = d("num_compare_and_write_ops"), d("compare_and_write_errors")
health = json.loads(sys.argv[3])[0]["driver_specific"]["rbd"]["health"]
print(f"rbd bdev r0: {ok} compare-and-writes matched and wrote, {bad} miscompared; "
      f"{d('errors')} errors in all; librbd I/O errors: {health['io_errors']}")
# Unwritten: 256 miscompares; Simple: one match (its two-block ones stop at SPDK).
if ok != 1 or bad != 256:
    sys.exit("FAIL: the fused pairs did not all reach the rbd bdev as compare-and-writes")
if d("errors") != bad or health["io_errors"] != 0:
    sys.exit("FAIL: errors other than miscompares")
PY
echo "PASS: fused Compare + Write from SPDK bdev_nvme through ustor's NVMe/TCP target to librbd"
