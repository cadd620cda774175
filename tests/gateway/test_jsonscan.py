"""gateway.jsonscan: agrees with json.loads on what it reports, refuses what RFC 8259 refuses, and
stays bounded in memory, depth and time on hostile bodies."""

from __future__ import annotations

import json
import time
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.jsonscan import STEP_BYTES, BodyFacts, InvalidJSON, JSONScanner, inspect_json_body

MIB = 1 << 20


def facts(body: bytes, **kwargs: Any) -> BodyFacts:
    return inspect_json_body(body, **kwargs)


def refused(body: bytes | bytearray | memoryview, kind: str | None = None, **kwargs: Any) -> InvalidJSON:
    with pytest.raises(InvalidJSON) as info:
        inspect_json_body(body, **kwargs)
    if kind is not None:
        assert info.value.kind == kind, info.value.reason
    return info.value


# -- facts --------------------------------------------------------------------------------------


def test_stream_is_true_only_for_a_top_level_json_true() -> None:
    assert facts(b'{"model":"m","stream":true}') == BodyFacts(stream=True, model="m", has_model=True)
    for body in (b'{"stream":false}', b'{"stream":"true"}', b'{"stream":1}', b'{"stream":null}',
                 b'{"stream":[true]}', b'{"stream":{"stream":true}}', b'{"a":{"stream":true}}',
                 b'{"messages":[{"stream":true}]}', b'{"streams":true}', b'{"Stream":true}', b"{}"):
        assert facts(body).stream is False, body


def test_duplicate_keys_last_one_wins_like_json_loads() -> None:
    for body in (b'{"stream":true,"stream":false}', b'{"stream":false,"stream":true}',
                 b'{"stream":true,"a":1,"stream":[]}', b'{"model":"a","model":"b"}', b'{"model":"a","model":1}'):
        doc = json.loads(body)
        got = facts(body)
        assert got.stream == (doc.get("stream") is True), body
        assert got.model == (doc["model"] if isinstance(doc.get("model"), str) else None), body


def test_escaped_keys_count_by_their_text() -> None:
    assert facts(b'{"str\\u0065am":true}').stream
    assert facts(b'{"\\u0073\\u0074\\u0072\\u0045\\u0061\\u006D":true}').stream is False  # "strEam"
    assert facts(b'{"\\u0073\\u0074\\u0072\\u0065\\u0061\\u006D":true}').stream  # upper-case hex digits too
    assert facts(b'{"mod\\u0065l":"x\\n\\u00e9\\ud83d\\ude00"}').model == "x\n\u00e9\U0001f600"


def test_model_is_a_bounded_string() -> None:
    assert facts(b'{"model":"' + b"x" * 256 + b'"}').model == "x" * 256
    long = facts(b'{"model":"' + b"x" * 257 + b'"}')
    assert long.model is None and long.has_model
    assert facts(b'{"model":"' + b"\\u0078" * 256 + b'"}').model == "x" * 256  # counted in characters
    assert facts(b'{"model":"' + b"x" * 8 * MIB + b'"}').model is None
    assert facts(b'{"model":"abc"}', max_model_chars=2).model is None
    for body in (b'{"model":1}', b'{"model":null}', b'{"model":["m"]}', b'{"model":{"id":"m"}}'):
        assert facts(body) == BodyFacts(stream=False, model=None, has_model=True), body
    assert facts(b'{"a":{"model":"m"}}') == BodyFacts(stream=False, model=None, has_model=False)


def test_whitespace_anywhere_json_allows_it() -> None:
    body = b' \t\r\n{ \n"stream"\t:\rtrue , "model" : "m" ,"a" : [ 1 , { } , [ ] , "x" ] } \n'
    assert facts(body) == BodyFacts(stream=True, model="m", has_model=True)
    refused(b'\x0c{"a":1}')  # form feed is not JSON whitespace
    refused(b'{"a":1}\xc2\xa0')  # nor is a no-break space


