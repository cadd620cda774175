"""The downloader against a HOSTILE stand-in hub (``tests.prewarm.hostile``): a body longer than the
listing declares is cut off before the file grows past its listed size, and a trickle below the
minimum rate is abandoned within about the stall window, its partial removed and the revision's lock
free for the next attempt."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.hub import HubRepo
from prewarm.hub import HubClient, Listing, PrewarmError, RemoteFile, prewarm
from prewarm.layout import ModelDir
from prewarm.transfer import Limits
from tests.prewarm.conftest import MAIN, run_prewarm, weights
from tests.prewarm.hostile import ENDLESS, Hostile, HostileHub, MaxSize

SCHEMES = ["hf", "modelscope"]
LISTED = 4096  # weights.bin, as the listing declares it
SHARD = 12 * 1024  # shard.bin: long enough at the trickle's rate to be judged over several windows
FILES = {"config.json": b'{"model_type": "llama"}', "weights.bin": weights("w", LISTED),
         "shard.bin": weights("s", SHARD)}
# A 1 s window, so a stall shows within seconds; a read timeout that is not what ends a trickle.
FAST = ("--min-rate", "1024", "--stall-window", "1", "--read-timeout", "10")


@pytest.fixture
def hostile_hub() -> Iterator[HostileHub]:
    with HostileHub({"org/hostile": HubRepo({MAIN: FILES}, {"main": MAIN, "master": MAIN})}) as server:
        yield server


def hub_args(scheme: str, cache: Path, *extra: str) -> tuple[str, ...]:
    return ("hub", "--source", f"{scheme}://org/hostile", "--cache-dir", str(cache), *extra)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("announce", [None, 272_000_000], ids=["close-delimited", "announced"])
def test_an_endless_body_for_a_file_listed_at_4_kib_never_grows_past_4_kib(
        hostile_hub: HostileHub, tmp_path: Path, scheme: str, announce: int | None) -> None:
    hostile_hub.hostile["weights.bin"] = Hostile(extra=ENDLESS, announce=announce)
    cache = tmp_path / "cache"
    model = ModelDir.of(cache, f"{scheme}://org/hostile", None)
    with MaxSize(model.partial / "weights.bin") as seen:
        run = run_prewarm(hostile_hub, tmp_path, *hub_args(scheme, cache), scheme=scheme)
    assert run.code == 1, run.out
    assert seen.max <= LISTED, seen.max  # checked before each write: not one byte past the listing
    assert "weights.bin" in run.termination and f"{LISTED} bytes" in run.termination, run.termination
    assert (str(announce) if announce else "at least") in run.termination and "refused" in run.termination
    assert "Traceback" not in run.out
    assert not model.partial.exists() and not model.final.exists() and not model.marker.exists()
    assert hostile_hub.sent["weights.bin"] < 64 << 20  # the client hung up long before the hub's 300 MB cap


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("announce", [False, True], ids=["close-delimited", "announced"])
def test_exactly_the_listed_size_is_accepted_and_one_byte_more_refused(
        hostile_hub: HostileHub, tmp_path: Path, scheme: str, announce: bool) -> None:
    cache = tmp_path / "cache"
    model = ModelDir.of(cache, f"{scheme}://org/hostile", None)
    hostile_hub.hostile["weights.bin"] = Hostile(extra=1, announce=LISTED + 1 if announce else None)
    with MaxSize(model.partial / "weights.bin") as seen:
        over = run_prewarm(hostile_hub, tmp_path, *hub_args(scheme, cache), scheme=scheme)
    assert over.code == 1, over.out
    assert seen.max <= LISTED
    assert f"weights.bin: the server {'announces' if announce else 'sent more than the'}" in over.termination
    assert str(LISTED + 1) in over.termination and f"{LISTED} bytes" in over.termination, over.termination
    assert not model.partial.exists() and not model.marker.exists()

    hostile_hub.hostile["weights.bin"] = Hostile(extra=0, announce=LISTED if announce else None)
    at_limit = run_prewarm(hostile_hub, tmp_path, *hub_args(scheme, cache), scheme=scheme)
    assert at_limit.code == 0, at_limit.out
    assert (model.final / "weights.bin").read_bytes() == FILES["weights.bin"] and model.read_marker() is not None


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_trickle_below_the_minimum_rate_fails_within_the_window_and_frees_the_lock(
        hostile_hub: HostileHub, tmp_path: Path, scheme: str) -> None:
    cache = tmp_path / "cache"
    model = ModelDir.of(cache, f"{scheme}://org/hostile", None)
    hostile_hub.hostile["shard.bin"] = Hostile(rate=256, piece=64, announce=SHARD)  # 48 s for the whole file
    started = time.monotonic()
    slow = run_prewarm(hostile_hub, tmp_path, *hub_args(scheme, cache, *FAST), scheme=scheme)
    elapsed = time.monotonic() - started
    assert slow.code == 1, slow.out
    assert elapsed < 15, elapsed  # the window (1 s) and the process's start, not the trickle's 48 s
    assert "shard.bin: stalled" in slow.termination and "1024 bytes/s" in slow.termination, slow.termination
    assert not model.partial.exists() and not model.marker.exists()
    # The next attempt takes the revision's lock at once (a zero wait) and finds no partial to clear.
    hostile_hub.hostile.clear()
    retried = run_prewarm(hostile_hub, tmp_path, *hub_args(scheme, cache, *FAST, "--lock-timeout", "0"), scheme=scheme)
    assert retried.code == 0, retried.out
    assert "interrupted attempt" not in retried.out and "waiting for" not in retried.out
    assert (model.final / "shard.bin").read_bytes() == FILES["shard.bin"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_trickle_above_the_minimum_rate_succeeds(hostile_hub: HostileHub, tmp_path: Path, scheme: str) -> None:
    cache = tmp_path / "cache"
    hostile_hub.hostile["shard.bin"] = Hostile(rate=4096, piece=256, announce=SHARD)  # 3 s: judged in 2 windows
    run = run_prewarm(hostile_hub, tmp_path, *hub_args(scheme, cache, *FAST), scheme=scheme)
    assert run.code == 0, run.out
    model = ModelDir.of(cache, f"{scheme}://org/hostile", None)
    assert (model.final / "shard.bin").read_bytes() == FILES["shard.bin"]


class _Direct(HubClient):
    """The stand-in hub's listing and resolve URLs, in this process (so this process's lock is seen)."""

    scheme = "hf"

    def __init__(self, url: str) -> None:
        self.url = url

    def listing(self, repo_id: str, revision: str) -> Listing:
        return Listing(MAIN, tuple(RemoteFile(p, len(d)) for p, d in FILES.items()))

    def file_request(self, repo_id: str, revision: str, path: str) -> tuple[str, dict[str, str]]:
        return f"{self.url}/{repo_id}/resolve/{revision}/{path}", {}

    def auth_failure(self, exc: BaseException) -> str | None:
        return None


@pytest.mark.parametrize("hostile, limits, fragment", [
    (Hostile(rate=256, piece=64, announce=SHARD), Limits(min_rate=1024, stall_window=1, read_timeout=10),
     "bytes/s"),
    (Hostile(rate=0.01, piece=1, announce=SHARD), Limits(min_rate=1024, stall_window=60, read_timeout=1),
     "no byte for 1 s"),
], ids=["trickle", "silent"])
def test_a_stalled_download_releases_the_revision_lock_in_the_same_process(
        hostile_hub: HostileHub, tmp_path: Path, hostile: Hostile, limits: Limits, fragment: str) -> None:
    hostile_hub.hostile["shard.bin"] = hostile
    model = ModelDir.of(tmp_path, "hf://org/hostile", None)
    started = time.monotonic()
    with pytest.raises(PrewarmError, match=f"shard.bin: stalled: .*{fragment}"):
        prewarm(model, _Direct(hostile_hub.url), progress_interval=60, lock_timeout=0, limits=limits)
    assert time.monotonic() - started < 10
    assert not model.partial.exists()
    with model.locked(0, logging.getLogger("test")):  # another descriptor of this process: free at once
        pass


def test_the_rate_is_judged_over_the_last_window_not_since_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from prewarm import transfer

    now = [0.0]
    monkeypatch.setattr(transfer.time, "monotonic", lambda: now[0])
    guard = transfer.RateGuard(Limits(min_rate=100, stall_window=10), "w.bin")
    now[0] = 5.0
    guard.add(5000)  # a fast start...
    for t in range(6, 15):
        now[0] = float(t)
        guard.add(1)  # ...then a trickle: the window ending at 14 s still holds the burst at 5 s
    now[0] = 15.5
    with pytest.raises(transfer.Stall, match=r"w.bin: stalled: 10 bytes in the last 10 s"):
        guard.add(1)  # the burst left the window: 10 bytes came after it, fewer than 1000


def test_an_error_text_loses_the_query_strings_of_its_urls() -> None:
    from prewarm.hub import without_queries

    text = "Max retries exceeded with url: /repos/ab/cd?X-Amz-Signature=s3cr3t&Expires=1 (Caused by Timeout())"
    assert without_queries(text) == "Max retries exceeded with url: /repos/ab/cd?… (Caused by Timeout())"


def test_many_tiny_reads_keep_the_rate_window_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that sends a byte per read, fast: the guard's samples stay bounded (about 128 a window)
    and the rate it judges stays exact."""
    from prewarm import transfer

    now = [0.0]
    monkeypatch.setattr(transfer.time, "monotonic", lambda: now[0])
    guard = transfer.RateGuard(Limits(min_rate=100, stall_window=10), "w.bin")
    for i in range(1, 200_001):  # 200,000 reads of a byte over 20 s: 10,000 bytes/s
        now[0] = i * 1e-4
        guard.add(1)
    assert len(guard._samples) <= 140
    now[0] = 40.0
    with pytest.raises(transfer.Stall, match=r"stalled: 0 bytes in the last 10 s"):
        guard.add(0)
