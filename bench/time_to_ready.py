#!/usr/bin/env python3
"""Time to ready of `ustor serve` with the embedded default (1 GiB malloc
disk exported over NBD, NVMe/TCP and iSCSI): from exec until the RPC
socket answers `bdev_get_bdevs`, and the RSS at that moment.

    python3 bench/time_to_ready.py target/release/ustor [RUNS]

Prints each run and the median. Ports are 0 (any free port), reactors
unpinned, so it can run next to other work; a busy machine makes it slower.
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def ask(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "bdev_get_bdevs"}).encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return False
            data += chunk
            try:
                return "result" in json.loads(data)
            except ValueError:
                continue
    except OSError:
        return False
    finally:
        s.close()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def one(binary, d):
    sock = os.path.join(d, "rpc.sock")
    args = [binary, "serve", "--no-pin", "-r", sock,
            "--nbd-port", "0", "--nvmf-port", "0", "--iscsi-port", "0"]
    t0 = time.monotonic()
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (os.path.exists(sock) and ask(sock)):
            if p.poll() is not None:
                sys.exit(f"ustor serve exited with {p.returncode}")
            if time.monotonic() - t0 > 30:
                sys.exit("not ready after 30 s")
            time.sleep(0.001)
        ms = (time.monotonic() - t0) * 1000
        return ms, rss_kib(p.pid)
    finally:
        p.terminate()
        p.wait()


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/ustor"
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    times = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(runs):
            ms, rss = one(binary, d)
            times.append(ms)
            print(f"run {i + 1}: ready in {ms:.1f} ms, RSS {rss / 1024:.0f} MiB")
    print(f"median time to ready: {statistics.median(times):.1f} ms "
          f"(min {min(times):.1f}, max {max(times):.1f}) over {runs} runs")


if __name__ == "__main__":
    main()
