"""Validate a JSON request body and pull out the few facts the gateway needs, in bounded memory and
in bounded steps, so that one body cannot hold the gateway's only loop.

``json.loads`` builds the whole document: 8 MiB of ``[[],[],...]`` becomes ~200 MiB of lists (an
OOM kill in a small container) and 100,000 nested ``[`` raise RecursionError. This module never
builds the document. :func:`inspect_json_body`, the gateway's check:

- UTF-8 is decoded 64 KiB at a time (surrogatepass, like ``json.loads``; msgspec does not check the
  strings it skips);
- the grammar: msgspec (C, linear) decodes the body into a Struct of two ``msgspec.Raw`` fields,
  ``model`` and ``stream``: every other field is skipped without being built, the last of duplicate
  keys wins and escaped keys count by their text (as in ``json.loads``); the facts come from the
  two raw slices. One C call, ~1-3 ns a byte on any shape;
- depth: msgspec has no limit of its own (past Python's recursion limit it raises RecursionError).
  When the body has more ``[``/``{`` than max_depth (``bytes.count``), a depth scan finds the first
  opener too deep, 4 KiB at a time in C loops (strings removed by ``re.sub``, brackets as +1/-1 by
  ``translate``, the running maximum by ``itertools.accumulate``): ~15-30 ns a byte on dense
  brackets. msgspec then sees only the body before that opener (at most max_depth + 1 levels), so
  an error to its left is still the one reported, and "truncated" there means too deep;
- escaped lone surrogates (``"\\ud800"``), which msgspec refuses and ``json.loads`` accepts: msgspec
  checks a copy in which they are escapes of other characters (same length, same offsets).

``pause`` runs whenever the checks have used SLICE_SECONDS (2 ms) of the thread's CPU time since the
last one (gateway.slices: by time, not by bytes, since a byte's cost depends on the body's shape:
bracketed strings cost ~10x what plain text does), and before the msgspec call, which is the longest
block: ~2 ns a byte on dense brackets, ~15-20 ms for 8 MiB (``python -m bench.jsonscan_bench``,
docs/benchmarks.md). Memory: ~130 KiB whatever the body (a copy of it for lone surrogates).

:class:`JSONScanner`, the stepped pure-Python scanner that did the whole check before msgspec, is
kept for the bench (the figures it replaced) and its tests; the gateway does not use it (it costs
up to ~1 µs a byte on dense branched items, 8 s of CPU for 8 MiB). Its design: one pass, left to right, by a
small state machine whose tokens are compiled expressions run by ``re`` in C, each on at most a
slice of the body (``endpos``): runs of items (values nested at most _ATOM_LEVELS deep, or chains of
openers, one such value and closers) and runs of openers or closers, each handled by Python at once
on a stack of closer bytes; step() scans about STEP_BYTES or STEP_EVENTS runs and returns.

Deliberate differences from ``json.loads`` (``tests/gateway/test_jsonscan.py`` pins them):

- RFC 8259 only: ``NaN``/``Infinity``/``-Infinity`` are refused; so are a byte-order mark and
  UTF-16/UTF-32 bodies (``json.loads`` sniffs those encodings); the body must be UTF-8.
- Integers of more than 4,300 digits are accepted (``json.loads`` refuses them to bound
  ``int()``'s cost; they are valid JSON and are never converted here).
- The top level must be an object (OpenAI request bodies are).
- Like ``json.loads``: the last of duplicate keys wins; escaped keys count by their decoded text
  (``"str\\u0065am"`` is ``"stream"``); escaped lone surrogates (``"\\ud800"``) and UTF-8-encoded
  surrogates are accepted (``json.loads`` decodes bytes with ``surrogatepass``).
- The first error from the left is the one reported, except that a run of openers going deeper than
  the limit is a depth error even where a key follows a ``[`` (``{"a":["a":[...``), as before, and
  that invalid UTF-8 anywhere is reported before a grammar or depth error.
- Reasons name a byte offset at most (msgspec's messages are reduced to theirs).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from json.decoder import scanstring

import msgspec

from gateway.slices import Slice

__all__ = ["BodyFacts", "InvalidJSON", "JSONScanner", "inspect_json_body", "DEFAULT_MAX_DEPTH",
           "DEFAULT_MAX_MODEL_CHARS", "STEP_BYTES"]

DEFAULT_MAX_DEPTH = 128
DEFAULT_MAX_MODEL_CHARS = 256
_MAX_SUPPORTED_DEPTH = 512

STEP_BYTES = 256 * 1024  # the bytes one step() scans before the caller may yield to its loop
STEP_EVENTS = 2000  # ... or the handler calls one step() makes (a few ms at most)
_SLICE = 64 * 1024  # how far one bounded run of items may look ahead (endpos): bounds each C call


class InvalidJSON(ValueError):
    """The body is not one JSON object within the limits. ``reason`` is short and safe to send back
    to the client: it names a byte offset at most, never body content. ``kind`` is one of
    "empty", "not_object", "utf8", "syntax", "depth", "trailing"."""

    def __init__(self, reason: str, kind: str = "syntax") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


@dataclass(frozen=True, slots=True)
class BodyFacts:
    stream: bool  # the top-level "stream" is JSON true (the last one, if the key repeats)
    model: str | None  # the top-level "model" when it is a string of at most max_model_chars
    has_model: bool  # a top-level "model" key exists, whatever its value


# -- tokens, as bytes patterns (str here, encoded when compiled) ----------------------------------
# (bench.jsonscan_regex_baseline builds its expression from these tokens too.)

_WS = r"[ \t\n\r]*+"
_STRING = r'"[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*+)*+"'
_NUMBER = r"-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][-+]?+[0-9]++)?+"
_SCALAR = rf"(?:{_STRING}|{_NUMBER}|true|false|null)"
_END = r"(?![\]}])"  # after a comma: another item must follow


def _escaped_name(name: str) -> str:
    """A JSON string literal that decodes to ``name``, however its characters are escaped."""
    parts = []
    for char in name:
        code = f"{ord(char):04x}"
        hex_digits = "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in code)
        parts.append(f"(?:{re.escape(char)}|\\\\u{hex_digits})")
    return '"' + "".join(parts) + '"'


# A top-level key; the groups ``s``/``m`` mark where a "stream"/"model" value starts.
_TOP_KEY = (rf"(?>{_escaped_name('stream')}{_WS}:{_WS}(?P<s>)|{_escaped_name('model')}{_WS}:{_WS}(?P<m>)"
            rf"|{_STRING}{_WS}:{_WS})")


def _c(pattern: str) -> re.Pattern[bytes]:
    return re.compile(pattern.encode("ascii"))


_ATOM_LEVELS = 4  # a value nested this deep at most is one token (the pattern doubles per level)


def _atom(levels: int) -> str:
    """A value whose containers nest at most ``levels`` deep, matched whole by the C engine: its
    arrays and objects are separate alternatives per level, so no group records a bracket's kind."""
    value = _SCALAR
    for _ in range(levels):
        array = rf"\[{_WS}(?:{value}{_WS}(?:,{_WS}{_END}|(?=\])))*+\]"
        obj = rf"\{{{_WS}(?:{_STRING}{_WS}:{_WS}{value}{_WS}(?:,{_WS}(?=\")|(?=\}})))*+\}}"
        value = rf"(?>{_SCALAR}|{array}|{obj})"
    return value


