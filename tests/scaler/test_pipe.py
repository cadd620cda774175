"""The demand pipe from a gateway to its `python -m scaler local` child."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

from scaler.demand import IDLE, Demand, DemandBroadcaster
from scaler.pipe import MAX_LINE_BYTES, decode_demand, encode_demand, mirror_demand


def test_encode_decode_round_trip() -> None:
    for demand in (IDLE, Demand(3, 4, True), Demand(0, 0, True), Demand(10_000, 1, False)):
        line = encode_demand(demand)
        assert line.endswith(b"\n") and len(line) < MAX_LINE_BYTES
        assert decode_demand(line) == demand


@pytest.mark.parametrize("line", [b"nope\n", b"[]\n", b'{"q": 1, "f": 0}\n', b'{"q": -1, "f": 0, "l": false}\n',
                                  b'{"q": true, "f": 0, "l": false}\n', b'{"q": 1.5, "f": 0, "l": false}\n',
                                  b"\xff\xfe\n"])
def test_malformed_lines_are_rejected(line: bytes) -> None:
    with pytest.raises(ValueError):
        decode_demand(line)


def _mirror(data: bytes) -> tuple[DemandBroadcaster, list[Demand]]:
    broadcaster = DemandBroadcaster()
    seen: list[Demand] = []
    original = broadcaster.publish

    def record(demand: Demand) -> bool:
        seen.append(demand)
        return original(demand)

    broadcaster.publish = record  # type: ignore[method-assign]
    done = threading.Event()
    mirror_demand(io.BytesIO(data), broadcaster, on_eof=done.set).join(5)
    assert done.is_set()
    return broadcaster, seen


def test_mirror_publishes_each_line_then_idle_on_eof() -> None:
    data = encode_demand(Demand(1, 0, True)) + encode_demand(Demand(0, 1, True))
    broadcaster, seen = _mirror(data)
    assert seen == [Demand(1, 0, True), Demand(0, 1, True), IDLE]
    assert broadcaster.current() == IDLE  # the feeding gateway is gone: its demand must not outlive it


def test_mirror_skips_garbage_and_bounds_an_endless_line() -> None:
    flood = b"x" * (50 * MAX_LINE_BYTES) + b"\n"  # one huge line, read in bounded steps
    data = b"garbage\n" + flood + encode_demand(Demand(2, 0, True)) + b'{"q":1}\n'
    _, seen = _mirror(data)
    assert seen == [Demand(2, 0, True), IDLE]


def test_mirror_over_a_real_pipe_wakes_waiters() -> None:
    read_fd, write_fd = os.pipe()
    broadcaster = DemandBroadcaster()
    done = threading.Event()
    with os.fdopen(read_fd, "rb") as reader, os.fdopen(write_fd, "wb", buffering=0) as writer:
        mirror_demand(reader, broadcaster, on_eof=done.set)
        version, _ = broadcaster.snapshot()
        writer.write(encode_demand(Demand(1, 0, True)))
        version, demand = broadcaster.wait_for_change(version, timeout=5)
        assert demand == Demand(1, 0, True)
        writer.close()
        assert done.wait(5)
    assert broadcaster.current() == IDLE


def test_pushed_and_certificate_lines_round_trip_and_garbage_is_skipped() -> None:
    from scaler.pipe import CERTIFICATE, PUSHED, ReportWriter, read_reports

    out = io.BytesIO()
    before = time.monotonic()
    reports = ReportWriter(out)
    reports.pushed(time.monotonic())
    reports.certificate(1893456000.0)
    seen: list[float] = []
    expiry: list[float] = []
    stream = io.BytesIO(out.getvalue() + b"pushed nan\npushed -1\nhello 5\ncertificate inf\n" + b"x" * 1000
                        + b"\npushed 12.5\n")
    read_reports(stream, {PUSHED: seen.append, CERTIFICATE: expiry.append})
    assert len(seen) == 2 and before <= seen[0] <= time.monotonic() and seen[1] == 12.5
    assert expiry == [1893456000.0]
