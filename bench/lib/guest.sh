# Running a guest benchmark's runner and writing its raw file, for the
# scripts that boot the project's TCG guest (fs-guest.sh, scsi-guest.sh,
# scsi-vfio.sh, dm-poll.sh). Each script still sets its runner's own
# environment and parses its own results; what they share is here.

# guest_runner DIR CARGO_ARGS...: runs `cargo test CARGO_ARGS... -- --ignored
# --nocapture` (the guest runner) under a timeout of GUEST_TIMEOUT_S plus
# two minutes, its output in DIR/runner.out and DIR/runner.err. Sets
# GUEST_T0 and GUEST_T1 (start and end, in seconds) and GUEST_LOAD0 (the
# load average at the start). On failure it prints the runner's tail and,
# when GUEST_LOG names a file, the serial log's, and returns 1; the caller
# decides whether that ends the script.
guest_runner() {
    local dir=$1 status=0
    shift
    GUEST_LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
    GUEST_T0=$(date +%s)
    timeout $((GUEST_TIMEOUT_S + 120)) \
        cargo test "$@" -- --ignored --nocapture \
        >"$dir/runner.out" 2>"$dir/runner.err" || status=$?
    GUEST_T1=$(date +%s)
    if [ "$status" != 0 ]; then
        echo "guest run failed (status $status); runner output:" >&2
        tail -n 80 "$dir/runner.out" "$dir/runner.err" >&2
        if [ -n "${GUEST_LOG:-}" ] && [ -f "$GUEST_LOG" ]; then
            echo "serial log ($GUEST_LOG):" >&2
            tail -n 60 "$GUEST_LOG" >&2
        fi
        return 1
    fi
}

# guest_raw_header NAME LINE...: the head of a raw results file on stdout:
# the script's name, the date and host, each LINE given, and the runner's
# time and load (from guest_runner).
guest_raw_header() {
    local name=$1 line
    shift
    echo "# bench/$name raw output"
    echo "$(date -u +%Y-%m-%dT%H:%MZ) host: $(nproc) CPUs $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(uname -r), $(qemu-system-x86_64 --version | head -n 1)"
    for line in "$@"; do echo "$line"; done
    echo "guest run: $((GUEST_T1 - GUEST_T0)) s; host load at start: $GUEST_LOAD0, at end: $(cut -d' ' -f1-3 /proc/loadavg)"
}

# guest_raw_log: the serial log's section of a raw file (GUEST_LOG), then
# the heading of the summary that follows it.
guest_raw_log() {
    echo
    echo "## guest serial log"
    cat "$GUEST_LOG"
    echo
    echo "## summary"
}
