# Sourced by bench/scsi.sh and bench/scsi-guest.sh: one tgtd (Debian `tgt`)
# serving one iSCSI LUN backed by a file of random data, and its teardown.
# tgtd ignores SIGTERM: tgtd_stop deletes it through its control port, then
# kills it by PID (only the tgtd this script started).

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }

TGT_PID=
TGT_IMG=

# tgtd_start IMG SIZE_MIB IQN LOG [command prefix, e.g. taskset -c 1]
# Sets PORT (iSCSI portal on 127.0.0.1), CTL (tgtadm control port), TGT_PID.
tgtd_start() {
  local img=$1 size=$2 iqn=$3 log=$4
  shift 4
  PORT=$(free_port)
  CTL=$((20000 + PORT % 10000))
  TGT_IMG=$img
  truncate -s "${size}M" "$img"
  # Written once so reads hit allocated pages on every path.
  dd if=/dev/urandom of="$img" bs=1M count="$size" conv=notrunc status=none
  "$@" tgtd -f --iscsi portal=127.0.0.1:"$PORT" -C "$CTL" >"$log" 2>&1 &
  TGT_PID=$!
  wait_port "$PORT"
  tgtadm -C "$CTL" --lld iscsi --op new --mode target --tid 1 -T "$iqn"
  tgtadm -C "$CTL" --lld iscsi --op new --mode logicalunit --tid 1 --lun 1 -b "$img"
  tgtadm -C "$CTL" --lld iscsi --op bind --mode target --tid 1 -I ALL
}

tgtd_stop() {
  if [ -n "$TGT_PID" ]; then
    tgtadm -C "$CTL" --lld iscsi --op delete --mode target --tid 1 --force >/dev/null 2>&1 || true
    tgtadm -C "$CTL" --op delete --mode system >/dev/null 2>&1 || true
    for _ in $(seq 50); do kill -0 "$TGT_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$TGT_PID" 2>/dev/null || true
    wait "$TGT_PID" 2>/dev/null || true
    TGT_PID=
  fi
  [ -z "$TGT_IMG" ] || rm -f "$TGT_IMG"
}
