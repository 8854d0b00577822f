"""The iSCSI PDUs on the loopback wire, for machines without tcpdump: an
AF_PACKET socket on `lo` (needs root) takes every TCP segment to or from
PORT for SECONDS and prints the first LINES segments (time, direction
c2t / t2c, payload bytes, the PDUs that ended in it), the login
negotiation's key=value text, and totals: segments per direction and PDUs
per direction and opcode. Assumes no header or data digests.

Usage: python3 bench/lib/pdusniff.py PORT SECONDS [LINES]
"""

import socket
import struct
import sys
import time

NAMES = {0x00: "NOP-Out", 0x01: "SCSI-Cmd", 0x03: "Login", 0x04: "Text", 0x05: "Data-Out",
         0x06: "Logout", 0x20: "NOP-In", 0x21: "SCSI-Rsp", 0x23: "LoginRsp", 0x24: "TextRsp",
         0x25: "Data-In", 0x26: "LogoutRsp", 0x31: "R2T"}


def pdus(buf, d, counts):
    """Complete PDUs at the front of `buf`: (names, the rest)."""
    out = []
    while len(buf) >= 48:
        op, ahs = buf[0] & 0x3F, buf[4] * 4
        dsl = int.from_bytes(buf[5:8], "big")
        total = 48 + ahs + dsl + (-dsl) % 4
        if len(buf) < total:
            break
        name = NAMES.get(op, hex(op))
        if op in (0x03, 0x23):
            text = buf[48 + ahs:48 + ahs + dsl].replace(b"\0", b" ")
            print(f"{d} {name}: {text.decode(errors='replace')}")
        out.append(f"{name}({dsl})")
        counts[(d, name)] = counts.get((d, name), 0) + 1
        buf = buf[total:]
    return out, buf


def main():
    port, secs = int(sys.argv[1]), float(sys.argv[2])
    lines = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))
    s.bind(("lo", 0))
    s.settimeout(0.2)
    t0, shown, segs, counts = time.time(), [], {"c2t": 0, "t2c": 0}, {}
    bufs = {"c2t": b"", "t2c": b""}
    while time.time() - t0 < secs:
        try:
            pkt, addr = s.recvfrom(70000)
        except socket.timeout:
            continue
        ip = pkt[14:]
        # Each loopback packet is seen leaving and arriving: count it once.
        if addr[2] == socket.PACKET_OUTGOING or len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        ihl = (ip[0] & 15) * 4
        tcp = ip[ihl:]
        sport, dport = struct.unpack("!HH", tcp[:4])
        end = struct.unpack("!H", ip[2:4])[0]
        payload = ip[ihl + (tcp[12] >> 4) * 4:end]
        if port not in (sport, dport) or not payload:
            continue
        d = "c2t" if dport == port else "t2c"
        segs[d] += 1
        names, bufs[d] = pdus(bufs[d] + payload, d, counts)
        if len(shown) < lines:
            shown.append(f"{time.time() - t0:9.6f} {d} segment {len(payload):6d} B: {' '.join(names)}")
    print("\n".join(shown))
    print("segments:", segs)
    print("PDUs:", {f"{d} {n}": c for (d, n), c in sorted(counts.items())})


if __name__ == "__main__":
    main()
