"""gRPC unary calls over a plain blocking socket: HTTP/2 framed by hand, headers by `hpack`.

ops/bench/overload_bench.py's quiet callers use it to time a server's answers without a Python gRPC
client in the way. A grpc.aio client hands every completion from gRPC's polling thread to its
event loop, and on a loaded host that hop is a good part of a call's latency; a caller in C++, Go
or Java (as ranking systems usually are) has no such hop. This client has no threads and no
event loop: it writes the call's frames and reads the socket until the call's last frame, in the
calling thread. What it measures is the server's turnaround and the two kernels' (loopback)
delivery, with a few tens of microseconds of framing here.

One call at a time per connection (a stream is opened, answered and done before the next):

    c = H2Caller("127.0.0.1", 50051)
    r = c.call("/slmrank.v1.Ranker/Score", request.SerializeToString(), timeout_s=1.0)
    r.status, r.message, r.trailers, r.body, r.latency_s

What it implements of HTTP/2 (RFC 9113): the connection preface and SETTINGS (the peer's
INITIAL_WINDOW_SIZE and MAX_FRAME_SIZE honoured, each SETTINGS acknowledged), HEADERS with
CONTINUATION, padding and priority fields skipped, DATA with flow control both ways (it sends
only within the peer's windows and returns every byte it reads as a WINDOW_UPDATE at once),
PING answered, RST_STREAM and GOAWAY as errors. gRPC's framing: one length-prefixed message
each way, uncompressed; grpc-status / grpc-message (percent-decoded) from the trailers, or from
the headers of a trailers-only answer (how servers refuse).
"""

from __future__ import annotations

import math
import socket
import struct
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x4, 0x5
_FRAME = struct.Struct(">IBI")  # the 24-bit length and the type as one word, the flags, the stream
OUR_WINDOW = 1 << 24  # what we let the peer send before our WINDOW_UPDATEs (we return each byte at once)


class H2Error(ConnectionError):
    """The connection failed (GOAWAY, a reset stream, a closed socket, a protocol error)."""


@dataclass
class Answer:
    status: int  # grpc-status (0 OK, 14 UNAVAILABLE, 4 DEADLINE_EXCEEDED, ...)
    message: str
    trailers: dict[str, str] = field(default_factory=dict)  # the response's headers and trailers, less pseudo-headers
    body: bytes | None = None  # the response message (gRPC's length prefix removed); None if there was none
    latency_s: float = 0.0  # from just before the first byte is written to the call's last frame read in


def grpc_timeout(seconds: float) -> str:
    """The grpc-timeout header's value: at most 8 digits, in the finest unit that holds them."""
    for unit, scale in (("u", 1e6), ("m", 1e3), ("S", 1.0), ("M", 1 / 60), ("H", 1 / 3600)):
        value = math.ceil(max(seconds, 0.0) * scale)
        if value < 10 ** 8:
            return f"{max(value, 1)}{unit}"
    raise ValueError(f"a timeout of {seconds} s does not fit grpc-timeout")


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


