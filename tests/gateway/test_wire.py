"""Backend responses the gateway must not relay: what llhttp refuses (a bare-LF head, an obsolete
folded header line, ambiguous Content-Length framing), and the bounds and RFC 9110/9112 checks of
``gateway.wire.UpstreamParser`` on top of it. Each is a protocol error: 502 to the client, never relayed."""

from __future__ import annotations

import pytest

from gateway.relay import READ_CHUNK
from gateway.wire import (
    MAX_INTERIM_RESPONSES,
    MAX_RESPONSE_HEAD_BYTES,
    MAX_RESPONSE_HEADERS,
    UpstreamParser,
    UpstreamProtocolError,
)


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


# -- interim (1xx) heads: dropped once parsed, bounded in number and size ------------------------

PROCESSING = b"HTTP/1.1 102 Processing\r\n\r\n"
FINAL = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def reads(data: bytes, size: int = READ_CHUNK) -> list[bytes]:
    """``data`` as the relay's socket reads would deliver it."""
    return [data[i:i + size] for i in range(0, len(data), size)]


def refusal(parser: UpstreamParser, pieces: list[bytes]) -> tuple[str | None, int]:
    """Feed the pieces in order: the protocol error's reason (None if accepted) and the most bytes
    the parser held between two reads."""
    held = 0
    try:
        for piece in pieces:
            parser.feed(piece)
            held = max(held, parser.held)
    except UpstreamProtocolError as exc:
        return exc.reason, held
    return None, held


