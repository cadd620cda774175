"""``python -m bench.jsonscan_bench [--json-loads] [--quick]``: CPU per byte of
gateway.jsonscan.inspect_json_body (msgspec in C, plus the depth scan) on a typical chat body and on
8 MiB hostile bodies, beside the stepped pure-Python scanner it keeps as a fallback
(gateway.jsonscan.JSONScanner) and the regular-expression check before that
(bench.jsonscan_regex_baseline), measured in the same run; the longest a loop is blocked between two
calls of ``pause``; peak allocation. ``--json-loads`` adds json.loads's CPU; ``--quick`` skips the
stepped scanner and the regex (seconds per body)."""

from __future__ import annotations

import json
import sys
import time
import tracemalloc
from collections.abc import Callable

from bench import jsonscan_regex_baseline as baseline
from gateway.jsonscan import InvalidJSON, JSONScanner, inspect_json_body

MIB = 1 << 20


def _fill(head: bytes, unit: bytes, tail: bytes, size: int = 8 * MIB) -> bytes:
    return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail


def bodies() -> dict[str, bytes]:
    message = {"role": "user", "content": "Summarise this. " * 400}
    chat = json.dumps({"model": "llama", "stream": True, "temperature": 0.2,
                       "messages": [message] * 15}).encode()
    chain62 = b"[" * 61 + b"]" * 61
    chain120 = b"[" * 119 + b"]" * 119
    return {
        f"chat body ({len(chat) // 1024} KiB)": chat,
        "62-deep chains, wrong closer at end": _fill(b'{"a":[', chain62 + b",", chain62 + b"}}"),
        "120-deep chains (depth 128)": _fill(b'{"a":[', chain120 + b",", chain120 + b"]}"),
        "[0,0,...]": _fill(b'{"a":[', b"0,", b"0]}"),
        "[[],[],...]": _fill(b'{"a":[', b"[],", b"[]]}"),
        "[[1],[1],...] (2 levels)": _fill(b'{"a":[', b"[[1]],", b"1]}"),
        "[[[1]]],... (3 levels)": _fill(b'{"a":[', b"[[[1]]],", b"1]}"),
        "[[[[[1]]]]],... (5 levels)": _fill(b'{"a":[', b"[[[[[1]]]]],", b"1]}"),
        '[{"a":[{"a":[1]}]}],... (5 levels)': _fill(b'{"a":[', b'[{"a":[{"a":[1]}]}],', b"1]}"),
        "[[[[[1],[1]]]]],... (6 levels, branched)": _fill(b'{"a":[', b"[[[[[1],[1]]]]],", b"1]}"),
        "[[1],[[[[[1]]]]]],... (7 levels, branched)": _fill(b'{"a":[', b"[[1],[[[[[1]]]]]],", b"1]}"),
        '{"k":"v",...} (top level)': _fill(b"{", b'"k":"v",', b'"k":"v"}'),
        '[{"a":1},...]': _fill(b'{"a":[', b'{"a":1},', b"1]}"),
        '"stream" keys nested': _fill(b'{"a":[', b'{"stream":true},', b"1],\"stream\":true}"),
        "one 8 MiB string": _fill(b'{"model":"', b"x", b'"}'),
        "one 8 MiB non-ASCII string": _fill(b'{"a":"', "\u00e9\U0001f600".encode(), b'"}'),
        '"stream":true repeated (top level)': _fill(b"{", b'"stream":true,', b'"stream":false}'),
        "[-1.5e+10,...]": _fill(b'{"a":[', b"-1.5e+10,", b"1]}"),
        "100,000 x [ (refused)": b'{"a":' + b"[" * 100_000,
        "bad byte at the end (refused)": _fill(b'{"a":[', b"0,", b"0]x"),
        '100-deep ["","",...] (depth scan, strings)': _fill(b'{"a":' + b"[" * 100, b'"",', b'""' + b"]" * 100 + b"}"),
        "[[[[[1]]]]],... 129 deep at the end (refused)": _fill(b'{"a":[', b"[[[[[1]]]]],", b"[" * 127),
        "branched + lone \\ud800 (checked on a copy)": _fill(b'{"a":[', b"[[1],[[[[[1]]]]]],", b'"\\ud800"]}'),
    }


def run(fn: Callable[[], object]) -> str:
    try:
        fn()
        return "ok"
    except (ValueError, RecursionError) as exc:
        return f"{type(exc).__name__}" + (f" ({exc.kind})" if isinstance(exc, InvalidJSON) else "")


def cpu(fn: Callable[[], object], repeat: int) -> float:
    """CPU seconds, best of ``repeat`` (without tracemalloc, which slows allocation)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        run(fn)
        best = min(best, time.process_time() - start)
    return best


def stepped(body: bytes) -> None:
    """The stepped pure-Python scanner alone (what inspect_json_body used before msgspec)."""
    scanner = JSONScanner(body, max_depth=128)
    while not scanner.step():
        pass


def longest_block(body: bytes) -> tuple[float, int]:
    """The most CPU (this thread's: what a loop waits between two yields when the host is not
    oversubscribed) between two calls of ``pause``, and the number of pauses."""
    pauses: list[float] = []
    longest, last = 0.0, time.thread_time()

    def pause() -> None:
        nonlocal longest, last
        now = time.thread_time()
        longest = max(longest, now - last)
        pauses.append(now)
        last = time.thread_time()

    run(lambda: inspect_json_body(body, pause=pause))
    return max(longest, time.thread_time() - last), len(pauses)


def peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    run(fn)
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return top


def main() -> int:
    with_loads, quick = "--json-loads" in sys.argv, "--quick" in sys.argv
    print(f"{'body':44} {'size':>8} {'check':>8} {'ns/B':>5} {'stepped':>8} {'ns/B':>5} {'regex':>8} {'ns/B':>5} "
          f"{'block':>7} {'pauses':>6} {'peak':>7}  outcome" + ("   json.loads" if with_loads else ""), flush=True)
    for name, body in bodies().items():
        size = len(body)
        new = cpu(lambda body=body: inspect_json_body(body), 3)
        old = float("nan") if quick else cpu(lambda body=body: stepped(body), 1)
        regex = float("nan") if quick else cpu(lambda body=body: baseline.inspect_json_body(body), 1)
        block, pauses = longest_block(body)
        outcome = run(lambda body=body: inspect_json_body(body))
        line = (f"{name:44} {size:>8} {new * 1000:>6.1f}ms {new * 1e9 / size:>5.0f} {old * 1000:>6.0f}ms "
                f"{old * 1e9 / size:>5.0f} {regex * 1000:>6.0f}ms {regex * 1e9 / size:>5.0f} {block * 1000:>5.1f}ms "
                f"{pauses:>6} {peak(lambda body=body: inspect_json_body(body)) / 1024:>4.0f}KiB  {outcome}")
        if with_loads:
            line += f"   {cpu(lambda body=body: json.loads(body), 1) * 1000:.0f}ms"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
