#!/bin/sh
# NBD interop: the kernel nbd driver (nbd-client) against a server on the
# host. Connects, makes an ext4, writes files, unmounts, fscks, remounts and
# compares checksums, then disconnects.
# Env: NBD_PORT (required), NBD_EXPORT (export name, default: the server's
# default export), NBD_HOST (default 10.0.2.2, the host's 127.0.0.1).
# Reports: nbd_size, data_md5 (of /data.bin in the fs), tree_md5, files.
. /ustor/lib.sh
set -u
: "${NBD_PORT:?NBD_PORT is required}"
host=${NBD_HOST:-10.0.2.2}

run modprobe nbd nbds_max=4
wait_for /dev/nbd0
if [ -n "${NBD_EXPORT:-}" ]; then
    run nbd-client "$host" "$NBD_PORT" /dev/nbd0 -N "$NBD_EXPORT"
else
    run nbd-client "$host" "$NBD_PORT" /dev/nbd0
fi
size=$(size_bytes /dev/nbd0)
[ "$size" -gt 0 ] || die "nbd0 has size 0 after connect"
kv nbd_size "$size"
fs_roundtrip /dev/nbd0 /mnt/nbd
run nbd-client -d /dev/nbd0
log "nbd ok"
