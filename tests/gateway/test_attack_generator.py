"""The attack generator (issue 38): hypothesis draws attack shapes per family and plays each against a
running gateway - a per-model one and a shared one (two models: the attacked one open, the keyed
user's behind an API key) - each on a thread of this process with KEDA's ExternalScaler (h2) on the
same loop, as in a one-worker gateway. While the attack runs, a keyed user of another model (on the
per-model gateway: another client of the same model) sends small chat completions.

Properties, each in CPU time or counted work, never a wall-clock bound a loaded machine can break:

- the loop thread never runs longer than SLICE_CPU_SECONDS of its own CPU time between two greenlet
  switches (the oracle of tests/gateway/loopwatch.py): that stretch is the longest any other client,
  probe or IsActive waited for the loop;
- the process's RSS grows by at most RSS_SLACK_BYTES + RSS_PER_CONNECTION_BYTES per attacking
  connection + BODY_COPIES times the bytes the attack sent (a body being read is held; nothing more);
- every request of the keyed user is answered 200 (and, in the h2 family, every IsActive answered).

Families (``-k`` selects one; all carry the ``attack`` marker): chunked, pipeline, headers, multipart,
h2, idle. Each draws its client addresses too (1..8 of 127.0.5.x).

KNOWN_FAILING below lists the families whose property fails on this branch today, because the fixes
of issue 38 land in other branches. Each listed family runs as a *strict* xfail (its minimal example
not shrunk, to keep the CI budget): when a fix makes it pass, the XPASS fails the suite and its name
must be removed from the list. Empty it once the fixes are merged; the list is the only switch.
``NOCTAYA_ATTACK_SHRINK=1`` shrinks failing examples of listed families too (minutes, not for CI).

Budget: EXAMPLES per family (a fixed, derandomized sequence; no example database), each attack
playing PLAY_SECONDS; the whole module about 30 s of CPU on 2 cores.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gateway.config import GatewayConfig
from gateway.modeltable import parse_model_table
from gateway.relay import READ_CHUNK
from gateway.shared import SharedGatewayApp
from gateway.workers import GC_THRESHOLD
from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.demand import DemandBroadcaster
from tests.gateway.attack_rig import (
    H2_KINDS,
    IsActivePoller,
    KeyedUser,
    PeakRSS,
    Plan,
    chunked_plans,
    h2_plans,
    header_plans,
    idle_plans,
    multipart_plans,
    pipeline_plans,
    play,
)
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.harness import ThreadedGateway
from tests.gateway.loopwatch import LoopWatch

# Families whose property fails today (the fixes are in other branches of issue 38). Remove a name
# once its fix is merged: a listed family that passes fails the suite (strict xfail).
KNOWN_FAILING: set[str] = set()  # h2: fixed by the scaler's frame allowances and time slices (wip/38b)

pytestmark = [pytest.mark.timeout(600), pytest.mark.attack]

# The slice: CPU seconds the loop may run between two switches. The gateway's slices are a few ms
# (gateway.slices); 20 ms leaves room for the step at which a slice ends, as in test_slices.py.
SLICE_CPU_SECONDS = 0.02
# Memory one attacking connection may cost: a held connection's state (under 32 KiB: issue 7's
# target, measured ~15 KiB in docs/benchmarks.md) plus one read of its bytes (gateway.relay.READ_CHUNK)
# being parsed or forwarded. Never a multiple of what it sent, never a buffer it can grow.
RSS_PER_CONNECTION_BYTES = 32 * 1024 + READ_CHUNK
# A body is the client's to send and the gateway's to hold while it reads it (up to the max body, all
# bodies within the upload bounds: docs/architecture.md): its pieces and the one buffer they are
# joined into, twice what was sent at most. More than that is amplification.
BODY_COPIES = 2
# VmRSS moves in allocator arenas and by the first use of a code path (an error page, a module's
# lazy import): 4 MiB of a 100-connection example is 40 KiB each, so examples of few connections
# check the slice and the other model, examples of many check the memory.
RSS_SLACK_BYTES = 4 * 1024 * 1024
EXAMPLES = 10
PLAY_SECONDS = 0.4
KINDS = ("per-model", "shared")
USER_KEY = "keyed-user-secret"
MODEL = "test-model"  # the per-model gateway's
ATTACKED, KEYED = "open/model-a", "keyed/model-b"  # the shared gateway's
REF = pb.ScaledObjectRef(name="attack", namespace="default", scalerMetadata={})


@dataclass
class Rig:
    """A running gateway and who plays what against it."""

    gw: ThreadedGateway
    scaler_port: int
    stub: pb_grpc.ExternalScalerStub
    attacked: str  # the model the attack names
    user_model: str
    user_key: str | None

    @property
    def ports(self) -> dict[str, int]:
        return {"public": self.gw.port, "scaler": self.scaler_port}


def _with_scaler(gw: ThreadedGateway) -> int:
    """KEDA's ExternalScaler on the gateway's own loop (as gateway.workers runs it in a one-worker
    gateway): an h2 attack then competes for the loop the public port uses. Its port."""
    from scaler.h2server import start_h2_scaler_server

    return gw.call(lambda: start_h2_scaler_server(DemandBroadcaster(), 0, host="127.0.0.1").port)


def _config(backend_url: str, model: str, **overrides: Any) -> GatewayConfig:
    return GatewayConfig(backend_url=backend_url, served_model_name=model, listen_host="127.0.0.1", listen_port=0,
                         admin_port=0, scaler_mode="off", probe_interval_seconds=0.05, probe_timeout_seconds=0.5,
                         ready_grace_seconds=0.5, heartbeat_seconds=0.2, max_held_body_bytes=64 * 2**20, **overrides)


@pytest.fixture(scope="module")
def rigs() -> Iterator[dict[str, Rig]]:
    backends = [FakeBackend() for _ in range(3)]
    for backend in backends:
        backend.start()  # warm: the attack meets the data path, not a cold hold
    keys = tempfile.TemporaryDirectory(prefix="noctaya-attack-keys-")
    key_file = Path(keys.name) / "key"
    key_file.write_text(USER_KEY + "\n")
    per_model = ThreadedGateway(_config(backends[0].url, MODEL)).start()
    base = _config("http://unused:1", "unused")
    table = parse_model_table(json.dumps({"models": [
        {"name": ATTACKED, "backendURL": backends[1].url},
        {"name": KEYED, "backendURL": backends[2].url, "authKeyFile": str(key_file)},
    ]}).encode(), base)
    shared = ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table)).start()
    channels: list[grpc.Channel] = []
    made: dict[str, Rig] = {}
    for kind, gw, attacked, user, key in (("per-model", per_model, MODEL, MODEL, None),
                                          ("shared", shared, ATTACKED, KEYED, USER_KEY)):
        port = _with_scaler(gw)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=20)
        channels.append(channel)
        made[kind] = Rig(gw, port, pb_grpc.ExternalScalerStub(channel), attacked, user, key)
    # As a gateway process runs (gateway.workers.run_worker): what lives for good out of the cyclic
    # GC, young collections rare. A full collection of the test process's heap (hypothesis, grpc, the
    # clients) is no part of the gateway and would land in some greenlet's stretch.
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 50, 100)
    try:
        yield made
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        for channel in channels:
            channel.close()
        for gw in (per_model, shared):
            gw.stop()
        for backend in backends:
            backend.stop()
        keys.cleanup()


def run_attack(rig: Rig, plans: list[Plan], *, is_active: bool = False) -> None:
    """Play ``plans`` against ``rig`` with the keyed user (and IsActive) running, then assert the
    three properties."""
    watch = LoopWatch()
    rig.gw.call(watch.install)
    poller = IsActivePoller(lambda: rig.stub.IsActive(REF, timeout=30), interval=0.05)
    try:
        with PeakRSS() as rss, KeyedUser(rig.gw.port, rig.user_model, rig.user_key) as user:
            if is_active:
                poller.__enter__()
            try:
                outcome = play(plans, rig.ports, PLAY_SECONDS)
            finally:
                if is_active:
                    poller.__exit__()
    finally:
        rig.gw.call(watch.uninstall)
    seen = (f"{len(plans)} connections, {outcome.sent} bytes sent (one at most {outcome.max_sent}), "
            f"statuses {sorted(set(outcome.statuses))}, {outcome.closed_by_gateway} closed by the gateway")
    assert watch.longest <= SLICE_CPU_SECONDS, (
        f"the loop ran {watch.longest * 1000:.1f} ms of CPU without a switch ({watch.where}); {seen}")
    bound = RSS_SLACK_BYTES + len(plans) * RSS_PER_CONNECTION_BYTES + BODY_COPIES * outcome.sent
    assert rss.growth <= bound, f"RSS grew {rss.growth / 1024:.0f} KiB, bound {bound / 1024:.0f} KiB; {seen}"
    assert user.statuses and not user.refused, f"the keyed user got {user.refused} of {len(user.statuses)}; {seen}"
    assert not poller.errors, f"IsActive failed: {poller.errors}; {seen}"


def family(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The fixed CI budget, and a strict xfail while ``name`` is in KNOWN_FAILING (shrinking skipped
    then unless NOCTAYA_ATTACK_SHRINK=1: a failing example would otherwise shrink for minutes)."""
    shrink = name not in KNOWN_FAILING or os.environ.get("NOCTAYA_ATTACK_SHRINK") == "1"
    phases = (Phase.explicit, Phase.generate, *((Phase.shrink,) if shrink else ()))

    def wrap(test: Callable[..., None]) -> Callable[..., None]:
        test = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=phases,
                        report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])(test)
        if name in KNOWN_FAILING:
            test = pytest.mark.xfail(strict=True, reason=f"{name}: in KNOWN_FAILING (issue 38's fix not merged)")(test)
        return test

    return wrap


