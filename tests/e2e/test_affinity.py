"""Prefix affinity with three real llama.cpp engines (issue 41): conversations sharing a long system
prompt, sent through the gateway the hooks rendered, return to the Pod that holds their prefix, and
the engine's own count of prompt tokens reused from its cache (``timings.cache_n``) shows it; the same
conversations through a gateway with affinity off (``NOCTAYA_PREFIX_AFFINITY=false``, what
``endpoint.balancing.prefixAffinity: false`` renders) spread over the Pods and reuse less.

The Pods are the rendered llama-server containers, each in a network namespace of its own with a Pod
IP the EndpointSlice controller publishes (tests/e2e/engine_pods.py), their args unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import requests

from hooks.resources.context import ADMIN_PORT
from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.pods import LocalPods
from tests.e2e.test_real_engine import (  # noqa: F401 (fixtures)
    engine_model,
    engines,
    hub,
    kubelet,
    llama_server,
    runtime,
)
from tests.e2e.test_scale_from_zero import GATEWAY_PORT, Model, keda  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(300)

SYSTEM = "You are a careful assistant for a platform team; answer in one short sentence. " * 14  # ~1,100 tokens
QUESTIONS = ("which node runs it?", "how many replicas?", "what does it cost?", "when does it scale in?")


class SideGateway(LocalPods):
    """A second gateway Pod of the model beside the rendered one, with ``env`` on top of the rendered
    env: no Service points at it (the rendered gateway keeps the model's Service names)."""

    def _publish(self, addresses: list[str]) -> None:
        pass

    def _start_one(self, name: str, template: dict[str, Any], address: str | None = None) -> tuple[str, str]:
        return super()._start_one(f"{name}-side", template, address)  # a process name of its own


def chat(base: str, question: str, turns: int) -> dict[str, Any]:
    """One conversation turn: the shared system prompt, the question, the earlier turns."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages += [{"role": "user", "content": f"{question} (turn {turn})"},
                     {"role": "assistant", "content": "It depends."}]
    messages.append({"role": "user", "content": f"{question} (turn {turns})"})
    answer = requests.post(f"{base}/v1/chat/completions", timeout=60,
                           json={"model": "affine", "messages": messages, "max_tokens": 2})
    assert answer.status_code == 200, answer.text[:300]
    return answer.json()


def served(address: str) -> dict[str, int]:
    pods = requests.get(f"http://{address}:{ADMIN_PORT}/noctaya/queue", timeout=5).json()["backend"].get("pods", [])
    return {p["name"]: p["served"] for p in pods}


def converse(address: str) -> tuple[list[str], list[int], int]:
    """Each question's three turns, one after another, through the gateway at ``address``: the Pod
    of each request, the engine's cached prompt tokens of each, and the first request's prompt."""
    placed, cached, first_prompt = [], [], 0
    for question in QUESTIONS:
        for turns in range(3):
            before = served(address)
            answer = chat(f"http://{address}:{GATEWAY_PORT}", question, turns)
            after = served(address)
            (pod,) = [name for name in after if after[name] != before.get(name, 0)]
            placed.append(pod)
            cached.append(answer["timings"]["cache_n"])
            first_prompt = first_prompt or answer["timings"]["prompt_n"] + answer["timings"]["cache_n"]
    return placed, cached, first_prompt


def test_prefix_affinity_brings_conversations_back_to_their_cache(engine_model: Callable[..., Model],  # noqa: F811
                                                                   cluster: Cluster, timeline: Timeline) -> None:
    model = engine_model("affine", min=3, max=3)
    engine = kubelet(model)
    model.wait("three engines Ready", lambda: len(engine.ready_engines()) == 3, timeout=240)
    assert model.gateways is not None
    on = model.gateways.addresses[0]
    model.wait("the gateway lists the three Pods", lambda: len(served(on)) == 3, timeout=30)
    placed, cached, prompt = converse(on)
    timeline.note(f"affinity on: Pods {placed}, cached tokens {cached}")
    # One shared beginning: one key, one Pod, every request after the first reusing the system prompt.
    assert len(set(placed)) == 1, placed
    assert all(c >= prompt // 2 for c in cached[1:]), (cached, prompt)

    side = SideGateway(cluster, model.namespace, "affine-gateway", env={"NOCTAYA_PREFIX_AFFINITY": "false"}).start(1)
    try:
        side.wait_http(GATEWAY_PORT)
        off = side.addresses[0]
        model.wait("the side gateway lists the three Pods", lambda: len(served(off)) == 3, timeout=30)
        placed_off, cached_off, _ = converse(off)
    finally:
        side.stop()
    timeline.note(f"affinity off: Pods {placed_off}, cached tokens {cached_off}")
    print(f"\nprefix affinity, 3 llama-server Pods, 12 requests sharing a {prompt}-token prompt: on -> "
          f"{len(set(placed))} Pod, {sum(cached)} tokens reused ({sum(c < prompt // 2 for c in cached)} "
          f"computed anew); off -> {len(set(placed_off))} Pods, {sum(cached_off)} tokens reused "
          f"({sum(c < prompt // 2 for c in cached_off)} computed anew)")
    assert len(set(placed_off)) == 3, placed_off  # fewest outstanding, ties in turn: spread
    # Each Pod's first request of the conversations computes the whole prompt again: with affinity on
    # only the very first did (above), off at least the two Pods that had not seen it.
    assert sum(c < prompt // 2 for c in cached_off) >= 2, (cached_off, prompt)
