"""``python -m bench.jsonscan_bench [--json-loads]``: CPU time and peak allocation of
gateway.jsonscan.inspect_json_body on a typical chat body and on 8 MiB hostile bodies
(``--json-loads`` also measures json.loads on the same bodies, for comparison)."""

from __future__ import annotations

import json
import sys
import time
import tracemalloc
from collections.abc import Callable

from gateway.jsonscan import InvalidJSON, inspect_json_body

MIB = 1 << 20


def _fill(head: bytes, unit: bytes, tail: bytes, size: int = 8 * MIB) -> bytes:
    return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail


def bodies() -> dict[str, bytes]:
    message = {"role": "user", "content": "Summarise this. " * 400}
    chat = json.dumps({"model": "llama", "stream": True, "temperature": 0.2,
                       "messages": [message] * 15}).encode()
    chain = b"[" * 120 + b"]" * 120
    return {
        f"chat body ({len(chat) // 1024} KiB)": chat,
        "[0,0,...]": _fill(b'{"a":[', b"0,", b"0]}"),
        "[[],[],...]": _fill(b'{"a":[', b"[],", b"[]]}"),
        '{"k":"v",...} (top level)': _fill(b"{", b'"k":"v",', b'"k":"v"}'),
        '[{"a":1},...]': _fill(b'{"a":[', b'{"a":1},', b"1]}"),
        '"stream" keys nested': _fill(b'{"a":[', b'{"stream":true},', b"1],\"stream\":true}"),
        "one 8 MiB string": _fill(b'{"model":"', b"x", b'"}'),
        "one 8 MiB non-ASCII string": _fill(b'{"a":"', "\u00e9\U0001f600".encode(), b'"}'),
        '"stream":true repeated (top level)': _fill(b"{", b'"stream":true,', b'"stream":false}'),
        "[-1.5e+10,...]": _fill(b'{"a":[', b"-1.5e+10,", b"1]}"),
        "120-deep chains": _fill(b'{"a":[', chain + b",", chain + b"]}"),
        "100,000 x [ (refused)": b'{"a":' + b"[" * 100_000,
        "bad byte at the end (refused)": _fill(b'{"a":[', b"0,", b"0]x"),
    }


def run(fn: Callable[[], object]) -> str:
    try:
        fn()
        return "ok"
    except (ValueError, RecursionError) as exc:
        return f"{type(exc).__name__}" + (f" ({exc.kind})" if isinstance(exc, InvalidJSON) else "")


def measure(fn: Callable[[], object]) -> tuple[float, int, str]:
    """CPU time (best of 3, without tracemalloc, which slows allocation) and peak allocation."""
    elapsed = float("inf")
    for _ in range(3):
        start = time.process_time()
        outcome = run(fn)
        elapsed = min(elapsed, time.process_time() - start)
    tracemalloc.start()
    run(fn)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return elapsed, peak, outcome


def main() -> int:
    with_loads = "--json-loads" in sys.argv
    print(f"{'body':34} {'size':>9} {'cpu':>9} {'peak':>10}  outcome" + ("   json.loads peak" if with_loads else ""))
    for name, body in bodies().items():
        elapsed, peak, outcome = measure(lambda body=body: inspect_json_body(body))
        line = f"{name:34} {len(body):>9} {elapsed * 1000:>7.1f}ms {peak / 1024:>8.1f}KiB  {outcome}"
        if with_loads:
            tracemalloc.start()
            loads_outcome = run(lambda body=body: json.loads(body))
            loads_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            line += f"   {loads_peak / MIB:.1f} MiB ({loads_outcome})"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