def test_a_flood_of_102_heads_is_refused_after_the_limit_and_never_held() -> None:
    # 4 MiB of "102 Processing": the old parser kept every byte and waited for a final head.
    parser = UpstreamParser()
    flood = PROCESSING * (4 * 1024 * 1024 // len(PROCESSING))
    fed = 0
    with pytest.raises(UpstreamProtocolError) as info:
        for piece in reads(flood):
            fed += len(piece)
            parser.feed(piece)
    assert info.value.reason == "too_many_interim" and fed == READ_CHUNK  # refused within the first read
    assert parser.held <= MAX_RESPONSE_HEAD_BYTES


@pytest.mark.parametrize("size", [1, 7, READ_CHUNK])
def test_interim_heads_exactly_at_the_limit_then_the_final_head(size: int) -> None:
    parser = UpstreamParser()
    assert refusal(parser, reads(PROCESSING * MAX_INTERIM_RESPONSES + FINAL, size))[0] is None
    assert parser.head is not None and parser.head.status == 200 and b"".join(parser.take_body()) == b"ok"
    assert parser.complete and parser.held == 0
    assert refusal(UpstreamParser(), reads(PROCESSING * (MAX_INTERIM_RESPONSES + 1) + FINAL, size))[0] == \
        "too_many_interim"


def test_the_interim_count_starts_again_for_the_next_response_on_the_connection() -> None:
    parser = UpstreamParser()
    parser.feed(PROCESSING * MAX_INTERIM_RESPONSES + FINAL)
    assert parser.complete
    parser.reset()
    parser.feed(PROCESSING * MAX_INTERIM_RESPONSES + FINAL)
    assert parser.complete and parser.head is not None and parser.head.status == 200


def padded_head(status_line: bytes, size: int) -> bytes:
    """A head of exactly ``size`` bytes, status line to blank line, padded with one header."""
    base = status_line + b"\r\nX-Pad: \r\n\r\n"
    return status_line + b"\r\nX-Pad: " + b"a" * (size - len(base)) + b"\r\n\r\n"


@pytest.mark.parametrize("status_line", [b"HTTP/1.1 103 Early Hints", b"HTTP/1.1 200 OK"])
@pytest.mark.parametrize("size", [READ_CHUNK // 2, READ_CHUNK])
def test_each_head_is_bounded_exactly_at_the_limit(status_line: bytes, size: int) -> None:
    def response(head_size: int) -> bytes:
        head = padded_head(status_line, head_size)
        interim = status_line.startswith(b"HTTP/1.1 1")
        return head * MAX_INTERIM_RESPONSES + FINAL if interim else head[:-2] + b"Content-Length: 0\r\n\r\n"

    # The final head's Content-Length line is part of its size: padded a little less.
    exact = MAX_RESPONSE_HEAD_BYTES - (0 if status_line.startswith(b"HTTP/1.1 1") else len(b"Content-Length: 0\r\n"))
    parser = UpstreamParser()
    reason, held = refusal(parser, reads(response(exact), size))
    assert reason is None and parser.head is not None and parser.complete
    assert held <= MAX_RESPONSE_HEAD_BYTES  # never more than one head, however many interim ones came
    assert refusal(UpstreamParser(), reads(response(exact + 1), size))[0] == "head_too_large"


def test_an_incomplete_head_past_the_limit_is_refused_without_waiting_for_its_end() -> None:
    parser = UpstreamParser()
    parser.feed(PROCESSING + b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(UpstreamProtocolError) as info:
        for _ in range(MAX_RESPONSE_HEAD_BYTES // 1024 + 1):
            parser.feed(b"X-A: " + b"a" * 1017 + b"\r\n")  # 1 KiB lines, never a blank line
    assert info.value.reason == "head_too_large"


def test_too_many_header_lines_in_an_interim_head() -> None:
    lines = b"".join(b"Link: <x%d>\r\n" % i for i in range(MAX_RESPONSE_HEADERS + 1))
    with pytest.raises(UpstreamProtocolError) as info:
        UpstreamParser().feed(b"HTTP/1.1 103 Early Hints\r\n" + lines + b"\r\n" + FINAL)
    assert info.value.reason == "head_too_large"


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n" + FINAL,
    PROCESSING + b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
])
def test_101_is_refused(raw: bytes) -> None:
    with pytest.raises(UpstreamProtocolError) as info:
        UpstreamParser().feed(raw)
    assert info.value.reason == "switching_protocols"


# -- statuses and framing (RFC 9110 §15, RFC 9112 §6) ---------------------------------------------

@pytest.mark.parametrize("status", [b"600", b"999", b"099", b"000", b"20", b"2000"])
def test_a_status_outside_100_to_599_is_refused(status: bytes) -> None:
    with pytest.raises(UpstreamProtocolError) as info:
        UpstreamParser().feed(b"HTTP/1.1 " + status + b" X\r\nContent-Length: 2\r\n\r\nok")
    assert info.value.reason == "invalid_status"


@pytest.mark.parametrize("status", [100, 199, 200, 599])
def test_statuses_at_the_edges_are_accepted(status: int) -> None:
    parser = UpstreamParser()
    parser.feed(b"HTTP/1.1 %d X\r\n\r\n" % status + (FINAL if status < 200 else b""))
    assert parser.head is not None and parser.head.status == (200 if status < 200 else status)


CHUNKED_BODY = b"2\r\nok\r\n0\r\n\r\n"


@pytest.mark.parametrize("codings", [
    [b"gzip, chunked"], [b"chunked, chunked"], [b"identity"], [b"chunked, gzip"], [b"x-unknown"],
    [b"chunked;q=1"], [b"gzip", b"chunked"], [b"chunked", b"chunked"], [b"deflate, chunked"],
    [b"chunked ,"],  # llhttp frames this one as read-until-close: never relayed as chunked
])
def test_a_transfer_coding_other_than_chunked_alone_is_refused(codings: list[bytes]) -> None:
    lines = b"".join(b"Transfer-Encoding: " + c + b"\r\n" for c in codings)
    with pytest.raises(UpstreamProtocolError) as info:
        UpstreamParser().feed(b"HTTP/1.1 200 OK\r\n" + lines + b"\r\n" + CHUNKED_BODY)
    assert info.value.reason == "transfer_coding"


def test_transfer_encoding_in_http_10_is_refused() -> None:
    with pytest.raises(UpstreamProtocolError) as info:
        UpstreamParser().feed(b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED_BODY)
    assert info.value.reason == "transfer_coding"


@pytest.mark.parametrize("coding", [b"chunked", b"CHUNKED", b" , chunked", b",chunked"])
def test_chunked_alone_is_accepted(coding: bytes) -> None:
    parser = UpstreamParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + coding + b"\r\n\r\n" + CHUNKED_BODY)
    assert parser.head is not None and parser.head.chunked and parser.head.content_length is None
    assert parser.take_body() == [b"ok"] and parser.complete


@pytest.mark.parametrize("framing", [
    b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n",  # both (RFC 9112 §6.3: an error here)
    b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n",
    b"Transfer-Encoding: identity\r\nContent-Length: 2\r\n",
    b"Content-Length: 2\r\nContent-Length: 2\r\n",  # duplicates, equal or not
    b"Content-Length: 2\r\nContent-Length: 3\r\n",
    b"Content-Length: 2, 2\r\n",
    b"Content-Length: -2\r\n",
    b"Content-Length: +2\r\n",
    b"Content-Length: \r\n",
    b"Content-Length: 99999999999999999999999\r\n",
    b"Transfer-Encoding: \r\n",
])
def test_framing_llhttp_refuses_is_a_protocol_error(framing: bytes) -> None:
    # The gateway relies on llhttp for these (no second check of its own): this pins that it does.
    with pytest.raises(UpstreamProtocolError) as info:
        UpstreamParser().feed(b"HTTP/1.1 200 OK\r\n" + framing + b"\r\n" + CHUNKED_BODY)
    assert info.value.reason == "malformed"


@pytest.mark.parametrize("split", [False, True])
def test_bytes_after_the_end_of_the_response_are_dropped_and_the_connection_not_reused(split: bool) -> None:
    # A second response nobody asked for, in the same read as the first one's end: neither its head
    # nor its body may be taken for the first one's (RFC 9112 §6.3).
    extra = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Injected: 1\r\n\r\nEVIL!"
    parser = UpstreamParser()
    if split:  # the head alone first, then the end of the body with the extra bytes
        parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
        parser.feed(b"ok" + extra)
    else:
        parser.feed(FINAL + extra)
    head = parser.head
    assert head is not None and head.content_length == 2 and head.kept == [] and not head.keep_alive
    assert b"".join(parser.take_body()) == b"ok" and parser.complete
