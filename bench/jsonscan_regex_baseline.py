"""The regular-expression body check gateway.jsonscan used before its one-pass scanner, kept only as
the baseline of ``python -m bench.jsonscan_bench``. Not imported by the gateway. Its design, as it was:

Validate a JSON request body and pull out the few facts the gateway needs, in bounded memory.

``json.loads`` builds the whole document: 8 MiB of ``[[],[],...]`` becomes ~200 MiB of lists (an
OOM kill in a small container) and 100,000 nested ``[`` raise RecursionError. This module never
builds the document. One compiled regular expression (``re`` runs in C, without recursion: its
backtracking state lives on a heap stack) checks the whole body against the RFC 8259 grammar with
a nesting limit, and remembers where the top-level ``"stream"`` and ``"model"`` values start.

How the expression works, because ``re`` has no recursion: the pattern is unrolled once per
nesting level (``max_depth`` levels). Arrays and objects share one pattern per level (two would
double the size per level); a capture group per level records whether the container holds keyed
items (``:``) or not (empty), and back-references to it check that every item and the closing
bracket agree with the opening one. Every repetition is possessive and every alternation atomic,
so a match never backtracks into what it has consumed: time is linear in the body and the
engine's stack is O(depth).

Memory: the engine's state plus, when the top-level ``"model"`` is a short string, that string.
UTF-8 is validated in fixed-size chunks. Peak allocation stays under ~0.5 MiB for any 8 MiB body.

CPU (``python -m bench.jsonscan_bench``): ~5 ns a byte inside strings, 40-60 ns a byte for dense
small values (8 MiB of ``[0,0,...]``: ~0.35 s; a 100 KiB chat body: ~0.5 ms). The costliest shape
is dense deep nesting: each container costs ~0.4 µs (the engine saves the per-level groups at every
repetition), so 8 MiB of 120-deep ``[[[...]]]`` takes ~1.6 s. Callers bound the body size.

Deliberate differences from ``json.loads``: the first four listed in gateway.jsonscan's docstring
(RFC 8259 and UTF-8 only, integers of any length, an object at the top level; duplicate and escaped
keys and lone surrogates as ``json.loads`` has them).
"""

from __future__ import annotations

import codecs
import functools
import re
import sys

# What the regex check shares with the gateway's scanner, taken from it rather than copied: the
# results and their errors, the defaults, the checks of a body's opening, the grammar's tokens (the
# same pattern text as before, so the same compiled expressions and the same speed), the escaped
# key names and the short "model" string.
from gateway.jsonscan import (
    _END,
    _SCALAR,
    _STRING,
    _WS,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_MODEL_CHARS,
    BodyFacts,
    InvalidJSON,
    _escaped_name,
    _opening,
    _short_string,
)

__all__ = ["BodyFacts", "InvalidJSON", "inspect_json_body", "DEFAULT_MAX_DEPTH", "DEFAULT_MAX_MODEL_CHARS"]

_UTF8_CHUNK = 64 * 1024

# -- the grammar, as bytes patterns (str here, encoded once when compiled) ----------------------

# Containers of scalars only, checked without the per-level group (cheaper: long arrays of small
# objects, the common shape of "messages", take this path).
# (Each item is scanned once: the separator that follows it is part of its iteration.)
_FLAT_ARRAY = rf"\[{_WS}(?:{_SCALAR}{_WS}(?:,{_WS}{_END}|(?=\])))*+\]"
_FLAT_OBJECT = rf"\{{{_WS}(?:{_STRING}{_WS}:{_WS}{_SCALAR}{_WS}(?:,{_WS}(?=\")|(?=\}})))*+\}}"

_KEY_STREAM = _escaped_name("stream")
_KEY_MODEL = _escaped_name("model")


def _value_pattern(depth: int) -> str:
    """One JSON value whose containers nest at most ``depth`` deep (0: scalars only)."""
    value = _SCALAR
    for level in range(1, depth + 1):
        keyed = f"k{level}"  # ':' when this level's container holds keyed items, '' when it doesn't
        is_array = f"(?=(?P={keyed}))"  # empty group: always true; ':' : only before a ':'
        is_object = f"(?!(?P={keyed}))"  # used only where the next byte is a bracket, never a ':'
        # A key, or none; then the group: ':' in an object (a key without its ':' fails, and
        # so does a ':' without its key), nothing in an array.
        item = (rf"(?>{_STRING}{_WS}(?=:)|(?!:))(?P={keyed}){_WS}{value}"
                rf"{_WS}(?:,{_WS}{_END}|(?=[\]}}]))")
        flat = rf"|{_FLAT_ARRAY}|{_FLAT_OBJECT}" if level > 1 else rf"|\[{_WS}\]|\{{{_WS}\}}"  # empty only
        value = (rf"(?>{_SCALAR}{flat}"
                 # the first item decides: keyed (object) or not (array)
                 rf"|(?=[\[{{]{_WS}(?>{_STRING}{_WS}(?=:)|)(?P<{keyed}>:?+))"
                 rf"(?:{is_array}\[|{is_object}\{{){_WS}(?:{item})*+"
                 rf"(?:{is_array}\]|{is_object}\}}))")
    return value