def test_bytearray_and_memoryview_bodies() -> None:
    body = b'xx{"stream":true,"model":"m"}'
    assert facts(bytearray(body[2:])).stream
    assert facts(memoryview(body)[2:]).model == "m"  # e.g. a view into a receive buffer
    refused(memoryview(b'{"a":"\xff"}'), "utf8")
    chains = b'{"a":[[[1]],[[2]],{"k":[3]},3],"b":{"c":[[1]],"d":1},"model":[["m"]],"stream":true}'
    for view in (bytearray(chains), memoryview(chains)):
        assert facts(view) == BodyFacts(stream=True, model=None, has_model=True)
    refused(memoryview(b'{"a":[[[1]}],1]}'))


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"", b" ", b"\r\n\t "])
def test_empty_body(body: bytes) -> None:
    refused(body, "empty")


@pytest.mark.parametrize("body", [b"[]", b'[{"stream":true}]', b'"x"', b"1", b"true", b"null", b" [1] ", b"x"])
def test_top_level_must_be_an_object(body: bytes) -> None:
    assert refused(body, "not_object").reason == "body must be a JSON object"


@pytest.mark.parametrize("body", [
    b"{", b'{"a"', b'{"a":', b'{"a":1', b'{"a":1,}', b'{,"a":1}', b'{"a" 1}', b'{"a":1 "b":2}', b"{1:2}",
    b'{"a":[1,]}', b'{"a":[,1]}', b'{"a":[1 2]}', b'{"a":[1}}', b'{"a":{"b":1]}', b'{"a":["b":1]}',
    b'{"a":{1}}', b'{"a":{"b"}}', b'{"a":01}', b'{"a":1.}', b'{"a":.5}', b'{"a":-}', b'{"a":+1}', b'{"a":1e}',
    b'{"a":0x1}', b'{"a":tru}', b'{"a":True}', b'{"a":nul}', b'{"a":"\\x"}', b'{"a":"\\u12"}', b'{"a":"\\u12g4"}',
    b'{"a":"tab\tin string"}', b'{"a":"nl\nin string"}', b'{"a":\'x\'}', b'{a:1}', b'{"a":1}}', b'{"a":"unterminated}',
    b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}',  # json.loads accepts these; RFC 8259 does not
    b'{:1}', b'{"a":{:1}}', b'{"a":{"b":1,:2}}', b'{"a":[:1]}', b'{"a":[1,:2]}',  # a ':' without its key
])
def test_syntax_errors(body: bytes) -> None:
    error = refused(body)
    assert error.kind in ("syntax", "trailing")


def test_trailing_data_is_refused() -> None:
    for body in (b'{"a":1} x', b'{"a":1}{}', b'{"a":1},', b'{"a":1}\x00'):
        assert refused(body, "trailing").reason.startswith("unexpected data after the JSON object")


def test_encoding_is_utf8_only() -> None:
    refused(b'{"a":"\xff"}', "utf8")
    refused(b'{"a":"\xc3"}', "utf8")  # truncated sequence
    refused(b'{"a":"\xc0\xaf"}', "utf8")  # overlong
    refused(b'\xef\xbb\xbf{"a":1}', "not_object")  # a byte-order mark (json.loads of bytes strips it)
    refused('{"a":1}'.encode("utf-16"), "not_object")  # json.loads of bytes sniffs UTF-16
    assert facts('{"model":"caf\u00e9 \U0001f600"}'.encode()).model == "caf\u00e9 \U0001f600"
    # Like json.loads (which decodes bytes with surrogatepass): lone surrogates, escaped or encoded
    assert facts(b'{"model":"\\ud800"}').model == "\ud800"
    assert facts(b'{"a":"\xed\xa0\x80"}') == BodyFacts(False, None, False)


def test_reasons_never_echo_the_body() -> None:
    secret = b"sk-SECRET-TOKEN"
    for body in (b'{"a":"' + secret + b'" x}', b'{"' + secret + b'":1} ' + secret, secret, b'{"a":' + secret + b"}",
                 b'{"a":"' + secret + b'\xff"}', b'{"a":' + b"[" * 200 + secret):
        error = refused(body)
        assert b"SECRET" not in error.reason.encode() and "SECRET" not in str(error)