class _ByRoom:
    """A pattern with ATOM as a value nested at most ``room`` deep (capped at _ATOM_LEVELS): room is
    what the depth limit leaves below the current container. Compiled on first use."""

    def __init__(self, template: str) -> None:
        self._template = template
        self._compiled: list[re.Pattern[bytes] | None] = [None] * (_ATOM_LEVELS + 1)

    def __getitem__(self, room: int) -> re.Pattern[bytes]:
        levels = max(0, min(room, _ATOM_LEVELS))  # room is -1 for a chain's value at the limit
        compiled = self._compiled[levels]
        if compiled is None:
            compiled = self._compiled[levels] = _c(self._template.replace("ATOM", _atom(levels)))
        return compiled


# Runs: as many items as fit before endpos, each with the comma after it (so the next one must exist).
_ITEMS = _ByRoom(rf"(?:ATOM{_WS},{_WS})*+")
_PAIRS = _ByRoom(rf"(?:{_STRING}{_WS}:{_WS}ATOM{_WS},{_WS})*+")
_TOP_PAIRS = _ByRoom(rf"(?:{_TOP_KEY}ATOM{_WS},{_WS})*+")
# The byte after a value must be seen, within endpos: else "1" would pass for a "12" cut at endpos.
_VALUE = _ByRoom(rf"ATOM{_WS}(?=[,\]}}])")
# An item that is a chain: openers ('{' with its key), one value nested at most ATOM levels deep,
# closers, a comma. The expression cannot tell that the closers match the openers; Python checks each
# item with a few C calls (``[[[[[1]]]]],...`` took four handler calls an item before: 440 ns a byte).
# (Fewest openers first: the largest value that fits, else "[[[[[1],[1]]]]]" splits as "[[[[[1]" ",".)
_CHAIN = (rf"(?P<o>(?:\[{_WS}|\{{{_WS}{_STRING}{_WS}:{_WS}){{1,16}}?)(?P<a>ATOM){_WS}"
          rf"(?P<c>(?:[\]}}]{_WS}){{1,16}}+),{_WS}")
