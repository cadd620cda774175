"""Work a request body brings that is not body (issue 38, rows 1 and 3): chunk framing, chunk
extensions, trailers. Each is bounded by work, not by body bytes: a trailer field or extension that
never ends is a 431 after MAX_BODY_FRAMING_BYTES; a body as tiny chunks is one parsed piece per read
(not one object per chunk) and counts its framing as wire bytes against the upload bounds."""

from __future__ import annotations

import select
import socket
from collections.abc import Callable

import pytest

from gateway.wire import MAX_BODY_FRAMING_BYTES, BadRequest, ClientParser
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.harness import ThreadedGateway

pytestmark = pytest.mark.timeout(60)

HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def answer_to(port: int, data: bytes, endless: bytes, *, until: int = 4 * 1024 * 1024) -> tuple[bytes, int]:
    """Send ``data`` then ``endless`` over and over (never the line end the parser waits for), a
    piece at a time, until the gateway answers or ``until`` bytes went; its answer and the bytes sent."""
    sent = 0
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        while sent < until and not select.select([sock], [], [], 0.02)[0]:
            try:
                sock.sendall(endless)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(endless)
        sock.settimeout(5)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return received, sent


@pytest.mark.parametrize(("what", "start", "endless"), [
    ("a trailer field that never ends", b"1\r\n{\r\n0\r\nX-T: ", b"a" * 4096),
    ("a chunk extension that never ends", b"1;ext=", b"a" * 4096),
    ("trailer lines without end", b"1\r\n{\r\n0\r\n", b"X-Trailer: 1\r\n" * 256),
])
def test_endless_framing_is_a_431_after_a_bounded_amount(make_gateway: Callable[..., ThreadedGateway],
                                                         backend: FakeBackend, what: str, start: bytes,
                                                         endless: bytes) -> None:
    backend.start()
    gw = make_gateway(backend)
    answer, sent = answer_to(gw.port, HEAD + start, endless)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"Connection: close" in answer, (what, answer[:200])
    assert sent < 64 * 1024, (what, sent)  # answered within the bound and a read or so of sending
    assert not backend.requests_to("/v1/chat/completions")


@pytest.mark.parametrize(("start", "endless"), [
    (b"1\r\n{\r\n0\r\nX-T: ", b"a" * 1024), (b"1;ext=", b"a" * 1024), (b"1\r\n{\r\n0\r\n", b"X: 1\r\n" * 128)])
def test_the_parser_refuses_framing_after_its_bound_whatever_the_reads(start: bytes, endless: bytes) -> None:
    parser = ClientParser()
    parser.feed(HEAD + start)
    fed = 0
    with pytest.raises(BadRequest) as refused:
        while fed < 10 * MAX_BODY_FRAMING_BYTES:
            parser.feed(endless)
            fed += len(endless)
    assert refused.value.status == 431 and fed <= MAX_BODY_FRAMING_BYTES + len(endless)


def test_tiny_chunks_are_one_piece_per_read() -> None:
    parser = ClientParser()
    body = b"x" * 65536
    wire = b"".join(b"2\r\n" + body[i:i + 2] + b"\r\n" for i in range(0, len(body), 2))
    parser.feed(HEAD)
    assert parser.events.popleft()[0] == "head"
    for i in range(0, len(wire), 65536):
        parser.feed(wire[i:i + 65536])
    parser.feed(b"0\r\n\r\n")
    events = list(parser.events)
    assert [kind for kind, _ in events].count("end") == 1
    pieces = [piece for kind, piece in events if kind == "body"]
    assert b"".join(pieces) == body and len(pieces) <= len(wire) // 65536 + 1


def test_framing_below_the_bound_is_fine() -> None:
    parser = ClientParser()
    parser.feed(HEAD + b"1;" + b"e" * (MAX_BODY_FRAMING_BYTES // 2) + b"\r\n{\r\n0\r\nX-Sum: 1\r\n\r\n")
    assert [kind for kind, _ in parser.events] == ["head", "body", "end"]


def test_framing_counts_against_the_upload_bounds(make_gateway: Callable[..., ThreadedGateway],
                                                  backend: FakeBackend) -> None:
    """A 1 MiB body as 2-byte chunks is 3.5 MiB on the wire: with 2 MiB per address it is refused."""
    backend.start()
    gw = make_gateway(backend, max_body_bytes=1024 * 1024, max_upload_bytes_per_address=2 * 1024 * 1024,
                      max_held_body_bytes=64 * 1024 * 1024)
    body = b'{"model":"m","messages":[],"pad":"' + b"x" * (1024 * 1024 - 64) + b'"}'
    wire = b"".join(b"2\r\n" + body[i:i + 2] + b"\r\n" for i in range(0, len(body) - len(body) % 2, 2))
    answer, _ = answer_to(gw.port, HEAD + wire, b"", until=0)
    assert b" 429 " in answer.split(b"\r\n", 1)[0] and b"upload_bytes_per_address" in answer, answer[:300]