def test_large_integers_are_valid_json() -> None:
    # json.loads refuses ints over 4300 digits (int() conversion cost); they are valid JSON and are
    # never converted here.
    facts(b'{"a":' + b"1" * 5000 + b"}")
    facts(b'{"a":1e999999,"b":-0.0e-0}')


# -- depth --------------------------------------------------------------------------------------


def nested(depth: int, inner: bytes = b"0") -> bytes:
    """An object whose containers nest ``depth`` deep in all (top-level object included), mixing
    arrays and objects."""
    opens, closes = [], []
    for level in range(depth - 1):
        if level % 2:
            opens.append(b'{"k":')
            closes.append(b"}")
        else:
            opens.append(b"[")
            closes.append(b"]")
    return b'{"a":' + b"".join(opens) + inner + b"".join(reversed(closes)) + b"}"


@pytest.mark.parametrize("max_depth", [1, 2, 3, 8, 128])
def test_depth_at_the_limit(max_depth: int) -> None:
    if max_depth == 1:
        facts(b'{"a":1,"b":"x"}', max_depth=1)
        refused(b'{"a":[]}', "depth", max_depth=1)
        refused(b'{"a":{}}', "depth", max_depth=1)
        return
    facts(nested(max_depth), max_depth=max_depth)
    facts(nested(max_depth - 1, b"[]"), max_depth=max_depth)  # an empty container counts as a level
    error = refused(nested(max_depth + 1), "depth", max_depth=max_depth)
    assert error.reason.startswith(f"JSON nested deeper than {max_depth} levels")
    refused(nested(max_depth, b"[]"), "depth", max_depth=max_depth)
    refused(nested(max_depth, b"{}"), "depth", max_depth=max_depth)


@pytest.mark.parametrize("max_depth", [1, 2, 3, 5, 6, 7])
def test_depth_at_the_limit_inside_runs_of_items(max_depth: int) -> None:
    """Items followed by a comma are matched in runs (small values, chains): the limit holds there."""
    for inner in (b"1", b"[]", b"[1]", b"[[1]]", b"{}", b'{"k":[1]}'):
        for depth in range(1, max_depth + 3):
            item = b"[" * depth + inner + b"]" * depth
            body = b'{"a":[' + item + b"," + item + b",1]}"
            assert scan_at(body, max_depth) == oracle_at(body, max_depth), (body, max_depth)


def scan_at(body: bytes, max_depth: int) -> str:
    try:
        inspect_json_body(body, max_depth=max_depth)
        return "ok"
    except InvalidJSON as exc:
        return exc.kind


def oracle_at(body: bytes, max_depth: int) -> str:
    return "ok" if depth(json.loads(body)) <= max_depth else "depth"


def test_default_depth_is_128() -> None:
    facts(nested(128))
    refused(nested(129), "depth")


def test_hostile_depth_is_refused_fast_without_recursion() -> None:
    for body in (b'{"a":' + b"[" * 100_000, b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                 b'{"a":' + b'{"a":' * 100_000, b"{" + b'"a":[' * 50_000, b'{"a":' + b'["a":' * 100_000):
        start = time.thread_time()
        refused(body, "depth")
        assert time.thread_time() - start < 0.5  # CPU: a loaded machine does not inflate it


def test_brackets_in_strings_do_not_count() -> None:
    strings = b'"' + b"[{" * 200 + b'\\"]", "x\\\\", "' + b"]}" * 300 + b'"'
    assert facts(b'{"a":[' + strings + b'],"b":[[' + strings + b"]]," + b'"model":"[["}', max_depth=3).model == "[["
    refused(b'{"a":[' + strings + b',[[[1]]]]}', "depth", max_depth=3)


def test_a_syntax_error_before_the_depth_limit_is_a_syntax_error() -> None:
    refused(b'{"a":[1 2,' + b"[" * 200, "syntax")


