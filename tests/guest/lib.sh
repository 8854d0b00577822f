# Helpers for ustor guest scripts; available in the guest as /ustor/lib.sh
# (source it with `. /ustor/lib.sh`). Busybox ash, no bashisms.

# Print a value the host test reads with GuestOutcome::value(KEY).
kv() { echo "USTOR-KV $1=$2"; }

# Diagnostics go to stderr (also the console) so that `run cmd > file`
# captures only the command's own output.
log() { echo "guest: $*" >&2; }

die() { echo "guest: FAILED: $*" >&2; exit 1; }

# Ask the host for the action the test registered as NAME: QMP commands
# (GuestBuilder::on_qmp), e.g. a device_del, or a host-side closure
# (GuestBuilder::on_host); then wait for its effect.
qmp() { echo "USTOR-QMP $1"; }

# Run a command, echoing it first so the serial log shows what failed.
run() {
    echo "+ $*" >&2
    "$@" || die "$* (status $?)"
}

# wait_for PATH [SECONDS]: wait for a device node or file to appear.
wait_for() {
    _n=$(( ${2:-20} * 10 ))
    while [ ! -e "$1" ]; do
        _n=$((_n - 1))
        [ "$_n" -gt 0 ] || die "timed out waiting for $1"
        sleep 0.1
    done
}

# md5 of a file or device (first N MiB if given).
md5_of() {
    if [ -n "${2:-}" ]; then
        dd if="$1" bs=1M count="$2" 2>/dev/null | md5sum | cut -d' ' -f1
    else
        md5sum "$1" | cut -d' ' -f1
    fi
}

# size_bytes /dev/X: block device size.
size_bytes() { blockdev --getsize64 "$1"; }

# fs_roundtrip DEV MOUNTPOINT: mkfs.ext4, write random files, unmount,
# fsck -n, remount and compare checksums. Reports data_md5 (of data.bin)
# and tree_md5 (of the sorted checksum list).
fs_roundtrip() {
    _dev=$1
    _mnt=$2
    run mkfs.ext4 -q -F -E nodiscard "$_dev"
    mkdir -p "$_mnt"
    run mount -t ext4 "$_dev" "$_mnt"
    run dd if=/dev/urandom of="$_mnt/data.bin" bs=64k count=64 2>/dev/null
    mkdir -p "$_mnt/dir"
    _i=0
    while [ $_i -lt 20 ]; do
        dd if=/dev/urandom of="$_mnt/dir/f$_i" bs=1k count=$((_i + 1)) 2>/dev/null || die "write f$_i"
        _i=$((_i + 1))
    done
    (cd "$_mnt" && find . -type f | sort | xargs md5sum) > /tmp/before.md5 || die "checksum before"
    run umount "$_mnt"
    # Drop cached pages so the remount reads from the target, not RAM.
    echo 3 > /proc/sys/vm/drop_caches
    run e2fsck -f -n "$_dev"
    run mount -t ext4 "$_dev" "$_mnt"
    (cd "$_mnt" && find . -type f | sort | xargs md5sum) > /tmp/after.md5 || die "checksum after"
    cmp /tmp/before.md5 /tmp/after.md5 || die "file checksums differ after remount"
    kv data_md5 "$(md5_of "$_mnt/data.bin")"
    kv tree_md5 "$(md5sum /tmp/before.md5 | cut -d' ' -f1)"
    kv files "$(wc -l < /tmp/before.md5)"
    run umount "$_mnt"
}

# read_md5 DEV OFFSET_MIB COUNT_MIB: md5 of a region read with O_DIRECT, so
# it comes from the target and not from the guest's page cache.
read_md5() {
    dd if="$1" bs=1M skip="$2" count="$3" iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1
}

# raw_roundtrip DEV OFFSET_MIB COUNT_MIB KEY: write random data with
# O_DIRECT, read it back with O_DIRECT, compare; report its md5 as KEY.
raw_roundtrip() {
    run dd if=/dev/urandom of=/tmp/raw.bin bs=1M count="$3" 2>/dev/null
    _want=$(md5_of /tmp/raw.bin)
    run dd if=/tmp/raw.bin of="$1" bs=1M seek="$2" count="$3" oflag=direct conv=fsync 2>/dev/null
    _got=$(read_md5 "$1" "$2" "$3")
    [ "$_want" = "$_got" ] || die "raw read-back of $1 differs: wrote $_want read $_got"
    kv "$4" "$_want"
}