_CHAINS = (_ByRoom(_CHAIN), _ByRoom(rf"{_STRING}{_WS}:{_WS}{_CHAIN}"), _ByRoom(_TOP_KEY + _CHAIN))  # array, object, top
_SCALAR_WS = _c(rf"{_SCALAR}{_WS}")  # unbounded: a scalar longer than a slice, one C loop
_KEY = _c(rf"{_STRING}{_WS}:{_WS}")
_TOP_KEY_RE = _c(_TOP_KEY)
# Openers in a row ('{' with its first key), and closers in a row: Python handles each run at once.
_OPENERS = _c(rf"(?:\[{_WS}|\{{{_WS}{_STRING}{_WS}:{_WS})*+(?:\{{{_WS})?+")
# Looser, as a depth error is told from a syntax error: a key after '[' too (``{"a":["a":[...``
# 100,000 deep is a depth error, as it was when a looser grammar diagnosed a failed match).
_LOOSE_OPENERS = _c(rf"(?:[\[{{]{_WS}(?:{_STRING}{_WS}:{_WS})?+)*+")
_ONE_OPENER = _c(rf"[\[{{]{_WS}(?:{_STRING}{_WS}:{_WS})?+")
_CLOSERS = _c(rf"[\]}}](?:{_WS}[\]}}])*+{_WS}")
_WS_RE = _c(_WS)
_STRING_RE = _c(_STRING)
_NOT_WS = re.compile(rb"[^ \t\n\r]")
_UTF8_PIECE = 64 * 1024
_OPEN_TO_CLOSE = bytes.maketrans(b"[{", b"]}")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_WS_BYTES = frozenset(b" \t\n\r")
_ARRAY, _OBJECT = 0x5D, 0x7D  # a stack entry: the closer its container expects
# Parser states: what may come next.
_VALUE_NEXT, _VALUE_OR_CLOSE, _KEY_NEXT, _KEY_OR_CLOSE, _AFTER_VALUE, _DONE = range(6)

Body = bytes | bytearray | memoryview


def _closers_of(openers: bytes) -> bytes:
    """The closers a run of openers expects, outermost first: the run without its keys and
    whitespace, translated."""
    return _STRING_RE.sub(b"", openers).translate(_OPEN_TO_CLOSE, b" \t\n\r:")


def _depth(value: bytes) -> int:
    """How deep a well-formed value of at most _ATOM_LEVELS levels nests (0: a scalar)."""
    brackets = _STRING_RE.sub(b"", value).translate(None, _NOT_BRACKETS)
    levels = 0
    while brackets:
        brackets = brackets.replace(b"[]", b"").replace(b"{}", b"")
        levels += 1
    return levels


def _syntax() -> InvalidJSON:
    return InvalidJSON("body is not valid JSON")


def _opening(body: Body, max_depth: int) -> tuple[Body, int]:
    """The checks every entry point makes first: ``max_depth`` within bounds, a memoryview as bytes,
    a body that is not empty and opens an object. The body (cast) and the offset of its ``{``."""
    if not 1 <= max_depth <= _MAX_SUPPORTED_DEPTH:
        raise ValueError(f"max_depth must be 1..{_MAX_SUPPORTED_DEPTH}")
    if isinstance(body, memoryview) and (body.format != "B" or body.ndim != 1):
        body = body.cast("B")
    first = _NOT_WS.search(body)
    if first is None:
        raise InvalidJSON("empty body", "empty")
    # '{': msgspec would skip a BOM-less array too, and say why in its words
    if body[first.start()] != 0x7B:
        raise InvalidJSON("body must be a JSON object", "not_object")
    return body, first.start()


