#!/usr/bin/env python3
"""One point of bench/nvmf.sh part 3: the target and the initiator as the
user runs them, in two processes.

`ustor serve` (target: malloc namespace, one reactor on core 0, the
transport's `coalesce` set to MODE) and `ustor bench` (initiator: the
`bdev_nvme_attach_controller` bdev with the same coalescing mode, one
reactor on core 1) over 127.0.0.1. Prints one raw line in nvmf.sh's
format with `part=procs`.

CPU per I/O: the bench reports its own (reactor time over the timed
phase); the target's is its process CPU time (utime + stime from
/proc/PID/stat) over the bench's whole life, attach and warm-up included,
so it slightly overstates. The target's sendmsg calls per I/O come from
`nvmf_get_stats` before and after.

usage: nvmf_procs.py USTOR_BIN MODE RW BS QD SECS POLL
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

NQN = "nqn.2026-11.io.ustor:bench"
CLK = os.sysconf("SC_CLK_TCK")


def cpu_ns(pid):
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) * 1_000_000_000 // CLK


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def coalesce(mode):
    if mode == "fixed":
        return {"mode": "fixed", "degree": 16, "timer_us": 50}
    return {"mode": mode}


def main():
    ustor, mode, rw, bs, qd, secs, poll = sys.argv[1:8]
    tmp = tempfile.mkdtemp(prefix="ustor-nvmf-procs-")
    sock = os.path.join(tmp, "rpc.sock")
    port = str(free_port())
    tcfg = {"subsystems": [
        {"subsystem": "bdev", "config": [
            {"method": "bdev_malloc_create",
             "params": {"name": "Malloc0", "num_blocks": 262144, "block_size": 512}}]},
        {"subsystem": "nvmf", "config": [
            {"method": "nvmf_create_transport",
             "params": {"trtype": "TCP", "coalesce": coalesce(mode)}},
            {"method": "nvmf_create_subsystem", "params": {"nqn": NQN, "allow_any_host": True}},
            {"method": "nvmf_subsystem_add_ns",
             "params": {"nqn": NQN, "namespace": {"bdev_name": "Malloc0"}}},
            {"method": "nvmf_subsystem_add_listener",
             "params": {"nqn": NQN, "listen_address": {
                 "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": port}}}]}]}
    icfg = {"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_nvme_attach_controller",
         "params": {"name": "Bench0", "trtype": "TCP", "traddr": "127.0.0.1",
                    "trsvcid": port, "subnqn": NQN, "io_queue_size": 128,
                    "coalesce": coalesce(mode)}}]}]}
    tpath = os.path.join(tmp, "tgt.json")
    ipath = os.path.join(tmp, "ini.json")
    json.dump(tcfg, open(tpath, "w"))
    json.dump(icfg, open(ipath, "w"))
    tlog = open(os.path.join(tmp, "tgt.log"), "w")
    tgt = subprocess.Popen([ustor, "serve", "-c", tpath, "-r", sock, "--cores", "0",
                            "--poll-mode", poll, "--log-level", "error"],
                           stdout=tlog, stderr=subprocess.STDOUT)
    line = f"part=procs mode={mode} poll={poll} rw={rw} bs={bs} queues=1 qd={qd} rate=0"
    try:
        def stats():
            r = subprocess.run([ustor, "rpc", "-s", sock, "nvmf_get_stats"],
                               capture_output=True, text=True, timeout=10)
            g = json.loads(r.stdout)["poll_groups"]
            return sum(x["sendmsg_calls"] for x in g)
        t0 = time.time()
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
                break
            except OSError:
                if time.time() - t0 > 10 or tgt.poll() is not None:
                    raise SystemExit(f"{line} FAILED target did not listen")
                time.sleep(0.05)
        tr = subprocess.run([ustor, "rpc", "-s", sock, "nvmf_get_transports"],
                            capture_output=True, text=True, timeout=10)
        got = json.loads(tr.stdout)[0].get("coalesce", {}).get("mode")
        if got != mode:
            raise SystemExit(f"{line} FAILED target coalesce mode {got!r}, wanted {mode!r}")
        s0, c0 = stats(), cpu_ns(tgt.pid)
        r = subprocess.run([ustor, "bench", "-c", ipath, "-b", "Bench0n1", "--cores", "1",
                            "--poll-mode", poll, "--json", "-w", rw, "--bs", bs, "-q", qd,
                            "-t", secs, "--log-level", "error"],
                           capture_output=True, text=True, timeout=int(secs) + 60)
        c1, s1 = cpu_ns(tgt.pid), stats()
        if r.returncode != 0:
            raise SystemExit(f"{line} FAILED bench: {r.stderr.strip()[-200:]}")
        b = json.loads(r.stdout)
        t = b["total"]
        n = max(t["ios"], 1)
        print(f"{line} iops={t['iops']:.0f} avg_lat_us={t['lat_avg_us']:.1f} "
              f"p50_lat_us={t['lat_p50_us']:.1f} p99_lat_us={t['lat_p99_us']:.1f} "
              f"tgt_sendmsg_per_io={(s1 - s0) / n:.3f} tgt_cpu_ns_per_io={(c1 - c0) / n:.0f} "
              f"ini_cpu_ns_per_io={b['cpu_ns_per_io']:.0f}")
    finally:
        tgt.kill()
        tgt.wait()
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)


if __name__ == "__main__":
    main()