# -- memory -------------------------------------------------------------------------------------


def peak_allocated(body: bytes) -> int:
    tracemalloc.start()
    try:
        inspect_json_body(body)
    except InvalidJSON:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def fill(head: bytes, unit: bytes, tail: bytes, size: int) -> bytes:
    return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail


@pytest.mark.parametrize("name,body", [
    ("zeros", fill(b'{"a":[', b"0,", b"0]}", 4 * MIB)),
    ("empty arrays", fill(b'{"a":[', b"[],", b"[]]}", 4 * MIB)),
    ("top-level keys", fill(b"{", b'"k":"v",', b'"k":"v"}', 4 * MIB)),
    ("nested stream keys", fill(b'{"a":[', b'{"stream":true},', b'1],"stream":true}', 4 * MIB)),
    ("repeated top-level stream", fill(b"{", b'"stream":true,', b'"stream":false}', 4 * MIB)),
    ("one string", fill(b'{"model":"', b"x", b'"}', 4 * MIB)),
    ("one non-ASCII string", fill(b'{"a":"', "\u00e9\U0001f600".encode(), b'"}', 4 * MIB)),
    ("deep chains", fill(b'{"a":[', b"[" * 100 + b"]" * 100 + b",", b"1]}", 4 * MIB)),
    ("refused at the end", fill(b'{"a":[', b"0,", b"0]x", 4 * MIB)),
])
def test_memory_is_bounded_by_depth_not_by_the_body(name: str, body: bytes) -> None:
    # json.loads takes 20-100x the body for these; the scan keeps under 1 MiB (engine state
    # O(depth), UTF-8 checked in 64 KiB chunks).
    assert peak_allocated(body) < 1 * MIB, name


# -- agreement with json.loads --------------------------------------------------------------------

MAX_DEPTH = 8


def oracle(body: bytes) -> BodyFacts | None:
    """json.loads, restricted to what this module promises: UTF-8 (with surrogatepass, as
    json.loads decodes bytes), no NaN/Infinity, an object at the top, nesting within MAX_DEPTH."""
    def refuse_constant(name: str) -> None:
        raise ValueError(name)

    try:
        doc = json.loads(body.decode("utf-8", "surrogatepass"), parse_constant=refuse_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or depth(doc) > MAX_DEPTH:
        return None
    model = doc.get("model")
    return BodyFacts(stream=doc.get("stream") is True, model=model if isinstance(model, str) and len(model) <= 256 else None,
                     has_model="model" in doc)


def depth(doc: Any) -> int:
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (value.values() if isinstance(value, dict) else value))
    return deepest


def scan(body: bytes) -> BodyFacts | None:
    try:
        return inspect_json_body(body, max_depth=MAX_DEPTH)
    except InvalidJSON:
        return None


text = st.text(st.characters(blacklist_categories=("Cs",)) | st.sampled_from('"\\/\b\f\n\r\t\x00\x1f\u2028'), max_size=12)
keys = text | st.sampled_from(["stream", "model", "Stream", "streams", ""])
scalars = (st.none() | st.booleans() | st.integers(-(10**20), 10**20)
           | st.floats(allow_nan=False, allow_infinity=False) | text)
documents = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                         max_leaves=20)
top_level = st.dictionaries(keys, documents | st.sampled_from([True, False, "m", "x" * 300]), max_size=6)


@st.composite
def encoded(draw: st.DrawFn, doc_strategy: st.SearchStrategy[Any] = top_level) -> bytes:
    doc = draw(doc_strategy)
    ensure_ascii = draw(st.booleans())
    indent = draw(st.sampled_from([None, 0, 2, "\t"]))
    separators = draw(st.sampled_from([None, (",", ":"), (" , ", " : ")]))
    return json.dumps(doc, ensure_ascii=ensure_ascii, indent=indent, separators=separators).encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(encoded(top_level | documents))
def test_agrees_with_json_loads_on_valid_documents(body: bytes) -> None:
    assert scan(body) == oracle(body)


