#!/usr/bin/env python3
"""A hostile HTTP/2 client for the edge's memory bounds (tests/python/test_edge_bounds.py).

It opens CONNECTIONS connections to the server and, on each, STREAMS gRPC
calls to METHOD whose request message claims CLAIM bytes, sends as much of
each body as the server's HTTP/2 flow control allows (never more: a client
that overran the windows would only be cut off) but never the last byte,
and then stalls, holding everything open for HOLD seconds. With TOKEN it sends
"authorization: Bearer TOKEN", else no credentials at all.

    h2_flood.py HOST:PORT --connections 8 --streams 4 --claim 67108864 --hold 5

It prints one JSON line when the bodies have gone out as far as they can:
{"ready": true, "sent": BYTES, "rejected": STREAMS_ANSWERED_OR_RESET,
 "closed": CONNECTIONS_THE_SERVER_CLOSED}, then holds, then prints
{"done": true, "rejected": ..., "closed": ...} as they stand then, and exits.
Plain sockets and the standard library only: the point is to send what a
well-behaved gRPC client never would (a body that stops half-way).
"""

import argparse
import json
import select
import socket
import struct
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def hpack_int(value, prefix_bits, first=0):
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name, value):
    # Literal header field without indexing, new name, no Huffman coding.
    name, value = name.encode(), value.encode()
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


class Connection:
    def __init__(self, address, timeout):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.conn_window = 65535
        self.initial_window = 65535
        self.max_frame = 16384
        self.windows = {}
        self.done = set()  # streams the server answered or reset
        self.closed = False
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))

    def pump(self, wait):
        """Reads and handles what the server sent, waiting at most `wait` s."""
        if self.closed:
            return
        ready, _, _ = select.select([self.sock], [], [], wait)
        if not ready:
            return
        try:
            chunk = self.sock.recv(1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            self.closed = True
            return
        self.buf += chunk
        while len(self.buf) >= 9:
            length = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + length:
                break
            kind, flags = self.buf[3], self.buf[4]
            stream = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            payload = self.buf[9:9 + length]
            self.buf = self.buf[9 + length:]
            if kind == SETTINGS and not flags & ACK:
                for i in range(0, len(payload), 6):
                    ident, value = struct.unpack(">HI", payload[i:i + 6])
                    if ident == 4:  # INITIAL_WINDOW_SIZE
                        delta = value - self.initial_window
                        self.initial_window = value
                        for s in self.windows:
                            self.windows[s] += delta
                    elif ident == 5:  # MAX_FRAME_SIZE
                        self.max_frame = value
                self.sock.sendall(frame(SETTINGS, ACK, 0))
            elif kind == WINDOW_UPDATE:
                inc = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                if stream == 0:
                    self.conn_window += inc
                elif stream in self.windows:
                    self.windows[stream] += inc
            elif kind == PING and not flags & ACK:
                self.sock.sendall(frame(PING, ACK, 0, payload))
            elif kind == RST_STREAM or (kind == HEADERS and flags & END_STREAM):
                self.done.add(stream)
            elif kind == GOAWAY:
                self.closed = True

    def open(self, stream, path, authority, token):
        block = (literal(":method", "POST") + literal(":scheme", "http") + literal(":path", path) +
                 literal(":authority", authority) + literal("content-type", "application/grpc") +
                 literal("te", "trailers"))
        if token:
            block += literal("authorization", f"Bearer {token}")
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream, block))
        self.windows[stream] = self.initial_window

    def send_body(self, stream, remaining):
        """Sends what the windows allow of `remaining` body bytes; returns the bytes sent."""
        sent = 0
        while remaining > 0 and not self.closed and stream not in self.done:
            n = min(remaining, self.max_frame, self.conn_window, self.windows[stream])
            if n <= 0:
                break
            try:
                self.sock.sendall(frame(DATA, 0, stream, b"\x5a" * n))
            except OSError:
                self.closed = True
                break
            self.conn_window -= n
            self.windows[stream] -= n
            remaining -= n
            sent += n
        return sent


def main():
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--claim", type=int, default=64 << 20)
    p.add_argument("--method", default="Prefill")
    p.add_argument("--token", default="")
    p.add_argument("--hold", type=float, default=5.0)
    p.add_argument("--send_for", type=float, default=3.0,
                   help="seconds to keep sending while the windows grow")
    args = p.parse_args()
    # A method of the attention service, or a whole path ("/grpc.health.v1.Health/Check").
    path = args.method if args.method.startswith("/") else f"/attnserve.v1.AttentionService/{args.method}"
    conns = []
    for _ in range(args.connections):
        c = Connection(args.address, timeout=10)
        c.pump(0.05)
        conns.append(c)
    remaining = {}
    for c in conns:
        for i in range(args.streams):
            stream = 1 + 2 * i
            c.open(stream, path, args.address, args.token)
            # The gRPC message prefix: not compressed, CLAIM bytes follow.
            c.sock.sendall(frame(DATA, 0, stream, b"\x00" + struct.pack(">I", args.claim)))
            c.conn_window -= 5
            c.windows[stream] -= 5
            # One byte short: the message never completes.
            remaining[(id(c), stream)] = args.claim - 1
    sent = 0
    until = time.monotonic() + args.send_for
    while time.monotonic() < until:
        progress = 0
        for c in conns:
            c.pump(0)
            for stream in list(c.windows):
                key = (id(c), stream)
                n = c.send_body(stream, remaining[key])
                remaining[key] -= n
                progress += n
        sent += progress
        if progress == 0:
            for c in conns:
                c.pump(0.02)
    rejected = sum(len(c.done) for c in conns)
    closed = sum(c.closed for c in conns)
    print(json.dumps({"ready": True, "sent": sent, "rejected": rejected, "closed": closed}),
          flush=True)
    end = time.monotonic() + args.hold
    while time.monotonic() < end:
        for c in conns:
            c.pump(0.05)
    print(json.dumps({"done": True, "rejected": sum(len(c.done) for c in conns),
                      "closed": sum(c.closed for c in conns)}), flush=True)
    for c in conns:
        c.sock.close()


if __name__ == "__main__":
    sys.exit(main())