class JSONScanner:
    """One pass over ``body`` in steps of about STEP_BYTES: ``while not scanner.step(): <yield>``,
    then ``scanner.facts()``. step() raises InvalidJSON. Holds the body (callers have it whole), a
    stack of at most max_depth bytes and an incremental UTF-8 decoder; nothing else grows."""

    def __init__(self, body: Body, *, max_depth: int = DEFAULT_MAX_DEPTH,
                 max_model_chars: int = DEFAULT_MAX_MODEL_CHARS) -> None:
        body, first = _opening(body, max_depth)
        self._body, self._n = body, len(body)
        self._max_depth, self._max_model_chars = max_depth, max_model_chars
        self._stack = bytearray()  # the closer each open container expects, innermost last
        self._state = _KEY_OR_CLOSE
        self._stream_at = self._model_at = -1
        self._utf8 = codecs.getincrementaldecoder("utf-8")("surrogatepass")
        self._checked = 0  # UTF-8 is checked up to here
        self._handlers: tuple[Callable[[int], tuple[int, int]], ...] = (
            lambda p: self._value(p, False), lambda p: self._value(p, True),
            lambda p: self._key(p, False), lambda p: self._key(p, True), self._after_value)
        self._stack.append(_OBJECT)  # the top-level object, open
        self._pos = _WS_RE.match(body, first + 1).end()

    def step(self) -> bool:
        """Scan about STEP_BYTES more; True once the whole body is checked."""
        n = self._n
        self._check_utf8(min(n, self._checked + STEP_BYTES))
        p, state, handlers = self._pos, self._state, self._handlers
        limit, events = p + STEP_BYTES, STEP_EVENTS
        # Every handler consumes bytes or raises. A step ends after STEP_BYTES or STEP_EVENTS
        # handler calls, whichever comes first: the bytes bound long runs, the count bounds bodies
        # dense in small nested items (~1 µs of Python each).
        while state != _DONE and p < limit and events:
            p, state = handlers[state](p)
            events -= 1
        self._pos, self._state = p, state
        if state != _DONE:
            return False
        self._check_utf8(n, final=True)
        end = _WS_RE.match(self._body, p).end()
        if end != n:
            raise InvalidJSON(f"unexpected data after the JSON object at byte {end}", "trailing")
        return True

    def facts(self) -> BodyFacts:
        """The top-level facts, once step() returned True."""
        if self._state != _DONE:
            raise RuntimeError("the body is not scanned yet")
        body, stream_at, model_at = self._body, self._stream_at, self._model_at
        stream = stream_at >= 0 and body[stream_at] == 0x74  # 't': the only value starting so is true
        model = None
        if model_at >= 0 and body[model_at] == 0x22:  # '"'
            model = _short_string(body, model_at, self._max_model_chars)
        return BodyFacts(stream=stream, model=model, has_model=model_at >= 0)

    def _check_utf8(self, end: int, final: bool = False) -> None:
        start, self._checked = self._checked, max(end, self._checked)
        view = memoryview(self._body)
        try:
            # In pieces: the decoded text (up to 4 bytes a character) is never large. Decoding ASCII
            # runs at memory speed; searching for a non-ASCII byte with ``re`` was 8x slower.
            for offset in range(start, end, _UTF8_PIECE):
                self._utf8.decode(view[offset:min(end, offset + _UTF8_PIECE)], False)
            if final:
                self._utf8.decode(b"", True)
        except UnicodeDecodeError:
            raise InvalidJSON("body is not valid UTF-8", "utf8") from None

    # -- handlers: each takes the position of the next token, returns where it ends and the state

    def _skip_ws(self, p: int) -> int:
        # A run may stop inside whitespace (its endpos); whitespace can be long: one C loop.
        if p < self._n and self._body[p] in _WS_BYTES:
            return _WS_RE.match(self._body, p).end()
        return p

    def _byte(self, p: int) -> int:
        return self._body[p] if p < self._n else -1

    def _value(self, p: int, may_close: bool) -> tuple[int, int]:
        body, stack = self._body, self._stack
        p = self._skip_ws(p)
        room = self._max_depth - len(stack)
        if stack[-1] == _ARRAY:
            q, ended = self._items(p, room, 0)
            if ended:
                return q, _AFTER_VALUE
            if q > p:
                p, may_close = q, False
        token = _VALUE[room].match(body, p, p + _SLICE)
        if token is not None:
            return token.end(), _AFTER_VALUE
        c = self._byte(p)
        if c in (0x5B, 0x7B):  # '[', '{'
            return self._open(p)
        if may_close and c in (_ARRAY, _OBJECT):
            return self._close(p)
        token = _SCALAR_WS.match(body, p)  # a scalar longer than a slice
        if token is None:
            raise _syntax()
        return token.end(), _AFTER_VALUE

    def _key(self, p: int, may_close: bool) -> tuple[int, int]:
        body = self._body
        p = self._skip_ws(p)
        top = len(self._stack) == 1
        q, ended = self._items(p, self._max_depth - len(self._stack), 2 if top else 1)
        if ended:
            return q, _AFTER_VALUE
        if q > p:
            p, may_close = q, False
        key = (_TOP_KEY_RE if top else _KEY).match(body, p)
        if key is not None:
            self._note(key, top)
            return key.end(), _VALUE_NEXT
        if may_close and self._byte(p) in (_ARRAY, _OBJECT):
            return self._close(p)
        raise _syntax()

    def _items(self, p: int, room: int, kind: int) -> tuple[int, bool]:
        """Items (kind 0: of an array; 1: pairs of an object; 2: of the top-level object), each
        followed by its comma, for about a slice: runs of small values and of chains, in turn.
        True with the position after a value when the last chain's closers go on to close
        enclosing containers (the handlers check those)."""
        body, top, end = self._body, kind == 2, p + _SLICE
        # A chain holds at least one container more than its value: that value gets room - 1 levels.
        run, chain = (_ITEMS, _PAIRS, _TOP_PAIRS)[kind][room], _CHAINS[kind][room - 1]
        while p < end:
            items = run.match(body, p, end)
            self._note(items, top)
            q, ended = self._chains(chain, self._skip_ws(items.end()), end, room, top)
            if ended:
                return q, True
            if q == p:
                break
            p = self._skip_ws(q)
        return p, False

    def _chains(self, chain: re.Pattern[bytes], p: int, end: int, room: int, top: bool) -> tuple[int, bool]:
        """Chain items while they are well formed; the handlers decide about any other."""
        body = self._body
        while (item := chain.match(body, p, end)) is not None:
            openers = item.group("o")
            if 0x22 in openers:  # '"': keys
                openers = _STRING_RE.sub(b"", openers)
            expected = openers.translate(_OPEN_TO_CLOSE, b" \t\n\r:")[::-1]
            closers = item.group("c").translate(None, b" \t\n\r")
            if closers[:len(expected)] != expected:
                break  # a wrong closer
            if len(expected) + max(0, min(room - 1, _ATOM_LEVELS)) > room and len(expected) + _depth(item.group("a")) > room:
                break  # too deep: the handlers say where
            self._note(item, top)
            if len(closers) > len(expected):  # the value ends inside the run of closers
                return self._nth_closer(item.start("c"), len(expected) - 1) + 1, True
            p = item.end()
        return p, False

    def _note(self, match: re.Match[bytes], top: bool) -> None:
        """The last top-level "stream" and "model" values of a run (later runs come later)."""
        if top:
            stream_at, model_at = match.start("s"), match.start("m")
            if stream_at >= 0:
                self._stream_at = stream_at
            if model_at >= 0:
                self._model_at = model_at

    def _after_value(self, p: int) -> tuple[int, int]:
        p = self._skip_ws(p)
        c = self._byte(p)
        if c == 0x2C:  # ','
            return p + 1, _VALUE_NEXT if self._stack[-1] == _ARRAY else _KEY_NEXT
        if c in (_ARRAY, _OBJECT):
            return self._close(p)
        raise _syntax()

    def _open(self, p: int) -> tuple[int, int]:
        """Openers in a row, pushed at once: the closers they expect are the run without its keys
        and whitespace, translated (C calls on at most a slice)."""
        run = _OPENERS.match(self._body, p, p + _SLICE)
        q = run.end()
        if q == p:  # '{' then whitespace or a key longer than a slice
            q = _ONE_OPENER.match(self._body, p).end()
        text = bytes(self._body[p:q])
        closers = _closers_of(text)
        room = self._max_depth - len(self._stack)
        last = text.rstrip(b" \t\n\r")[-1:]
        if len(closers) > room or (last == b"[" and self._byte(q) == 0x22 and self._loose_too_deep(p, room)):
            raise InvalidJSON(f"JSON nested deeper than {self._max_depth} levels at byte {self._nth_opener(p, room)}",
                              "depth")
        self._stack += closers
        if last == b"[":
            return q, _VALUE_OR_CLOSE
        return q, _KEY_OR_CLOSE if last == b"{" else _VALUE_NEXT

    def _loose_too_deep(self, p: int, room: int) -> bool:
        loose = _LOOSE_OPENERS.match(self._body, p, p + _SLICE).end()
        return len(_closers_of(bytes(self._body[p:loose]))) > room

    def _nth_opener(self, p: int, index: int) -> int:
        for _ in range(index):
            p = _ONE_OPENER.match(self._body, p).end()
        return p

    def _close(self, p: int) -> tuple[int, int]:
        """Closers in a row, checked against the stack at once."""
        q = _CLOSERS.match(self._body, p, p + _SLICE).end()
        closers = bytes(self._body[p:q]).translate(None, b" \t\n\r")
        stack = self._stack
        depth = len(stack)
        count = min(len(closers), depth)
        if stack[depth - count:][::-1] != closers[:count]:
            raise _syntax()
        del stack[depth - count:]
        if stack:
            if q < self._n and self._body[q] == 0x2C:  # the comma after, in the same call
                return q + 1, _VALUE_NEXT if stack[-1] == _ARRAY else _KEY_NEXT
            return q, _AFTER_VALUE
        if count < len(closers):  # the top-level object is closed, and more closers follow
            raise InvalidJSON(f"unexpected data after the JSON object at byte {self._nth_closer(p, count)}", "trailing")
        return q, _DONE

    def _nth_closer(self, p: int, index: int) -> int:
        for _ in range(index):
            p = _WS_RE.match(self._body, p + 1).end()
        return p


