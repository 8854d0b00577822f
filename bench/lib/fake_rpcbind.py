#!/usr/bin/env python3
"""A stand-in for rpcbind on a Unix socket, for bench/fs.sh's nfs-ganesha.

ganesha refuses to start unless it can register its programs with rpcbind
(ONC RPC program 100000), which it reaches on /run/rpcbind.sock. The bench
runs ganesha in a mount namespace of its own with a private /run, and this
script answers there: SET and UNSET succeed, GETPORT/GETADDR know nothing.
The client (libnfs) is told the NFS and MOUNT ports in its URL, so nothing
ever asks the real port mapper. Nothing outside that namespace sees it.

Usage: fake_rpcbind.py SOCKET_PATH
"""
import os
import socket
import struct
import sys
import threading


def reply(xid, proc):
    # REPLY, MSG_ACCEPTED, verifier AUTH_NONE (0, 0 bytes), SUCCESS.
    head = struct.pack(">IIIIII", xid, 1, 0, 0, 0, 0)
    if proc == 0:
        body = b""  # NULL
    elif proc in (1, 2):
        body = struct.pack(">I", 1)  # SET / UNSET: TRUE
    else:
        # GETPORT: port 0; GETADDR: the empty string; DUMP: an empty list.
        body = struct.pack(">I", 0)
    msg = head + body
    return struct.pack(">I", 0x80000000 | len(msg)) + msg


def recv_exact(c, n):
    b = b""
    while len(b) < n:
        chunk = c.recv(n - len(b))
        if not chunk:
            return None
        b += chunk
    return b


def serve(c):
    with c:
        while True:
            rec = b""
            while True:
                mark = recv_exact(c, 4)
                if mark is None:
                    return
                (m,) = struct.unpack(">I", mark)
                frag = recv_exact(c, m & 0x7FFFFFFF)
                if frag is None:
                    return
                rec += frag
                if m & 0x80000000:
                    break
            if len(rec) < 24:
                return
            xid, _mtype, _rpcvers, _prog, _vers, proc = struct.unpack(">IIIIII", rec[:24])
            c.sendall(reply(xid, proc))


def main():
    path = sys.argv[1]
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(16)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


if __name__ == "__main__":
    main()
