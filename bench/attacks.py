"""The attack generator's long mode (issue 38): each attack family played for seconds against a real
``python -m gateway`` (one worker, KEDA's scaler on h2 on its loop; the env the hooks render for the
example LLMService), a per-model gateway and a shared one (the rendered model attacked, a second model
behind an API key for the keyed user), quiet and under attack in the same run:

- the keyed user's p50/p99: small chat completions every 20 ms on one keep-alive connection (on the
  per-model gateway: another client of the same model), and how many were not answered 200;
- the longest kubelet probe: ``/healthz`` on the admin port every 50 ms, a new connection each;
- the longest ``IsActive``: real grpc to the scaler port every 50 ms;
- the gateway's peak RSS (the process tree, sampled every 20 ms).

The shapes are the heavy ends of tests/gateway/test_attack_generator.py's strategies, played by the
same player (tests/gateway/attack_rig.py), connection after connection for the family's window.

Run: .venv/bin/python -m bench.attacks [--quick] [--seconds S] [--report-only]
Targets: probes and IsActive < 1 s, the keyed user never refused; exit 1 when one is missed
(``--report-only``: exit 0 whatever the figures).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import grpc

from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.gateway.abuse_harness import OTHER_MODEL, GatewayPod, PeakTreeRSS, get
from tests.gateway.attack_rig import (
    IsActivePoller,
    KeyedUser,
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

TARGET_SECONDS = 1.0  # the kubelet's and KEDA's: a probe or IsActive slower than this fails somebody
USER_KEY = "bench-keyed-user"
H2_HEAVY = [("ping", 4096), ("settings", 1024), ("window_update", 4096), ("headers_rst", 2048), ("empty_data", 4096)]


def families(model: str, shared: bool) -> dict[str, Callable[[], list[Plan]]]:
    """Each family's heaviest shape (the strategies' upper ends), as plans against ``model``."""
    made: dict[str, Callable[[], list[Plan]]] = {
        "chunked": lambda: (chunked_plans(model, [1], 128 * 1024, 64, 0, "", 8, 4)
                            + chunked_plans(model, [4096], 4096, 0, 0, "trailer", 8, 4)),
        "pipeline": lambda: pipeline_plans(model, 512, False, 16, 4),
        "headers": lambda: header_plans(model, 100, 300, 32, 8),
        "multipart": lambda: multipart_plans(model, 4096, 1, True, 8, 4),
        "h2": lambda: h2_plans(H2_HEAVY, 4),
        "idle": lambda: idle_plans(model, 256, 64, 64, 64, 8),
    }
    if not shared:
        del made["multipart"]  # a per-model gateway does not read a form to route it
    return made


class Probes:
    """The kubelet: GET /healthz on the admin port every 50 ms, a new connection each."""

    def __init__(self, admin_port: int) -> None:
        self.poller = IsActivePoller(lambda: self._probe(admin_port), interval=0.05)

    @staticmethod
    def _probe(port: int) -> None:
        if get(port, "/healthz", timeout=30).status != 200:
            raise RuntimeError("healthz not 200")


def measure(pod: GatewayPod, user_model: str, key: str | None, attack: Callable[[], list[Plan]] | None,
            seconds: float) -> dict[str, float]:
    """Quiet (``attack`` None) or under ``attack`` played round after round, for ``seconds``."""
    channel = grpc.insecure_channel(f"127.0.0.1:{pod.scaler_port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = pb_grpc.ExternalScalerStub(channel)
    probes = Probes(pod.admin_port).poller
    active = IsActivePoller(lambda: stub.IsActive(pod.ref, timeout=30), interval=0.05)
    user = KeyedUser(pod.port, user_model, key)
    sent = rounds = 0
    with ExitStack() as stack:
        rss = stack.enter_context(PeakTreeRSS(pod.proc.pid))
        for meter in (user, probes, active):
            stack.enter_context(meter)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if attack is None:
                time.sleep(0.1)
                continue
            outcome = play(attack(), {"public": pod.port, "scaler": pod.scaler_port}, min(1.0, seconds))
            sent, rounds = sent + outcome.sent, rounds + 1
    channel.close()
    return {"p50": user.p(50), "p99": user.p(99), "requests": len(user.statuses), "refused": len(user.refused),
            "probe": probes.longest, "probe_errors": len(probes.errors), "is_active": active.longest,
            "is_active_errors": len(active.errors), "rss": rss.peak, "rounds": rounds, "sent": sent}


def run_gateway(shared: bool, seconds: float) -> list[tuple[str, dict[str, float]]]:
    attacked, other = FakeBackend(), FakeBackend()
    for backend in (attacked, other):
        backend.start()
        # The gateway resets backend connections of requests an attack abandons: socketserver would
        # print a traceback for each, burying the table. Nothing of the benchmark reads them.
        backend._server.handle_error = lambda *_: None  # type: ignore[union-attr]
    keys = tempfile.TemporaryDirectory(prefix="noctaya-bench-keys-")
    key_file = Path(keys.name) / "key"
    key_file.write_text(USER_KEY + "\n")
    pod = GatewayPod(attacked.port, shared=shared, other_backend_port=other.port,
                     other_model={"authKeyFile": str(key_file)}, NOCTAYA_GATEWAY_WORKERS="1",
                     NOCTAYA_SCALER_MODE="local", NOCTAYA_LOG_LEVEL="warning")
    user_model, key = (OTHER_MODEL, USER_KEY) if shared else (pod.model, None)
    rows = []
    try:
        rows.append(("quiet", measure(pod, user_model, key, None, seconds)))
        for name, attack in families(pod.model, shared).items():
            rows.append((name, measure(pod, user_model, key, attack, seconds)))
            print(f"  {'shared' if shared else 'per-model'} {name}: done", flush=True)
    finally:
        pod.stop()
        attacked.stop()
        other.stop()
        keys.cleanup()
    return rows


def report(results: dict[str, list[tuple[str, dict[str, float]]]]) -> bool:
    """Print the table and the targets; True when every target is met."""
    print("\n== Attacks: a keyed user, the kubelet and KEDA, quiet and under each family (same run)")
    print("| gateway | attack | user p50 ms | user p99 ms | user refused | longest /healthz ms "
          "| longest IsActive ms | peak RSS MiB | attack bytes sent |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    met = True
    for kind, rows in results.items():
        for name, r in rows:
            print(f"| {kind} | {name} | {r['p50'] * 1000:.1f} | {r['p99'] * 1000:.1f} | "
                  f"{r['refused']:.0f} / {r['requests']:.0f} | {r['probe'] * 1000:.0f} | {r['is_active'] * 1000:.0f} | "
                  f"{r['rss'] / 2**20:.1f} | {r['sent'] / 2**20:.1f} MiB |")
            met = met and r["refused"] == 0 and r["probe"] < TARGET_SECONDS and r["is_active"] < TARGET_SECONDS
            met = met and not r["probe_errors"] and not r["is_active_errors"]
    print(f"\n== Attacks: targets\nlongest /healthz and IsActive < {TARGET_SECONDS:.0f} s, the keyed user "
          f"never refused: {'met' if met else 'NOT MET'}")
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 s per family instead of 5")
    parser.add_argument("--seconds", type=float, help="seconds per family (and quiet)")
    parser.add_argument("--report-only", action="store_true", help="exit 0 even when a target is missed")
    args = parser.parse_args()
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    results = {kind: run_gateway(kind == "shared", seconds) for kind in ("per-model", "shared")}
    met = report(results)
    return 0 if met or args.report_only else 1


if __name__ == "__main__":
    sys.exit(main())
