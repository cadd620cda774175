"""gateway.filewatch: the shared gateway sleeps until its mounted table's directory changes. Real
inotify on a temporary directory, changed the ways a kubelet and a person change it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import gevent
import pytest

from gateway.filewatch import watch_directory


@pytest.fixture
def watched(tmp_path: Path):
    watch = watch_directory(str(tmp_path))
    if watch is None:
        pytest.skip("inotify is not available here")
    yield tmp_path, watch
    watch.close()


def _later(action, delay: float = 0.2) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_nothing_changes_so_the_wait_sleeps_its_whole_timeout(watched) -> None:
    _directory, watch = watched
    t0 = time.monotonic()
    assert watch.wait(0.3) is False
    assert time.monotonic() - t0 >= 0.29


def _kubelet_swap(directory: Path, content: str) -> None:
    """The kubelet's atomic writer: files in a fresh directory, a new ..data link renamed over the old."""
    fresh = directory / f"..{time.time_ns()}"
    fresh.mkdir()
    (fresh / "models.json").write_text(content)
    (directory / "..data_tmp").symlink_to(fresh.name)
    os.replace(directory / "..data_tmp", directory / "..data")
    if not (directory / "models.json").is_symlink():
        (directory / "models.json").symlink_to("..data/models.json")


@pytest.mark.parametrize("change", ["kubelet-swap", "rename-over", "write-in-place"])
def test_each_way_a_table_changes_wakes_the_wait_at_once(watched, change: str) -> None:
    directory, watch = watched
    target = directory / "models.json"
    target.write_text("{}")
    watch.wait(0)  # the set-up's own events
    actions = {
        "kubelet-swap": lambda: _kubelet_swap(directory, '{"models": []}'),
        "rename-over": lambda: ((directory / "x.new").write_text("[]"), os.replace(directory / "x.new", target)),
        "write-in-place": lambda: target.write_text("[]"),
    }
    if change == "kubelet-swap":
        target.unlink()
    thread = _later(actions[change])
    t0 = time.monotonic()
    assert watch.wait(10.0) is True
    assert time.monotonic() - t0 < 5.0
    thread.join()


def test_the_wait_yields_to_other_greenlets(watched) -> None:
    directory, watch = watched
    ticks: list[int] = []
    ticker = gevent.spawn(lambda: [ticks.append(i) or gevent.sleep(0.01) for i in range(10)])
    writer = _later(lambda: (directory / "f").write_text("x"), delay=0.3)
    assert watch.wait(5.0) is True
    assert len(ticks) == 10  # the hub kept running the other greenlet while this one waited
    ticker.join()
    writer.join()