def inspect_json_body(body: Body, *, max_depth: int = DEFAULT_MAX_DEPTH,
                      max_model_chars: int = DEFAULT_MAX_MODEL_CHARS,
                      pause: Callable[[], object] | None = None) -> BodyFacts:
    """Check that ``body`` is one JSON object (RFC 8259, UTF-8) nested at most ``max_depth`` deep
    (the top-level object is depth 1), and return its top-level facts. Raises InvalidJSON.
    ``pause`` (a yield to the loop that serves other clients) is called whenever the UTF-8 and depth
    checks have used a slice of CPU time (gateway.slices), and before the grammar check, one C call
    (msgspec, ~1-3 ns a byte)."""
    body, _ = _opening(body, max_depth)
    before_c_call = _before_c_call(pause, len(body))
    if pause is not None:
        pause = Slice(yielder=pause).check  # by CPU time: what a step costs depends on the body
    _check_utf8(body, pause)  # msgspec does not check UTF-8 in the strings it skips
    end = len(body)
    # Deeper than max_depth needs more openers than that: counting them is a C loop at memory speed.
    if _openers(body) > max_depth:
        deep_at, _ = _depth_scan(body, end, max_depth, pause)
        end = end if deep_at < 0 else deep_at
    before_c_call()
    try:
        return _facts_of(_decode(body, body, end, max_depth, pause), max_model_chars)
    except InvalidJSON:
        if _ESCAPED_SURROGATE.search(body) is None:
            raise
    # msgspec refuses escaped lone surrogates ("\\ud800"), json.loads accepts them: msgspec checks a
    # copy where they are escapes of other characters (same length, same offsets; C loops).
    lower = _without_surrogates(body, b"0", b"1", pause)
    before_c_call()
    parsed = _decode(lower, body, end, max_depth, pause)
    model = parsed.model
    raw = memoryview(b"") if model is msgspec.UNSET else memoryview(model)
    if len(raw) <= 12 * max_model_chars + 2 and b"\\" in bytes(raw):  # longer is never a short string
        # The model's own text: where a second copy differs, the body had d or D.
        other_copy = _without_surrogates(body, b"2", b"3", pause)
        before_c_call()
        other = _decode(other_copy, body, end, max_depth, pause).model
        restored = bytes(a if a == b else (0x64 if a == 0x30 else 0x44)
                         for a, b in zip(raw, memoryview(other), strict=True))
        parsed = _Facts(model=msgspec.Raw(restored), stream=parsed.stream)
    return _facts_of(parsed, max_model_chars)