def _depth_probe_pattern(depth: int) -> str:
    """Looser grammar (any closer, keys optional) that stops, with the ``deep`` group set, at the
    first container nested deeper than ``depth``: tells a depth error from a syntax error after
    the exact pattern failed. One group only, so it stays cheap however deep the body goes."""
    value = rf"(?:{_SCALAR}|(?=[\[{{])(?P<deep>))"
    for _ in range(depth):
        # (?(1)...): "deep" is group 1, referred to by number (a name must be defined before use)
        item = (rf"(?(1)(?!)|(?:{_STRING}{_WS}:{_WS})?+{value}"
                rf"(?(1)|{_WS}(?:,{_WS}{_END}|(?=[\]}}]))))")
        value = rf"(?>{_SCALAR}|[\[{{]{_WS}(?:{item})*+(?(1)|[\]}}]))"
    return value


def _compile(pattern: str) -> re.Pattern[bytes]:
    # The parser of ``re`` recurses once per nested group: a few thousand frames at depth 128.
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 20 * 1000))
    try:
        return re.compile(pattern.encode("ascii"))
    finally:
        sys.setrecursionlimit(old)


@functools.lru_cache(maxsize=4)
def _body_pattern(max_depth: int) -> re.Pattern[bytes]:
    """The whole body: an object whose values nest at most max_depth - 1 deeper. The groups
    ``s``/``m`` mark where the last top-level "stream"/"model" value starts."""
    value = _value_pattern(max_depth - 1)
    key = (rf"(?>{_KEY_STREAM}{_WS}:{_WS}(?P<s>)|{_KEY_MODEL}{_WS}:{_WS}(?P<m>)"
           rf"|{_STRING}{_WS}:{_WS})")
    pair = rf"{key}{value}{_WS}(?:,{_WS}(?!\}})|(?=\}}))"
    return _compile(rf"{_WS}\{{{_WS}(?:{pair})*+\}}{_WS}")


@functools.lru_cache(maxsize=4)
def _probe_pattern(max_depth: int) -> re.Pattern[bytes]:
    return _compile(rf"{_WS}{_depth_probe_pattern(max_depth)}")


_NON_ASCII = re.compile(rb"[\x80-\xff]")

# Compiled on first use, not at import: an always-on gateway that never sees a cold JSON body
# never pays for it. The compiled expression costs about 90 KiB of memory per level of depth
# (5.7 MiB at 64, 11 MiB at 128) and about 2 ms per level to compile, once per process. So a body
# is matched first against a shallow expression (real request bodies, tool schemas included, nest
# far less): compiled in ~15 ms, it keeps a worker's first cold request from waiting ~110 ms for the
# full one. The full depth is compiled only for a body with more brackets than the shallow limit
# that the shallow expression refused: a deep body, or an invalid one.
_FIRST_DEPTH = 12


def _may_nest_deeper(body: bytes | bytearray | memoryview) -> bool:
    return isinstance(body, memoryview) or body.count(b"[") + body.count(b"{") > _FIRST_DEPTH


def _check_utf8(body: bytes | bytearray | memoryview) -> None:
    if not isinstance(body, memoryview) and body.isascii():
        return
    first = _NON_ASCII.search(body)
    if first is None:
        return
    # Chunked, so the decoded text never exists whole (a str can take 4 bytes per character).
    decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass")
    view = memoryview(body)
    start = first.start()
    try:
        for offset in range(start, len(view), _UTF8_CHUNK):
            decoder.decode(view[offset:offset + _UTF8_CHUNK], False)
        decoder.decode(b"", True)
    except UnicodeDecodeError:
        raise InvalidJSON("body is not valid UTF-8", "utf8") from None


def inspect_json_body(body: bytes | bytearray | memoryview, *, max_depth: int = DEFAULT_MAX_DEPTH,
                      max_model_chars: int = DEFAULT_MAX_MODEL_CHARS) -> BodyFacts:
    """Check that ``body`` is one JSON object (RFC 8259, UTF-8) nested at most ``max_depth`` deep
    (the top-level object is depth 1), and return its top-level facts. Raises InvalidJSON."""
    body, _ = _opening(body, max_depth)
    _check_utf8(body)
    match = _body_pattern(min(max_depth, _FIRST_DEPTH)).match(body)
    if (match is None or match.end() != len(body)) and max_depth > _FIRST_DEPTH and _may_nest_deeper(body):
        match = _body_pattern(max_depth).match(body)  # a body that needs the full depth (or is invalid)
    if match is None or match.end() != len(body):
        raise _diagnose(body, max_depth, match)
    stream_at, model_at = match.start("s"), match.start("m")
    stream = stream_at >= 0 and body[stream_at] == 0x74  # 't': the only value starting so is true
    model = None
    if model_at >= 0 and body[model_at] == 0x22:  # '"'
        model = _short_string(body, model_at, max_model_chars)
    return BodyFacts(stream=stream, model=model, has_model=model_at >= 0)


def _diagnose(body: bytes | bytearray | memoryview, max_depth: int, match: re.Match[bytes] | None) -> InvalidJSON:
    if match is not None:  # a whole object, then more
        return InvalidJSON(f"unexpected data after the JSON object at byte {match.end()}", "trailing")
    # Too few brackets to be too deep: a syntax error, without a second pass over the body.
    if not isinstance(body, memoryview) and body.count(b"[") + body.count(b"{") <= max_depth:
        return InvalidJSON("body is not valid JSON")
    probe = _probe_pattern(max_depth).match(body)
    if probe is not None and probe.start("deep") >= 0:
        return InvalidJSON(f"JSON nested deeper than {max_depth} levels at byte {probe.start('deep')}", "depth")
    return InvalidJSON("body is not valid JSON")