class H2Caller:
    """One HTTP/2 connection (cleartext, prior knowledge, as grpc's insecure channels) to a gRPC server."""

    def __init__(self, host: str, port: int, connect_timeout_s: float = 5.0) -> None:
        self.authority = f"{host}:{port}"
        self.sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self.enc, self.dec = hpack.Encoder(), hpack.Decoder()
        self.buf = bytearray()
        self.next_stream = 1
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.conn_window = 65535  # what we may still send on the connection
        self.stream_windows: dict[int, int] = {}
        self.sock.sendall(PREFACE + _frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, OUR_WINDOW))
                          + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", OUR_WINDOW - 65535)))

    def close(self) -> None:
        try:
            self.sock.sendall(_frame(GOAWAY, 0, 0, struct.pack(">II", max(self.next_stream - 2, 0), 0)))
        except OSError:
            pass
        self.sock.close()

    def __enter__(self) -> H2Caller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call --

    def call(self, path: str, request: bytes, timeout_s: float | None = None,
             metadata: tuple[tuple[str, str], ...] = ()) -> Answer:
        """A unary call: `request` (a serialized message) to `path`; blocks until it is answered.
        timeout_s becomes the grpc-timeout header (the server's deadline; this client waits on)."""
        sid = self.next_stream
        self.next_stream += 2
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", self.authority),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        if timeout_s is not None:
            headers.append(("grpc-timeout", grpc_timeout(timeout_s)))
        headers += list(metadata)
        block = self.enc.encode(headers)
        if len(block) > self.peer_max_frame:
            raise ValueError(f"request headers of {len(block)} bytes: more than one frame holds")
        message = b"\x00" + struct.pack(">I", len(request)) + request
        self.stream_windows[sid] = self.peer_initial_window
        blocks: list[list[tuple[str, str]]] = []
        body = bytearray()
        ended = False

        def take(frame: tuple[int, bool, int, Any]) -> bool:
            stream, last, kind, payload = frame
            if stream != sid:
                return False
            if kind == DATA:
                body.extend(payload)
            elif kind == HEADERS:
                blocks.append(payload)
            return last

        t0 = time.perf_counter()
        out = bytearray(_frame(HEADERS, END_HEADERS, sid, block))
        at = 0
        while at < len(message) and not ended:  # DATA within the peer's windows
            room = min(self.conn_window, self.stream_windows[sid], self.peer_max_frame)
            if room <= 0:
                self.sock.sendall(out)
                out.clear()
                ended = take(self._read_frame(sid))  # a WINDOW_UPDATE in time (or the server's answer)
                continue
            chunk = message[at:at + room]
            at += len(chunk)
            self.conn_window -= len(chunk)
            self.stream_windows[sid] -= len(chunk)
            out += _frame(DATA, END_STREAM if at >= len(message) else 0, sid, chunk)
        if out:
            self.sock.sendall(out)
        while not ended:
            ended = take(self._read_frame(sid))
        latency = time.perf_counter() - t0
        self.stream_windows.pop(sid, None)
        fields: dict[str, str] = {}
        for block_fields in blocks:
            for k, v in block_fields:
                if not k.startswith(":"):
                    fields[k] = v
        if "grpc-status" not in fields:
            raise H2Error(f"stream {sid} ended without a grpc-status ({fields})")
        msg_body = None
        if len(body) >= 5:
            n = struct.unpack_from(">I", body, 1)[0]
            msg_body = bytes(body[5:5 + n])
        return Answer(int(fields["grpc-status"]), urllib.parse.unquote(fields.get("grpc-message", "")), fields,
                      msg_body, latency)

    # -- frames --

    def _recv(self, n: int) -> None:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise H2Error("the server closed the connection")
            self.buf += chunk

    def _read_frame(self, sid: int) -> tuple[int, bool, int, Any]:
        """Reads and handles one frame; returns (its stream, END_STREAM, its type, its payload:
        bytes for DATA, the decoded fields for HEADERS, None for the others)."""
        self._recv(9)
        length_type, flags, stream = _FRAME.unpack_from(self.buf, 0)
        length, kind = length_type >> 8, length_type & 0xFF
        stream &= 0x7FFFFFFF
        self._recv(9 + length)
        payload = bytes(self.buf[9:9 + length])
        del self.buf[:9 + length]
        if kind in (DATA, HEADERS) and flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        if kind == DATA:
            if length:  # every byte read is given back at once: the windows never close on the server
                self.sock.sendall(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", length))
                                  + (_frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", length))
                                     if not flags & END_STREAM else b""))
            return stream, bool(flags & END_STREAM), DATA, payload
        if kind == HEADERS:
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            while not flags & END_HEADERS:  # CONTINUATION frames follow, on the same stream
                self._recv(9)
                length_type, flags, _ = _FRAME.unpack_from(self.buf, 0)
                length = length_type >> 8
                self._recv(9 + length)
                payload += bytes(self.buf[9:9 + length])
                del self.buf[:9 + length]
            decoded = [(k if isinstance(k, str) else k.decode(), v if isinstance(v, str) else v.decode())
                       for k, v in self.dec.decode(payload)]
            return stream, bool(flags & END_STREAM), HEADERS, decoded
        if kind == SETTINGS:
            if not flags & ACK:
                for at in range(0, len(payload) - 5, 6):
                    ident, value = struct.unpack_from(">HI", payload, at)
                    if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                        delta = value - self.peer_initial_window
                        self.peer_initial_window = value
                        for s in self.stream_windows:
                            self.stream_windows[s] += delta
                    elif ident == SETTINGS_MAX_FRAME_SIZE:
                        self.peer_max_frame = value
                self.sock.sendall(_frame(SETTINGS, ACK, 0))
        elif kind == PING:
            if not flags & ACK:
                self.sock.sendall(_frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if stream == 0:
                self.conn_window += inc
            elif stream in self.stream_windows:
                self.stream_windows[stream] += inc
        elif kind == RST_STREAM:
            if stream == sid:
                raise H2Error(f"stream {sid} reset by the server (error code {struct.unpack('>I', payload)[0]})")
        elif kind == GOAWAY:
            last, code = struct.unpack_from(">II", payload)
            raise H2Error(f"GOAWAY from the server (error code {code}, last stream {last & 0x7FFFFFFF}): "
                          f"{payload[8:].decode(errors='replace')}")
        elif kind == PUSH_PROMISE:
            raise H2Error("PUSH_PROMISE: a gRPC server never pushes")
        return stream, False, kind, None
