# only_run NAME ALL...: of the processes ${PID[ALL...]} (the caller's
# associative array PID), only PID[NAME] runs: SIGCONT to it, SIGSTOP to
# the others. A polling peer (SPDK, a poll-mode ustor) spins on the shared
# core even with no client, and left running it would take that core from
# the one being measured (an adaptive ustor then also judges its CPU
# contended and sleeps at once).
only_run() {
    local want=$1 n
    shift
    for n in "$@"; do
        if [ "$n" = "$want" ]; then kill -CONT "${PID[$n]}"; else kill -STOP "${PID[$n]}"; fi
    done
}