def _before_c_call(pause: Callable[[], object] | None, size: int) -> Callable[[], object]:
    """What runs before each msgspec call: a yield for a large body (the call is a block of its own,
    ~1-3 ns a byte, whatever the current slice has left), nothing for a small one."""
    if pause is None or size <= STEP_BYTES:
        return lambda: None
    return pause


def _decode(body: Body, original: Body, end: int, max_depth: int, pause: Callable[[], object] | None) -> _Facts:
    """msgspec on ``body[:end]``, its errors as ours."""
    try:
        # Only up to the first opener too deep: msgspec then recurses at most max_depth + 1 levels
        # (it has no depth limit of its own), and an error to the left of it is still the one reported.
        parsed = _DECODER.decode(memoryview(body)[:end])
    except msgspec.DecodeError as exc:
        if end < len(body) and str(exc) == _TRUNCATED:
            raise _too_deep(max_depth, end) from None
        raise _from_msgspec(exc, original, max_depth, pause) from None
    except RecursionError:  # not expected (msgspec sees at most max_depth + 1 levels); never escape
        raise InvalidJSON(f"JSON nested deeper than {max_depth} levels", "depth") from None
    if end < len(body):  # cannot happen: a prefix cut at an inner opener leaves the top level open
        raise _too_deep(max_depth, end)
    return parsed


