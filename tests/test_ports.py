"""tests/ports.py: ports outside the ephemeral range, a slice per xdist worker, never one that is held."""

from __future__ import annotations

import socket

import pytest

from tests import ports


def slice_of(monkeypatch: pytest.MonkeyPatch, worker: str, count: int) -> range:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    return ports.worker_slice()


def test_each_xdist_worker_has_its_own_slice_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    slices = [slice_of(monkeypatch, f"gw{i}", 4) for i in range(4)]
    for a in range(4):
        assert len(slices[a]) > 1000
        for b in range(a + 1, 4):
            assert not set(slices[a]) & set(slices[b])
    low, high = ports.ephemeral_range()
    assert all(not (low <= p <= high) for s in slices for p in (s.start, s.stop - 1))


def test_a_machine_whose_ephemeral_range_covers_ours_gets_ports_above_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (10000, 40000))
    whole = slice_of(monkeypatch, "", 1)
    assert whole.start == 40001 and whole.stop <= 65536


def test_a_held_port_is_never_handed_out_nor_one_handed_out_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "SPAN", 40)
    monkeypatch.setattr(ports, "_slice", None)
    monkeypatch.setattr(ports, "_next", None)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    held = []
    for port in ports.worker_slice()[::2]:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.listen()
        held.append(sock)
    try:
        taken = {s.getsockname()[1] for s in held}
        given = [ports.free_port() for _ in range(40 - len(taken) - 5)]
        assert not taken & set(given)
        assert len(set(given)) == len(given)
    finally:
        for sock in held:
            sock.close()


def test_no_port_left_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "worker_slice", lambda: range(0))
    monkeypatch.setattr(ports, "_slice", None)  # read again, once
    monkeypatch.setattr(ports, "_next", None)
    with pytest.raises(RuntimeError, match="no free port"):
        ports.free_port()