SIGNIFICANT = b'{}[]:,"\\ -+.0123456789eEtrufalsn\t\n\r\x00\x1f\x7f\xc3\xa9\xff'


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    body = bytearray(draw(encoded()))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["delete", "insert", "replace", "truncate", "duplicate"]))
        at = draw(st.integers(0, len(body)))
        if action == "truncate":
            del body[at:]
        elif action == "delete" and at < len(body):
            del body[at:at + draw(st.integers(1, 3))]
        elif action == "insert":
            body[at:at] = bytes([draw(st.sampled_from(SIGNIFICANT))])
        elif action == "replace" and at < len(body):
            body[at] = draw(st.sampled_from(SIGNIFICANT))
        elif action == "duplicate":
            body[at:at] = body[at:at + draw(st.integers(1, 8))]
    return bytes(body)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_agrees_with_json_loads_on_mutated_bytes(body: bytes) -> None:
    assert scan(body) == oracle(body)


@given(st.lists(st.sampled_from(["[", "{"]), min_size=1, max_size=MAX_DEPTH + 2))
def test_agrees_with_json_loads_on_nesting(shape: list[str]) -> None:
    opens = "".join('{"k":' if c == "{" else "[" for c in shape)
    closes = "".join("}" if c == "{" else "]" for c in reversed(shape))
    for body in (f'{{"a":{opens}1{closes}}}', f'{{"a":{opens}1{closes[:-1]}}}', f'{{"a":{opens}{closes}}}'):
        assert scan(body.encode()) == oracle(body.encode()), body


def test_bodies_deeper_than_flat_containers_keep_their_facts() -> None:
    tools = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "array",
             "items": {"type": "object", "properties": {"c": {"type": "string"}}}}}}}}
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "tools": [{"type": "function", "function": {"parameters": tools}}]}).encode()
    assert inspect_json_body(body, max_depth=64) == BodyFacts(stream=True, model="m", has_model=True)
    deep = b'{"model":"m","x":' + b"[" * 40 + b"]" * 40 + b',"stream":true}'
    assert inspect_json_body(deep, max_depth=64) == BodyFacts(stream=True, model="m", has_model=True)
    assert inspect_json_body(memoryview(deep), max_depth=64).stream
    with pytest.raises(InvalidJSON) as too_deep:
        inspect_json_body(b'{"x":' + b"[" * 70 + b"]" * 70 + b"}", max_depth=64)
    assert too_deep.value.kind == "depth"


# -- steps: one pass, a bounded slice at a time -----------------------------------------------------


@pytest.mark.parametrize("step,slice_", [(1, 1), (3, 2), (7, 5), (64, 16)])
def test_tokens_cut_by_any_step_or_slice_give_the_same_answer(monkeypatch: pytest.MonkeyPatch, step: int,
                                                               slice_: int) -> None:
    """Runs stop at a slice's end (re's endpos) and steps at any byte: inside a string, a number,
    whitespace, a key, a run of brackets. The answer never depends on where."""
    from gateway import jsonscan

    bodies = [b' { "model" : "m\u0065" , "stream" : true , "a" : [ [ 1 , 2 ] , { "k" : [ ] } , -1.5e+3 ,'
              b' "x\"y" , { } ] , "s" : "' + "\u00e9\U0001f600".encode() + b'" } ',
              b'{"a":[{"b":[{"c":[1,2,3]}]}],"model":"mm","stream":false,"stream":true}',
              nested(8), nested(9), b'{"a":[1,2]]}', b'{"a":[1,2}', b'{"a":1} x', b'{"a":"\xc3"}',
              b'{"a":' + b"[" * 20 + b"]" * 20 + b"}", b'{"a":' + b"[" * 20 + b"]" * 19 + b"}", b'{"a":[1 2]}']
    expected = [scan(body) for body in bodies]
    monkeypatch.setattr(jsonscan, "STEP_BYTES", step)
    monkeypatch.setattr(jsonscan, "_SLICE", slice_)
    assert [scan(body) for body in bodies] == expected
    for body in bodies:
        try:
            inspect_json_body(body, max_depth=MAX_DEPTH)
        except InvalidJSON as exc:
            with pytest.raises(InvalidJSON) as cut:
                monkeypatch.setattr(jsonscan, "STEP_BYTES", 1 << 20)
                monkeypatch.setattr(jsonscan, "_SLICE", 1 << 20)
                inspect_json_body(body, max_depth=MAX_DEPTH)
            assert cut.value.kind == exc.kind, body
            monkeypatch.setattr(jsonscan, "STEP_BYTES", step)
            monkeypatch.setattr(jsonscan, "_SLICE", slice_)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.integers(1, 9), st.integers(1, 9))