kinds = st.sampled_from(KINDS)
sources = st.integers(1, 8)


# -- the families --------------------------------------------------------------------------------------------
@family("chunked")
@given(kind=kinds, sizes=st.lists(st.integers(1, 4096), min_size=1, max_size=4), body=st.integers(100, 128 * 1024),
       ext=st.integers(0, 2048), trailer=st.integers(0, 16 * 1024), endless=st.sampled_from(["", "extension", "trailer"]),
       connections=st.integers(1, 16), addresses=sources)
def test_attack_chunked(rigs: dict[str, Rig], kind: str, sizes: list[int], body: int, ext: int, trailer: int,
                        endless: str, connections: int, addresses: int) -> None:
    rig = rigs[kind]
    run_attack(rig, chunked_plans(rig.attacked, sizes, body, ext, trailer, endless, connections, addresses))


@family("pipeline")
@given(kind=kinds, depth=st.integers(1, 512), post=st.booleans(), connections=st.integers(1, 16), addresses=sources)
def test_attack_pipeline(rigs: dict[str, Rig], kind: str, depth: int, post: bool, connections: int,
                         addresses: int) -> None:
    rig = rigs[kind]
    run_attack(rig, pipeline_plans(rig.attacked, depth, post, connections, addresses))


@family("headers")
@given(kind=kinds, count=st.integers(1, 200), size=st.integers(1, 8192), connections=st.integers(1, 32),
       addresses=sources)