def _without_surrogates(body: Body, lower: bytes, upper: bytes, pause: Callable[[], object] | None) -> bytearray:
    r"""The body with ``\ud8..``-``\udf..`` escapes as ``\u{lower}8..`` (``\uD`` as ``upper``), a
    4 KiB piece at a time (re.sub keeps a piece per match until it joins them). A piece never ends
    within the 3 bytes after a backslash, so no escape is cut."""
    out, p, n = bytearray(), 0, len(body)
    while p < n:
        cut = min(n, p + max(_DEPTH_CHUNK, 8))  # > 3: a piece always moves on
        if cut < n:
            back = bytes(body[cut - 3:cut]).rfind(b"\\")
            cut = cut - 3 + back if back >= 0 else cut
        piece = _SURROGATE_LOWER.sub(b"\\\\u" + lower, bytes(body[p:cut]))
        out += _SURROGATE_UPPER.sub(b"\\\\u" + upper, piece)
        if pause is not None:
            pause()  # a slice's check: then msgspec's call, on the copy
        p = cut
    return out  # msgspec reads any buffer: no second copy


def _too_deep(max_depth: int, at: int) -> InvalidJSON:
    return InvalidJSON(f"JSON nested deeper than {max_depth} levels at byte {at}", "depth")


class _Facts(msgspec.Struct):
    """What msgspec keeps of a body: the raw bytes of the last top-level "model" and "stream" values
    (last wins, keys compared by their decoded text, like json.loads); other fields are skipped
    without building anything. UNSET tells an absent key from a null."""

    model: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    stream: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_DECODER = msgspec.json.Decoder(_Facts)
