"""What tests that speak HTTP/1.1 by hand over a socket share (the fuzzers, the TLS
front's odd paths): reading a chunked body back."""

from __future__ import annotations


def dechunk(data: bytes) -> bytes:
    """The body of a `Transfer-Encoding: chunked` answer, its chunks joined."""
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out