def test_attack_headers(rigs: dict[str, Rig], kind: str, count: int, size: int, connections: int,
                        addresses: int) -> None:
    rig = rigs[kind]
    run_attack(rig, header_plans(rig.attacked, count, size, connections, addresses))


@family("multipart")
@given(parts=st.integers(1, 4096), part_bytes=st.integers(0, 2048), model_last=st.booleans(),
       connections=st.integers(1, 8), addresses=sources)
def test_attack_multipart(rigs: dict[str, Rig], parts: int, part_bytes: int, model_last: bool, connections: int,
                          addresses: int) -> None:
    """To the shared gateway only: a per-model gateway does not read a form to route it."""
    rig = rigs["shared"]
    run_attack(rig, multipart_plans(rig.attacked, parts, part_bytes, model_last, connections, addresses))


h2_sequences = st.lists(st.tuples(st.sampled_from(H2_KINDS), st.integers(1, 4096)), min_size=1, max_size=6)


@family("h2")
@given(kind=kinds, sequence=h2_sequences, connections=st.integers(1, 8))
def test_attack_h2(rigs: dict[str, Rig], kind: str, sequence: list[tuple[str, int]], connections: int) -> None:
    """Frame sequences to KEDA's scaler port, IsActive on a real grpc channel meanwhile."""
    run_attack(rigs[kind], h2_plans(sequence, connections), is_active=True)


@family("idle")
@given(kind=kinds, idle=st.integers(0, 128), half_open=st.integers(0, 64), partial_head=st.integers(0, 64),
       partial_body=st.integers(0, 64), addresses=sources)
def test_attack_idle(rigs: dict[str, Rig], kind: str, idle: int, half_open: int, partial_head: int,
                     partial_body: int, addresses: int) -> None:
    rig = rigs[kind]
    run_attack(rig, idle_plans(rig.attacked, idle, half_open, partial_head, partial_body, addresses))
