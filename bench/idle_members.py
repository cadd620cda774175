"""Idle members of a shared gateway as deployed (issue 29 item 6): the CPU a shared gateway fronting
100 idle models spends answering KEDA, at the ``pollingInterval`` the hooks render for a member,
against the same gateway polled at the 5 s every member got before (``scaling.pollingInterval``'s
default, still what a model with its own gateway gets), both measured side by side in the same window.

Each gateway is ``python -m gateway`` run as the hooks render an LLMGateway fronting 100 copies of
``examples/models/scale-to-zero.yaml`` (``bench.idle_footprint.GatewayPod``: the shared Deployment's
env, its routing table written to a file, every backend on a closed port since each is at zero).
KEDA is played over one real gRPC channel per gateway (grpcio, as KEDA's Go client pools one
connection per scaler address, ``bench.idle_footprint.Kubelet``): per member one ``StreamIsActive``
stream held open, and ``IsActive`` + ``GetMetrics`` every pollingInterval, the members' phases spread
over the interval; the kubelet's two probes per Pod at their rendered periods. A third gateway, the
floor, has its streams held and its probes answered but is never polled: what the Pod pays whatever
the interval, so (as rendered - floor) is what the members' polls cost. CPU is the
scheduler's run time of the gateway's process tree (``/proc/<pid>/task/*/schedstat``) over the
window, in ms per wall second, beside ``python -c`` sleeping as the interpreter's floor.

Run: .venv/bin/python -m bench.idle_members [--quick] [--seconds N] [--models N] [--check]
(``--check``: exit 1 when the rendered interval misses <= 1 ms/s for 100 members.)
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
from typing import Any

from bench import idle_footprint as idle

GOAL_MS_PER_S = 1.0
GOAL_MODELS = 100
BEFORE_POLLING_SECONDS = 5  # what every member rendered before issue 29, the API default
BASELINE = "baseline: python -c sleep"
FLOOR = "floor: streams and probes, no polls"
NEVER = 1e9  # a pollingInterval no window reaches: the floor's KEDA holds its streams and never polls


def member_scaled_object() -> dict[str, Any]:
    """The ScaledObject spec the hooks render for a member of a shared gateway (the scale-to-zero
    example naming an LLMGateway), i.e. the pollingInterval KEDA uses against that gateway."""
    import yaml

    from hooks.render import render_documents

    documents = [d for d in yaml.safe_load_all(idle.RUNTIME_EXAMPLE.read_text()) if d]
    (example,) = [d for d in yaml.safe_load_all(idle.MODEL_EXAMPLE.read_text()) if d]
    member = copy.deepcopy(example)
    member["spec"]["endpoint"] = {**member["spec"].get("endpoint", {}), "gateway": "bench"}
    documents += [member, {"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMGateway",
                           "metadata": {"name": "bench"}, "spec": {}}]
    for child in render_documents(documents):
        if child["kind"] == "ScaledObject":
            return child["spec"]
    raise SystemExit("the hooks rendered no ScaledObject for a member")


def measure(models: int, seconds: float, intervals: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per label: the gateway tree's CPU (ms/s), wake-ups/s and requests answered/s in one window,
    each gateway polled at its interval; plus the baseline process."""
    container, _ = idle.rendered()
    pods: dict[str, idle.GatewayPod] = {}
    kubelets: dict[str, idle.Kubelet] = {}
    baseline = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1e9)"])
    try:
        for label in intervals:
            pods[label] = idle.GatewayPod(idle.ROOT, container, label, models)
        kubelets = {label: idle.Kubelet(pods[label], container, {"pollingInterval": polling})
                    for label, polling in intervals.items()}
        time.sleep(idle.SETTLE_SECONDS)  # streams opened, first pushes answered
        roots = {**{label: pod.proc.pid for label, pod in pods.items()}, BASELINE: baseline.pid}
        answered = {label: k.requests for label, k in kubelets.items()}
        window = idle.Window(roots, seconds).run()
        totals = idle.report(f"{models} idle members as deployed", window, show_threads=False)
        for label, kubelet in kubelets.items():
            totals[label]["requests"] = (kubelet.requests - answered[label]) / window.elapsed
            totals[label]["failed"] = kubelet.errors + kubelet.streams_lost
    finally:
        for kubelet in kubelets.values():
            kubelet.stop()
        for pod in pods.values():
            pod.stop()
        baseline.kill()
        baseline.wait()
    return totals


def targets(totals: dict[str, dict[str, float]], before: str, after: str, models: int, seconds: float) -> bool:
    """The block ``python -m bench`` repeats at its end; whether the target was missed."""
    print(f"\n== Idle members: targets (issue 29), {models} members, {seconds:.0f} s window")
    print(f"  {'configuration':<44} {'CPU ms/s':>9} {'wakeups/s':>9} {'RPCs+probes/s':>13} {'ms each':>8}  target")
    missed = False
    for label in (before, after, FLOOR, BASELINE):
        t = totals[label]
        rate = t.get("requests", 0.0)
        each = f"{t['cpu'] / rate:8.3f}" if rate else f"{'':>8}"
        verdict = ""
        if label == after and models == GOAL_MODELS:
            ok = t["cpu"] <= GOAL_MS_PER_S
            missed = not ok
            verdict = f"<= {GOAL_MS_PER_S} ms/s  {'met' if ok else 'MISSED'}"
        print(f"  {label:<44} {t['cpu']:9.3f} {t['wakeups']:9.1f} {rate:13.2f} {each}  {verdict}")
    polls = totals[after]["cpu"] - totals[FLOOR]["cpu"]
    print(f"  after / before: {idle.ratio(totals[after]['cpu'], totals[before]['cpu']):.3f}x CPU "
          f"(same window, same host); the members' polls alone (as rendered - floor): {polls:.3f} ms/s; "
          f"failed calls or lost streams: {int(totals[before]['failed'])} before, {int(totals[after]['failed'])} after")
    print()
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="length of the sampled window (default 40)")
    parser.add_argument("--quick", action="store_true", help="a 20 s window")
    parser.add_argument("--models", type=int, default=GOAL_MODELS, help=f"members per gateway (default {GOAL_MODELS})")
    parser.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    args = parser.parse_args()
    seconds = 20.0 if args.quick else args.seconds
    polling = float(member_scaled_object()["pollingInterval"])
    before = f"before: members polled every {BEFORE_POLLING_SECONDS} s"
    after = f"as rendered: members polled every {polling:.0f} s"
    print(f"idle members of a shared gateway: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"load average {os.getloadavg()[0]:.2f}; {args.models} members per gateway, {seconds:.0f} s window "
          f"after {idle.SETTLE_SECONDS:.0f} s to settle")
    totals = measure(args.models, seconds, {before: BEFORE_POLLING_SECONDS, after: polling, FLOOR: NEVER})
    missed = targets(totals, before, after, args.models, seconds)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