def test_agrees_with_json_loads_in_tiny_steps(body: bytes, step: int, slice_: int) -> None:
    from gateway import jsonscan

    saved = jsonscan.STEP_BYTES, jsonscan._SLICE, jsonscan._DEPTH_CHUNK
    # _DEPTH_CHUNK: the depth scan's chunks then end inside strings, escapes and numbers too.
    jsonscan.STEP_BYTES, jsonscan._SLICE, jsonscan._DEPTH_CHUNK = step, slice_, slice_
    try:
        assert scan(body) == oracle(body)
    finally:
        jsonscan.STEP_BYTES, jsonscan._SLICE, jsonscan._DEPTH_CHUNK = saved


@pytest.mark.parametrize("name,body", [
    ("62-deep chains, a wrong closer at the end", fill(b'{"a":[', b"[" * 61 + b"]" * 61 + b",", b"1}}", 8 * MIB)),
    ("120-deep chains", fill(b'{"a":[', b"[" * 120 + b"]" * 120 + b",", b"1]}", 8 * MIB)),
    ("zeros", fill(b'{"a":[', b"0,", b"0]}", 8 * MIB)),
    ("[[1]] items", fill(b'{"a":[', b"[[1]],", b"1]}", 8 * MIB)),
])
def test_a_step_is_bounded_whatever_the_body(name: str, body: bytes) -> None:
    """The caller yields between steps: no step may hold its loop long (the old expression held it
    for up to 2 s on 8 MiB). In this thread's CPU time, which a loaded machine does not inflate
    (the bench has the wall-clock figures)."""
    try:  # the stepped scanner compiles its expressions on first use (~0.3 s): not a step's cost
        inspect_stepped(body[:STEP_BYTES * 3])
    except InvalidJSON:
        pass
    scanner = JSONScanner(body)
    longest, steps, done = 0.0, 0, False
    while not done:
        started = time.thread_time()
        try:
            done = scanner.step()
        except InvalidJSON:
            done = True
        longest = max(longest, time.thread_time() - started)
        steps += 1
    assert steps >= len(body) // STEP_BYTES // 2, (name, steps)
    assert longest < 0.1, (name, longest)


def inspect_stepped(body: bytes) -> BodyFacts:
    scanner = JSONScanner(body)
    while not scanner.step():
        pass
    return scanner.facts()