_TRUNCATED = "Input data was truncated"
_BYTE_OFFSET = re.compile(r"\(byte (\d+)\)")
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_LOWER = re.compile(rb"\\ud(?=[89a-fA-F])")
_SURROGATE_UPPER = re.compile(rb"\\uD(?=[89a-fA-F])")
_STRING_ANY = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)  # a string whose escapes msgspec checked
# Complete strings and other bytes up to endpos: a cut that is never inside a string.
_UP_TO_A_CUT_STRING = re.compile(rb'(?:[^"]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.S)
_UP_TO_A_BRACKETED_STRING = re.compile(rb'(?:[^"]++|"[^"\\\[\]{}]*+(?:\\.[^"\\\[\]{}]*+)*+")*+', re.S)
_STRUCTURE = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|[\[\]{}]', re.S)
# re.sub keeps a piece per string until it joins them (~200 bytes each): small chunks bound that.
_DEPTH_CHUNK = 4096
_DEPTH_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


def _openers(body: Body) -> int:
    if not isinstance(body, memoryview):
        return body.count(b"[") + body.count(b"{")
    pieces = (bytes(body[at:at + _UTF8_PIECE]) for at in range(0, len(body), _UTF8_PIECE))  # no copy of it all
    return sum(piece.count(b"[") + piece.count(b"{") for piece in pieces)


def _depth_scan(body: Body, end: int, max_depth: int, pause: Callable[[], object] | None) -> tuple[int, int]:
    """The offset of the first opener before ``end`` deeper than max_depth (-1: none), and the depth
    at ``end``. A chunk at a time (at most STEP_BYTES, cut outside strings): strings removed
    (re.sub), brackets kept as +1/-1 (translate), the maximum of their running sum
    (itertools.accumulate over small ints: nothing allocated) - all C loops. Exact wherever the body
    is valid JSON so far; past an error it may be wrong, but msgspec reports that error, which comes
    first."""
    p, depth = 0, 0
    while p < end:
        if pause is not None:
            pause()  # a slice's check: a chunk costs 0.01-0.5 ms, by how many strings it holds
        limit = min(end, p + _DEPTH_CHUNK)
        # Strings without brackets can stay (translate drops them); re.sub (a piece per string) only
        # from the first string with a bracket in it.
        plain = _UP_TO_A_BRACKETED_STRING.match(body, p, limit).end()
        cut = _UP_TO_A_CUT_STRING.match(body, plain, limit).end()
        if cut == p:  # a string longer than a chunk (one C call), or a malformed one: msgspec says
            string = _STRING_ANY.match(body, p, end)
            if string is None:
                return -1, depth
            p = string.end()
            continue
        chunk = bytes(body[p:plain])
        if cut > plain:
            chunk += _STRING_ANY.sub(b"", bytes(body[plain:cut]))
        steps = chunk.translate(_DEPTH_STEPS, _NOT_BRACKETS)  # deletes first, then maps
        if steps and max(accumulate(memoryview(steps).cast("b"), initial=depth)) > max_depth:
            return _nth_deep_opener(body, p, depth, max_depth), depth
        depth += steps.count(1) - steps.count(255)
        p = cut
    return -1, depth


def _nth_deep_opener(body: Body, p: int, depth: int, max_depth: int) -> int:
    """Where, from ``p`` at ``depth``, the first opener deeper than max_depth is (once per body)."""
    for token in _STRUCTURE.finditer(body, p):
        c = body[token.start()]
        if c in (0x5B, 0x7B):
            depth += 1
            if depth > max_depth:
                return token.start()
        elif c in (0x5D, 0x7D):
            depth -= 1
    return len(body)


def _loose_too_deep(body: Body, at: int, max_depth: int, pause: Callable[[], object] | None) -> int:
    """For a syntax error at ``at``: the opener too deep (else -1) when the error is in a run of
    openers that a key follows after a '[' too (``{"a":["a":[...``): such a run deeper than the
    limit has always been a depth error (the stepped scanner's rule, kept)."""
    window = max(0, at - _SLICE)
    last = bytes(body[window:at]).rfind(b"[")
    if last < 0:
        return -1
    start = window + last
    run, run_end = _loose_run(body, start, at, max_depth)
    if run_end <= at:  # the error is not inside the run
        return -1
    if run < max_depth:  # the run alone is not too deep: the depth before it decides
        _, depth = _depth_scan(body, start, max_depth, pause)
    else:
        depth = 1  # the top-level object at least: no need to scan
    if depth + run <= max_depth:
        return -1
    p = start
    for _ in range(max_depth - depth):
        p = _ONE_OPENER.match(body, p).end()
    return p


def _loose_run(body: Body, start: int, at: int, max_depth: int) -> tuple[int, int]:
    """How many openers the loose run from ``start`` has (counted up to max_depth + 1: past that the
    answer is the same) and where it ends (once past ``at``, it need not be followed further).
    One match of the whole run was one C call as long as the body (~0.4 s for 8 MiB of
    ``["a":``): the run is followed an opener at a time, at most the openers up to ``at`` (within a
    slice of it) and max_depth + 1."""
    p, run = start, 0
    while run <= max_depth or p <= at:
        opener = _ONE_OPENER.match(body, p)
        if opener is None:
            break
        p, run = opener.end(), run + 1
    return run, p


def _check_utf8(body: Body, pause: Callable[[], object] | None) -> None:
    # In pieces: the decoded text is never large. Decoding ASCII runs at memory speed.
    # surrogatepass: like json.loads, which decodes bytes so.
    decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass")
    view = memoryview(body)
    try:
        for offset in range(0, len(body), _UTF8_PIECE):
            if pause is not None:
                pause()  # a slice's check (a piece is ~0.1 ms)
            decoder.decode(view[offset:offset + _UTF8_PIECE], False)
        decoder.decode(b"", True)
    except UnicodeDecodeError:
        raise InvalidJSON("body is not valid UTF-8", "utf8") from None


def _from_msgspec(exc: msgspec.DecodeError, body: Body, max_depth: int,
                  pause: Callable[[], object] | None) -> InvalidJSON:
    """msgspec's error as ours. Its messages say what was expected and a byte offset at most (no
    body content); we keep only the offset."""
    message = str(exc)
    found = _BYTE_OFFSET.search(message)
    if found is None:  # "Input data was truncated"
        return InvalidJSON("body is not valid JSON: it ends early")
    at = int(found.group(1))
    if "trailing characters" in message:
        return InvalidJSON(f"unexpected data after the JSON object at byte {at}", "trailing")
    deep_at = _loose_too_deep(body, at, max_depth, pause)
    if deep_at >= 0:
        return _too_deep(max_depth, deep_at)
    return InvalidJSON(f"body is not valid JSON at byte {at}")


def _facts_of(parsed: _Facts, max_model_chars: int) -> BodyFacts:
    stream, model = parsed.stream, parsed.model
    is_true = stream is not msgspec.UNSET and bytes(memoryview(stream)[:5]) == b"true"  # Raw has no whitespace
    text = None
    if model is not msgspec.UNSET:
        raw = memoryview(model)
        if raw[:1] == b'"':
            text = _short_string(raw, 0, max_model_chars)
    return BodyFacts(stream=is_true, model=text, has_model=model is not msgspec.UNSET)


def _short_string(body: Body, at: int, max_chars: int) -> str | None:
    # A character takes at most 12 bytes (an escaped surrogate pair): a string that doesn't end
    # within that many can't be short enough, and is neither scanned again nor copied out.
    token = _STRING_RE.match(body, at, at + 12 * max_chars + 2)
    if token is None:
        return None
    text = bytes(body[at:token.end()]).decode("utf-8", "surrogatepass")
    value, _ = scanstring(text, 1, True)
    return value if len(value) <= max_chars else None
