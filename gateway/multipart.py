"""The ``model`` field of a ``multipart/form-data`` body (``/v1/audio/transcriptions`` and
``/v1/audio/translations``), for a shared gateway's routing.

One pass over the body the gateway already read (and bounded by ``maxBodyBytes``): each part's
headers are read (at most ``MAX_PART_HEADER_BYTES``), its content is only skipped with
``bytes.find`` for the next delimiter, so a file part is never copied nor decoded. The only value
copied is the ``model`` field's, at most ``max_value`` bytes. Lines may end with CRLF (RFC 2046) or
a bare LF (some hand-written clients); a delimiter may carry trailing spaces or tabs (RFC 2046
transport padding).

Refused (:class:`InvalidMultipart`): no usable boundary in the Content-Type, no opening delimiter,
a part without a blank line after its headers or without a closing delimiter, more than
``MAX_PARTS`` parts, a ``model`` field given twice (the backend would pick one, the gateway another). A ``model`` field longer than
``max_value`` is :class:`ModelFieldTooLong`: no table lists such a name, and it is not copied.

No pause inside: with at most ``MAX_PARTS`` parts the lookup is 64 bounded header searches and
``bytes.find`` calls (C, memory speed) over a body of at most 8 MiB, a few ms of CPU at worst
(64 parts full of near-delimiters: ~4 ms, tests/gateway/test_slices.py), within the loop's slice
bound; a yield per part would only add switches.
"""

from __future__ import annotations

import re

__all__ = ["InvalidMultipart", "ModelFieldTooLong", "MAX_PART_HEADER_BYTES", "is_multipart", "multipart_model"]

MAX_PART_HEADER_BYTES = 16 * 1024  # one part's header block; real clients send two short lines
# Parts of one body: an audio request has a file and a handful of fields (model, language, prompt,
# response_format, temperature, timestamp_granularities[]...). Each part costs a few scans whatever its
# size, so the count, not the body's bytes, bounds the work (9-byte parts were ~2 s of loop per 8 MiB).
MAX_PARTS = 64
# RFC 2046 boundary: 1..70 characters of bchars (the token form of the parameter allows fewer).
_BOUNDARY = re.compile(rb"""(?:^|;)\s*boundary\s*=\s*(?:"([0-9A-Za-z'()+_,\-./:=? ]{1,70})"|([0-9A-Za-z'()+_\-./:=?]{1,70}))(?:\s*(?:;|$))""",
                       re.IGNORECASE)
_FIELD_NAME = re.compile(rb"""(?:^|;)\s*name\s*=\s*(?:"([^"]*)"|([^\s;"]+))""", re.IGNORECASE)
_FILE_NAME = re.compile(rb"""(?:^|;)\s*filename\*?\s*=""", re.IGNORECASE)


class InvalidMultipart(ValueError):
    """The body is not multipart/form-data the gateway can read; the reason says where."""


class ModelFieldTooLong(ValueError):
    """The ``model`` field is longer than any model name a table can hold."""


def is_multipart(content_type: bytes | None) -> bool:
    return (content_type or b"").split(b";", 1)[0].strip().lower() == b"multipart/form-data"


def _boundary(content_type: bytes) -> bytes:
    params = content_type.split(b";", 1)[1] if b";" in content_type else b""
    found = _BOUNDARY.search(params)
    if found is None:
        raise InvalidMultipart("no boundary (1 to 70 characters) in the Content-Type")
    boundary = found.group(1) or found.group(2)
    if boundary.endswith(b" "):  # RFC 2046: a boundary never ends with a space
        raise InvalidMultipart("the boundary ends with a space")
    return boundary


def _line_end(data: bytes, at: int) -> int:
    """Where the line after a delimiter starts: padding, then CRLF or LF; else refused."""
    while at < len(data) and data[at] in b" \t":
        at += 1
    if data.startswith(b"\r\n", at):
        return at + 2
    if data.startswith(b"\n", at):
        return at + 1
    raise InvalidMultipart("a delimiter is not followed by a line end")


_BLANK_LINE = re.compile(rb"\r?\n\r?\n")


def _headers_end(data: bytes, start: int) -> tuple[int, int]:
    """(end of the part's header block, start of its content). Searched in place, within the bound
    (a slice of the window per part was a 16 KiB copy per part: most of a hostile body's cost)."""
    if data.startswith(b"\r\n", start) or data.startswith(b"\n", start):  # a part without headers
        return start, start + (2 if data[start] == 0x0D else 1)
    found = _BLANK_LINE.search(data, start, start + MAX_PART_HEADER_BYTES + 4)
    if found is None:
        raise InvalidMultipart(f"a part's headers do not end with a blank line within {MAX_PART_HEADER_BYTES} bytes")
    return found.start(), found.end()


def _field_name(headers: bytes) -> bytes | None:
    """The form field a part carries (None: a file part, or no name)."""
    for line in headers.split(b"\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() != b"content-disposition":
            continue
        kind, _, params = value.strip().partition(b";")
        if kind.strip().lower() != b"form-data" or _FILE_NAME.search(params):
            return None
        found = _FIELD_NAME.search(params)
        return None if found is None else (found.group(1) if found.group(1) is not None else found.group(2))
    return None


def multipart_model(content_type: bytes, body: bytes, max_value: int) -> str:
    """The ``model`` field's value, "" when the body has none."""
    boundary = _boundary(content_type)
    dash = b"--" + boundary
    at = 0 if body.startswith(dash) else body.find(b"\n" + dash) + 1  # after an optional preamble
    if at == 0 and not body.startswith(dash):
        raise InvalidMultipart("the body has no opening boundary delimiter")
    model: bytes | None = None
    for _ in range(MAX_PARTS + 1):
        at += len(dash)
        if body.startswith(b"--", at):  # the close delimiter; an epilogue after it is ignored
            return "" if model is None else _text(model)
        header_end, content = _headers_end(body, _line_end(body, at))
        nxt = body.find(b"\n" + dash, content)
        if nxt < 0:
            raise InvalidMultipart("a part is not closed by a boundary delimiter")
        if _field_name(body[at:header_end]) == b"model":
            if model is not None:
                raise InvalidMultipart("the model field is given twice")
            end = nxt - 1 if nxt > content and body[nxt - 1] == 0x0D else nxt
            if end - content > max_value:
                raise ModelFieldTooLong(f"the model field is longer than {max_value} bytes")
            model = body[content:end]
        at = nxt + 1
    raise InvalidMultipart(f"more than {MAX_PARTS} parts")


def _text(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidMultipart("the model field is not UTF-8") from None