@pytest.mark.parametrize("name,body", [
    ("62-deep chains, a wrong closer at the end", fill(b'{"a":[', b"[" * 61 + b"]" * 61 + b",", b"1}}", 8 * MIB)),
    ("branched items", fill(b'{"a":[', b"[[1],[[[[[1]]]]]],", b"1]}", 8 * MIB)),
    ("129 deep at the end", fill(b'{"a":[', b"[[[[[1]]]]],", b"[" * 127, 8 * MIB)),
    ("branched, a lone escaped surrogate", fill(b'{"a":[', b"[[1],[[[[[1]]]]]],", b'"\\ud800"]}', 8 * MIB)),
])
def test_the_loop_is_blocked_briefly_whatever_the_body(name: str, body: bytes) -> None:
    """inspect_json_body: between two calls of ``pause``, a slice of the UTF-8 or depth check (2 ms
    of CPU, gateway.slices) or one msgspec call (~1-3 ns a byte), which cannot be cut. In this
    thread's CPU time (a loaded machine does not inflate it): a stretch is at most a slice with
    margin, or the one C call the stretch holds with margin."""
    c_call = _cpu_of_one_msgspec_call(body)
    longest, last, pauses = 0.0, time.thread_time(), 0

    def pause() -> None:
        nonlocal longest, last, pauses
        longest = max(longest, time.thread_time() - last)
        last = time.thread_time()
        pauses += 1

    started = time.thread_time()
    try:
        inspect_json_body(body, pause=pause)
    except InvalidJSON:
        pass
    longest = max(longest, time.thread_time() - last)
    total = time.thread_time() - started
    assert longest <= max(STRETCH, 1.5 * c_call + 0.005), (name, longest, c_call)
    assert pauses >= total / STRETCH, (name, pauses, total)  # by CPU time, whatever the bytes
    assert total < 2.0, name  # CPU: the stepped scanner took 8 s for branched items


STRETCH = 0.02  # seconds of CPU between two pauses: ten slices of margin for the step a slice ends


def _cpu_of_one_msgspec_call(body: bytes) -> float:
    """The CPU time of msgspec's check of ``body`` (the block no pause can cut), in this thread."""
    import msgspec

    class Skipped(msgspec.Struct):  # as the gateway decodes: every field skipped, nothing built
        pass

    decoder = msgspec.json.Decoder(Skipped)
    started = time.thread_time()
    try:
        decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        pass
    return time.thread_time() - started


def test_msgspec_recursion_is_bounded_by_the_depth_scan() -> None:
    """msgspec has no depth limit (it raises RecursionError past Python's limit): it only ever sees
    the body up to the first opener too deep, so even 100,000 levels are a depth error, never a
    RecursionError, whatever the limit (up to 512)."""
    import msgspec

    deep = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(RecursionError):
        msgspec.json.decode(deep)  # what would happen without the depth scan (no crash either)
    for max_depth in (1, 128, 512):
        assert refused(deep, "depth", max_depth=max_depth).reason.startswith(f"JSON nested deeper than {max_depth}")
    facts(b'{"a":' + b"[" * 511 + b"]" * 511 + b"}", max_depth=512)


def test_lone_escaped_surrogates_like_json_loads() -> None:
    """msgspec refuses them; a copy with other escapes in their place is checked instead."""
    body = b'{"x":"\\udc00","model":"a\\uD83Db\\u0800\\\\ud800","stream":true}'
    assert facts(body) == BodyFacts(stream=True, model=json.loads(body)["model"], has_model=True)
    refused(b'{"x":"\\ud800" "model":1}', "syntax")
    refused(b'{"x":"\\ud800","a":' + b"[" * 200 + b"]" * 200 + b"}", "depth")


def test_pause_is_called_by_cpu_time_and_before_the_c_call() -> None:
    """By slices of CPU time, not by bytes: plain digits are cheap (the UTF-8 check at memory speed,
    no depth scan), so the pause comes before msgspec's call only; bracketed strings cost ~10x
    more a byte, so they get pauses by the slice."""
    calls: list[int] = []
    body = fill(b'{"a":[', b"0,", b'0],"stream":true}', 2 * MIB)
    assert inspect_json_body(body, pause=lambda: calls.append(1)).stream
    assert 1 <= len(calls) <= 3, len(calls)  # a slice may end in the UTF-8 check on a busy CPU
    assert inspect_json_body(b'{"a":1}', pause=lambda: calls.append(2)) == BodyFacts(False, None, False)
    assert 2 not in calls
    bracketed = fill(b'{"a":[', b'"[","{",', b'"]"],"stream":true}', 2 * MIB)
    ticks: list[float] = []
    started = time.thread_time()
    assert inspect_json_body(bracketed, pause=lambda: ticks.append(time.thread_time())).stream
    total = time.thread_time() - started
    assert len(ticks) >= total / STRETCH, (len(ticks), total)
