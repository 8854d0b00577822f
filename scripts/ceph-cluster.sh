#!/usr/bin/env bash
# A one-node Ceph cluster for tests and benchmarks: one mon and one OSD on
# 127.0.0.1, no mgr, every file (config, keyring, stores, sockets, logs,
# pids) under DIR.
#
#   scripts/ceph-cluster.sh start DIR [--store memstore|bluestore] [--auth none|cephx]
#   scripts/ceph-cluster.sh stop DIR          # TERM the daemons by pid
#   scripts/ceph-cluster.sh stop-osd DIR      # only the OSD (fault tests)
#   scripts/ceph-cluster.sh start-osd DIR     # the OSD again (bluestore keeps data)
#   scripts/ceph-cluster.sh restart DIR       # mon and OSD again after `stop`
#                                             # (bluestore: the whole cluster returns)
#
# After `start`, DIR/ceph.conf names the cluster (`ceph -c DIR/ceph.conf`,
# `rbd -c DIR/ceph.conf`), DIR/keyring holds client.admin's key (cephx), and
# pool `rbd` is initialised and takes writes. memstore (default) is fast and
# loses everything when the OSD stops; bluestore lives in a sparse file
# DIR/osd/block and survives an OSD restart.
#
# Ceph's commands that need a mgr hang forever without one; every `ceph`
# call here runs under `timeout`. Packages (Debian): ceph-mon ceph-osd
# ceph-common.
set -euo pipefail

CMD=${1:-}
DIR=${2:-}
[[ -n "$CMD" && -n "$DIR" ]] || {
    sed -n '2,19p' "$0"
    exit 2
}
shift 2
STORE=memstore
AUTH=none
while [[ $# -gt 0 ]]; do
    case "$1" in
    --store) STORE=$2; shift 2 ;;
    --auth) AUTH=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
case "$STORE" in memstore | bluestore) ;; *) echo "--store memstore|bluestore" >&2; exit 2 ;; esac
case "$AUTH" in none | cephx) ;; *) echo "--auth none|cephx" >&2; exit 2 ;; esac

T=${CEPH_CLUSTER_TIMEOUT:-20}
ceph_() { timeout "$T" ceph -c "$DIR/ceph.conf" "$@"; }

# Seconds to wait for a condition (polled every 50 ms).
wait_for() {
    local what=$1 secs=$2
    shift 2
    local end=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= end)); then
            echo "ceph-cluster: $what did not happen within ${secs}s (logs in $DIR/log)" >&2
            return 1
        fi
        sleep 0.05
    done
}

pid_alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

kill_pidfile() {
    local f=$1
    if pid_alive "$f"; then
        local pid
        pid=$(cat "$f")
        kill -TERM "$pid" 2>/dev/null || true
        # Wait for it to go (memstore stops at once; bluestore flushes).
        local end=$((SECONDS + 15))
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < end)); do sleep 0.05; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

free_port_base() {
    # A base port P with P..P+1 (mon) free; the OSD binds in P+2..P+40.
    python3 - <<'EOF'
import random, socket
for _ in range(200):
    p = random.randrange(20000, 60000, 50)
    ok = True
    for q in (p, p + 1):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", q))
        except OSError:
            ok = False
        finally:
            s.close()
    if ok:
        print(p)
        break
EOF
}

start_mon() {
    setsid ceph-mon -f -i a -c "$DIR/ceph.conf" >>"$DIR/log/mon.a.out" 2>&1 </dev/null &
    echo $! >"$DIR/mon.pid"
    wait_for "mon answering" 30 ceph_ mon stat
}

start_osd() {
    setsid ceph-osd -f -i 0 -c "$DIR/ceph.conf" >>"$DIR/log/osd.0.out" 2>&1 </dev/null &
    echo $! >"$DIR/osd.pid"
    wait_for "osd.0 up" 60 osd_up
}

osd_up() { ceph_ osd dump 2>/dev/null | grep -q '^osd.0 up'; }

rados_put_works() {
    echo probe >"$DIR/probe"
    timeout 5 rados -c "$DIR/ceph.conf" -p rbd put ceph-cluster-probe "$DIR/probe"
}

