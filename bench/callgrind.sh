#!/usr/bin/env bash
# Instructions per I/O of `ustor bench` (issue 26), counted by valgrind's
# callgrind: repeatable where wall-clock IOPS on a shared VM are not, and
# this VM has no PMU for perf.
#
# Two runs of the same workload, SHORT and LONG seconds, under callgrind;
# (Ir_long - Ir_short) / (ios_long - ios_short) cancels start-up and
# teardown and leaves the instructions of one I/O in the steady loop:
# submit -> complete through the generic bdev layer, latency timed per I/O,
# the bench's own bookkeeping. io_uring works under valgrind here, so the
# run is the same as bench/spdk.sh part a's (poll mode, one core).
#
# Only instructions inside the polls of spawned tasks are counted
# (--toggle-collect=TOGGLE): the bench's I/O loop, the bdev layer and the
# completions of inline drivers (null, malloc), not the executor's queueing
# between tasks (a yield every 32 I/Os) nor the reactor's idle loop. A
# poll-mode reactor with nothing to run spins, and under valgrind (one
# thread at a time) how long is arbitrary: counted, it made the per-I/O
# figure swing from 760 to 6000 between runs; so did the executor's time-
# proportional work. For a driver that completes through io_uring
# (uring:PATH) set TOGGLE= to count everything.
#
# Usage: [BDEV=null:1G] [RW=randread] [QD=128] [BS=4096] [SHORT=1] [LONG=3]
#        [USTOR=target/release/ustor] [NOBUILD=1] [TOP=25] bench/callgrind.sh
# Prints instructions per I/O and the top functions (inclusive of nothing:
# self cost) of the long run, per I/O.
set -euo pipefail
BDEV=${BDEV:-null:1G}
RW=${RW:-randread}
QD=${QD:-128}
BS=${BS:-4096}
SHORT=${SHORT:-1}
LONG=${LONG:-3}
TOP=${TOP:-25}
TOGGLE=${TOGGLE-ustor_runtime::executor::spawn::{{closure\}\}}
cd "$(dirname "$0")/.."
root=$(pwd)
command -v valgrind >/dev/null || { echo "callgrind.sh: needs valgrind" >&2; exit 2; }
[ -n "${NOBUILD:-}" ] || cargo build --release -q -p ustor
USTOR=${USTOR:-$root/target/release/ustor}
tmp=$(mktemp -d /tmp/ustor-callgrind.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
run() { # SECONDS -> prints "Ir ios"
    valgrind --tool=callgrind ${TOGGLE:+--toggle-collect="$TOGGLE"} --callgrind-out-file="$tmp/cg.$1" "$USTOR" bench -b "$BDEV" \
        --cores 0 --poll-mode poll -w "$RW" --bs "$BS" -q "$QD" -t "$1" --json \
        >"$tmp/out.$1" 2>"$tmp/err.$1"
    local ir ios
    ir=$(sed -n 's/^==[0-9]*== Collected : //p' "$tmp/err.$1")
    ios=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["total"]["ios"])' "$tmp/out.$1")
    echo "$ir $ios"
}
read -r ir1 io1 < <(run "$SHORT")
read -r ir2 io2 < <(run "$LONG")
echo "# ustor $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo '+dirty'); valgrind $(valgrind --version)"
echo "# cmd: BDEV=$BDEV RW=$RW QD=$QD BS=$BS SHORT=$SHORT LONG=$LONG TOGGLE='$TOGGLE' bench/callgrind.sh"
echo "short: Ir=$ir1 ios=$io1   long: Ir=$ir2 ios=$io2"
python3 -c "import sys; a,b,c,d=map(int,sys.argv[1:]); print('instructions per I/O: %.1f' % ((c-a)/(d-b)))" "$ir1" "$io1" "$ir2" "$io2"
echo "# top functions of the long run (self Ir / its I/O count, start-up included):"
callgrind_annotate --inclusive=no "$tmp/cg.$LONG" 2>/dev/null | awk '/^-+$/{n++} n>=3' | grep -E '^ *[0-9,]+ ' | head -"$TOP" >"$tmp/top" || true # head closes the pipe early
python3 - "$io2" "$tmp/top" <<'EOF'
import re, sys
ios = int(sys.argv[1])
for l in open(sys.argv[2]):
    ir, rest = l.split(None, 1)
    ir = int(ir.replace(",", ""))
    # "(pct) /dir/file.rs:function [object]" -> "(pct) file.rs:function":
    # directories and objects are local to the machine that built it.
    m = re.match(r"(\([^)]*\))\s+(.*)$", rest.strip())
    if m:
        f = re.sub(r" \[[^]]*\]$", "", m.group(2))
        f = re.sub(r"^[^:]*/", "", f)
        rest = "%s  %s" % (m.group(1), f)
    print("%8.1f  %s" % (ir / ios, rest[:150]))
EOF
