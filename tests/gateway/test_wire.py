"""Backend responses llhttp refuses never reach the gateway's own header reading: a bare-LF head or
an obsolete folded header line is a protocol error (502 to the client, never relayed)."""

from __future__ import annotations

import pytest

from gateway.wire import UpstreamParser, UpstreamProtocolError


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
    b"HTTP/1.1 200 OK\r\nX-A: 1\r\n  folded\r\nContent-Length: 0\r\n\r\n",
])
def test_heads_llhttp_refuses_are_protocol_errors(raw: bytes) -> None:
    with pytest.raises(UpstreamProtocolError):
        UpstreamParser().feed(raw)


def test_a_head_after_an_informational_one_is_read_from_its_own_lines() -> None:
    parser = UpstreamParser()
    parser.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nX-A:  spaced \r\nContent-")
    assert parser.head is None
    parser.feed(b"Length: 2\r\n\r\nok")
    assert parser.head is not None and parser.head.status == 201 and parser.head.reason == b"Created"
    assert (b"X-A", b"spaced") in parser.head.kept and parser.head.content_length == 2
    assert parser.take_body() == [b"ok"] and parser.complete