start() {
    if pid_alive "$DIR/mon.pid"; then
        echo "ceph-cluster: a cluster already runs in $DIR" >&2
        exit 1
    fi
    rm -rf "$DIR/mon" "$DIR/osd" "$DIR/run" "$DIR/log"
    mkdir -p "$DIR/mon" "$DIR/osd" "$DIR/run" "$DIR/log"
    local port fsid osd_uuid
    port=$(free_port_base)
    fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    osd_uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    cat >"$DIR/ceph.conf" <<EOF
[global]
fsid = $fsid
mon_host = [v2:127.0.0.1:$port,v1:127.0.0.1:$((port + 1))]
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_ipv6 = false
ms_bind_port_min = $((port + 2))
ms_bind_port_max = $((port + 40))
auth_cluster_required = $AUTH
auth_service_required = $AUTH
auth_client_required = $AUTH
keyring = $DIR/keyring
run_dir = $DIR/run
pid_file = $DIR/run/\$name.pid
admin_socket = $DIR/run/\$name.asok
log_file = $DIR/log/\$name.log
mon_data = $DIR/mon/\$id
osd_data = $DIR/osd
osd_objectstore = $STORE
paxos_propose_interval = 0.05
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
mon_data_avail_warn = 1
mon_data_avail_crit = 0
mon_mgr_mkfs_grace = 100000000
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
osd_fast_shutdown_notify_mon = false
osd_min_pg_log_entries = 100
osd_max_pg_log_entries = 500
memstore_page_set = true
memstore_page_size = 4096
memstore_device_bytes = 4294967296
bluestore_block_create = true
bluestore_block_size = 4294967296
bluestore_fsck_on_mkfs = false
bluestore_fsck_on_mount = false
osd_heartbeat_grace = 5
EOF
    ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool "$DIR/keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mds 'allow *' --cap mgr 'allow *' >/dev/null
    ceph-authtool "$DIR/keyring" --gen-key -n osd.0 \
        --cap mon 'allow profile osd' --cap osd 'allow *' --cap mgr 'allow profile osd' >/dev/null
    monmaptool --create --fsid "$fsid" \
        --addv a "[v2:127.0.0.1:$port,v1:127.0.0.1:$((port + 1))]" "$DIR/monmap" >/dev/null
    ceph-mon --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring" -c "$DIR/ceph.conf" \
        >"$DIR/log/mkfs-mon.out" 2>&1
    start_mon
    ceph_ osd new "$osd_uuid" 0 >/dev/null
    ceph-osd --mkfs -i 0 --osd-uuid "$osd_uuid" -c "$DIR/ceph.conf" >"$DIR/log/mkfs-osd.out" 2>&1
    start_osd
    ceph_ osd pool create rbd 8 8 >/dev/null 2>&1
    timeout "$T" rbd -c "$DIR/ceph.conf" pool init rbd
    wait_for "rados put to pool rbd" 60 rados_put_works
    echo "ceph-cluster: up in $DIR ($STORE, auth $AUTH, mon 127.0.0.1:$port)"
}

case "$CMD" in
start) start ;;
stop)
    kill_pidfile "$DIR/osd.pid"
    kill_pidfile "$DIR/mon.pid"
    ;;
stop-osd) kill_pidfile "$DIR/osd.pid" ;;
start-osd)
    pid_alive "$DIR/osd.pid" && { echo "ceph-cluster: the OSD runs" >&2; exit 1; }
    start_osd
    wait_for "rados put to pool rbd" 60 rados_put_works
    ;;
restart)
    # The same cluster (fsid, monmap, ports, stores) after `stop`: only a
    # bluestore OSD still has its data.
    [[ -f "$DIR/ceph.conf" ]] || { echo "ceph-cluster: no cluster in $DIR" >&2; exit 1; }
    pid_alive "$DIR/mon.pid" && { echo "ceph-cluster: the mon runs" >&2; exit 1; }
    pid_alive "$DIR/osd.pid" && { echo "ceph-cluster: the OSD runs" >&2; exit 1; }
    start_mon
    start_osd
    wait_for "rados put to pool rbd" 60 rados_put_works
    ;;
*) sed -n '2,19p' "$0"; exit 2 ;;
esac
