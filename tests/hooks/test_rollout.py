"""Noctaya's own changes never reload a warm model (hooks.controller.rollout).

"Noctaya changed" is simulated the two ways a real upgrade changes templates: a release that renders
a different drain program (`hooks.runtime.drain`), and an install setting (the image the gateways run,
HookConfig.image). "The user changed" is an edit of the LLMService or its InferenceRuntime.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from hooks.controller import rollout, sync
from hooks.resources import names
from hooks.runtime import drain
from tests.hooks import helpers as h

BACKEND = names.backend("qwen")
GATEWAY = names.gateway("qwen")


def deployment(answer: dict, name: str) -> dict:
    return next(c for c in answer["children"] if c["kind"] == "Deployment" and c["metadata"]["name"] == name)


def condition(answer: dict, ctype: str = "UpgradePending") -> dict:
    return next(c for c in answer["status"]["conditions"] if c["type"] == ctype)


def running(replicas: int = 1, *, generation: int = 1, runtime: dict | None = None, annotations: dict | None = None,
            **spec: Any) -> tuple[dict, list[dict]]:
    """An LLMService the current release rendered, as the API server holds it with the backend at
    `replicas` (KEDA's count): (parent with the status that sync wrote, observed children)."""
    parent = h.llmservice(generation=generation, **spec)
    first = sync.sync(h.sync_request(parent, runtimes=[runtime or h.runtime()]), h.config())
    observed = []
    for i, child in enumerate(first["children"]):
        if child["kind"] == "Deployment" and child["metadata"]["name"] == BACKEND:
            observed.append(h.as_observed(child, i, replicas=replicas, readyReplicas=replicas))
        elif child["kind"] == "Deployment":
            observed.append(h.as_observed(child, i, replicas=1, readyReplicas=1))
        else:
            observed.append(h.as_observed(child, i))
    parent = h.llmservice(generation=generation, status=first["status"], **spec)
    if annotations:
        parent["metadata"]["annotations"] = annotations
    return parent, observed


def resync(parent: dict, observed: list[dict], *, runtime: dict | None = None, clock: str = h.FIXED_TIME,
           config: Any = None) -> dict:
    request = h.sync_request(parent, runtimes=[runtime or h.runtime()], children=observed)
    return sync.sync(request, config or h.config(clock))


def template(observed: list[dict], name: str) -> dict:
    child = next(c for c in observed if c["kind"] == "Deployment" and c["metadata"]["name"] == name)
    return json.loads(child["metadata"]["annotations"]["metacontroller.k8s.io/last-applied-configuration"])["spec"]["template"]


@pytest.fixture
def new_drain(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it to become a release whose drain program differs (what made every backend roll in
    the issue): everything rendered before the call is the running release's."""
    return lambda: monkeypatch.setattr(drain, "UNANSWERED_SECONDS", drain.UNANSWERED_SECONDS + 5)


# --- the model is warm: keep serving -------------------------------------------------------------


def test_a_warm_backend_keeps_its_template_when_only_noctaya_changed(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1)
    new_drain()
    answer = resync(parent, observed)
    assert deployment(answer, BACKEND)["spec"]["template"] == template(observed, BACKEND)
    cond = condition(answer)
    assert (cond["status"], cond["reason"]) == ("True", "WaitingForScaleToZero")
    assert BACKEND in cond["message"] and "lifecycle.preStop" in cond["message"]
    pending = answer["status"]["pendingUpgrade"]
    assert pending["deployments"] == [BACKEND]
    assert pending["changes"] == ["spec.containers[engine].lifecycle.preStop.exec.command[8]"]
    assert pending["digest"] in cond["message"]
    # The status never changes on its own: a resync of the world this answer made is byte-identical.
    again = resync({**parent, "status": answer["status"]}, observed)
    assert json.dumps(again) == json.dumps(answer)
    # Ready is untouched by a pending upgrade.
    assert condition(answer, "Ready")["status"] == "True"


def test_at_zero_the_new_template_is_applied(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=0)
    new_drain()
    answer = resync(parent, observed)
    backend = deployment(answer, BACKEND)
    assert backend["spec"]["template"] != template(observed, BACKEND)
    assert backend["spec"]["replicas"] == 0  # the hook never scales: KEDA's count is echoed
    assert "lifecycle" in backend["spec"]["template"]["spec"]["containers"][0]
    assert condition(answer)["reason"] == "UpToDate" and "pendingUpgrade" not in answer["status"]


def test_a_model_that_was_held_takes_the_template_once_it_reaches_zero(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1)
    new_drain()
    held = resync(parent, observed)
    assert condition(held)["status"] == "True"
    # KEDA scales it in: spec.replicas 0, the Pods gone.
    for child in observed:
        if child["metadata"]["name"] == BACKEND:
            child["spec"]["replicas"] = 0
            child["status"] = {"observedGeneration": 1, "replicas": 0}
    applied = resync({**parent, "status": held["status"]}, observed)
    assert deployment(applied, BACKEND)["spec"]["template"] != template(observed, BACKEND)
    assert condition(applied)["reason"] == "UpToDate"


def test_a_draining_replica_still_counts_as_warm(new_drain: Callable[[], None]) -> None:
    """spec.replicas already 0 but a Pod still counted: applying now would not restart it, but the
    rule reads both, so a scale-in in progress is never raced."""
    parent, observed = running(replicas=1)
    new_drain()
    for child in observed:
        if child["metadata"]["name"] == BACKEND:
            child["spec"]["replicas"] = 0
    assert condition(resync(parent, observed))["status"] == "True"


# --- the user changed something: it rolls as always --------------------------------------------


def test_a_user_change_to_the_runtime_rolls_at_once_and_takes_noctayas_change_along(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1)
    new_drain()
    edited = h.runtime(image="vllm/vllm-openai:v0.9.0")
    answer = resync(parent, observed, runtime=edited)
    backend = deployment(answer, BACKEND)
    assert backend["spec"]["template"]["spec"]["containers"][0]["image"] == "vllm/vllm-openai:v0.9.0"
    assert backend["spec"]["template"]["spec"]["containers"][0]["lifecycle"] != \
        template(observed, BACKEND)["spec"]["containers"][0]["lifecycle"]
    assert condition(answer)["reason"] == "UpToDate"


def test_a_user_change_the_backend_does_not_read_leaves_it_held(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1)
    new_drain()
    parent["spec"]["endpoint"] = {"maxQueue": 7}
    parent["metadata"]["generation"] = 2
    answer = resync(parent, observed)
    assert deployment(answer, BACKEND)["spec"]["template"] == template(observed, BACKEND)
    # The gateway reads maxQueue: it rolls, as it would have without any upgrade.
    env = {e["name"]: e.get("value") for e in deployment(answer, GATEWAY)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["NOCTAYA_MAX_QUEUE"] == "7"
    assert answer["status"]["pendingUpgrade"]["deployments"] == [BACKEND]


def test_scaling_retunes_roll_neither_backend_nor_gateway(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1)
    new_drain()
    parent["spec"]["scaling"] = {"targetPerReplica": 3, "cooldownPeriod": "10m"}
    answer = resync(parent, observed)
    assert deployment(answer, BACKEND)["spec"]["template"] == template(observed, BACKEND)
    assert deployment(answer, GATEWAY) == json.loads(
        next(c for c in observed if c["metadata"]["name"] == GATEWAY)["metadata"]["annotations"][
            "metacontroller.k8s.io/last-applied-configuration"])


# --- gateways are Noctaya's image: an image change waits too ----------------------------------


def test_a_new_gateway_image_waits_while_the_model_is_warm_and_applies_at_zero() -> None:
    parent, observed = running(replicas=1)
    newer = h.config()
    newer = type(newer)(**{**newer.__dict__, "image": "ghcr.io/noctaya/noctaya:9.9.9"})
    held = resync(parent, observed, config=newer)
    assert deployment(held, GATEWAY)["spec"]["template"] == template(observed, GATEWAY)
    assert held["status"]["pendingUpgrade"]["changes"] == ["spec.containers[gateway].image"]
    cold_parent, cold = running(replicas=0)
    applied = resync(cold_parent, cold, config=newer)
    assert deployment(applied, GATEWAY)["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":9.9.9")


# --- what lets a warm model take the change --------------------------------------------------


def test_an_approval_applies_exactly_the_pending_templates(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1)
    new_drain()
    digest = resync(parent, observed)["status"]["pendingUpgrade"]["digest"]
    wrong = copy.deepcopy(parent)
    wrong["metadata"]["annotations"] = {rollout.APPROVE_ANNOTATION: "0" * 16}
    assert condition(resync(wrong, observed))["status"] == "True"
    right = copy.deepcopy(parent)
    right["metadata"]["annotations"] = {rollout.APPROVE_ANNOTATION: digest}
    answer = resync(right, observed)
    assert deployment(answer, BACKEND)["spec"]["template"] != template(observed, BACKEND)
    assert condition(answer)["reason"] == "UpToDate"


def test_policy_immediate_applies_at_once(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1, upgrades={"policy": "Immediate"})
    new_drain()
    answer = resync(parent, observed)
    assert deployment(answer, BACKEND)["spec"]["template"] != template(observed, BACKEND)


def test_min_one_without_windows_waits_for_approval(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1, scaling={"min": 1})
    new_drain()
    cond = condition(resync(parent, observed))
    assert (cond["status"], cond["reason"]) == ("True", "WaitingForApproval")
    assert "never on its own" in cond["message"]


# A window on Sunday 03:00-05:00 in Berlin (UTC+1 in January): 02:00-04:00 UTC on 2026-01-04.
WINDOW = {"windows": [{"start": "0 3 * * SUN", "end": "0 5 * * SUN", "timeZone": "Europe/Berlin"}]}


@pytest.mark.parametrize(("clock", "applied"), [
    ("2026-01-04T01:59:59Z", False),  # one second before the start (02:59:59 in Berlin)
    ("2026-01-04T02:00:00Z", True),   # the start minute itself
    ("2026-01-04T03:59:59Z", True),   # the last second inside
    ("2026-01-04T04:00:00Z", False),  # the end minute: closed
    ("2026-01-03T02:30:00Z", False),  # Saturday at that time
    ("2026-01-11T02:30:00Z", True),   # the next Sunday
])
def test_min_one_takes_the_change_inside_its_window_at_the_limits(new_drain: Callable[[], None], clock: str, applied: bool) -> None:
    parent, observed = running(replicas=1, scaling={"min": 1}, upgrades=WINDOW)
    new_drain()
    answer = resync(parent, observed, clock=clock)
    assert (deployment(answer, BACKEND)["spec"]["template"] != template(observed, BACKEND)) is applied
    if not applied:
        assert condition(answer)["reason"] == "WaitingForWindow"


def test_windows_follow_the_time_zone_across_a_clock_change(new_drain: Callable[[], None]) -> None:
    """New York 01:30-02:30 daily: on 2026-03-08 the clock jumps 02:00 → 03:00, after the start."""
    ny = {"windows": [{"start": "30 1 * * *", "end": "30 2 * * *", "timeZone": "America/New_York"}]}
    parent, observed = running(replicas=1, scaling={"min": 1}, upgrades=ny)
    new_drain()
    inside_winter = "2026-01-15T06:45:00Z"  # 01:45 EST
    inside_summer = "2026-07-15T05:45:00Z"  # 01:45 EDT
    outside_summer = "2026-07-15T06:45:00Z"  # 02:45 EDT
    for clock, applied in ((inside_winter, True), (inside_summer, True), (outside_summer, False)):
        answer = resync(parent, observed, clock=clock)
        assert (deployment(answer, BACKEND)["spec"]["template"] != template(observed, BACKEND)) is applied, clock


def test_no_clock_is_read_while_nothing_waits() -> None:
    parent, observed = running(replicas=1, scaling={"min": 1}, upgrades=WINDOW)
    settled = resync(parent, observed)  # the conditions this world has (their transitions read the clock)
    config = h.config()

    def forbidden() -> str:
        raise AssertionError("the clock was read")

    config = type(config)(**{**config.__dict__, "clock": forbidden})
    answer = resync({**parent, "status": settled["status"]}, observed, config=config)
    assert condition(answer)["reason"] == "UpToDate" and json.dumps(answer) == json.dumps(settled)


# --- objects rendered by the release before this one (no inputs digest yet) --------------------


def _as_previous_release(observed: list[dict]) -> list[dict]:
    """The observed children as the previous release left them: no inputs annotation anywhere."""
    out = copy.deepcopy(observed)
    for child in out:
        annotations = child["metadata"].get("annotations") or {}
        annotations.pop(rollout.INPUTS_ANNOTATION, None)
        applied = json.loads(annotations["metacontroller.k8s.io/last-applied-configuration"])
        (applied["metadata"].get("annotations") or {}).pop(rollout.INPUTS_ANNOTATION, None)
        if applied["metadata"].get("annotations") == {}:
            del applied["metadata"]["annotations"]
        annotations["metacontroller.k8s.io/last-applied-configuration"] = json.dumps(applied, sort_keys=True)
    return out


def test_previous_release_objects_are_held_when_the_spec_was_already_rendered(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1)
    new_drain()
    old = _as_previous_release(observed)
    answer = resync(parent, old)
    assert deployment(answer, BACKEND)["spec"]["template"] == template(old, BACKEND)
    assert condition(answer)["status"] == "True"
    # From now on the digest is recorded, so a later user change is told apart exactly.
    assert rollout.INPUTS_ANNOTATION in deployment(answer, BACKEND)["metadata"]["annotations"]


def test_previous_release_objects_roll_when_the_spec_changed_since(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1)
    new_drain()
    parent["metadata"]["generation"] = 2  # edited while the old hook server was down
    answer = resync(parent, _as_previous_release(observed))
    assert deployment(answer, BACKEND)["spec"]["template"] != template(observed, BACKEND)


def test_previous_release_objects_roll_when_the_runtime_image_changed(new_drain: Callable[[], None]) -> None:
    parent, observed = running(replicas=1)
    new_drain()
    answer = resync(parent, _as_previous_release(observed), runtime=h.runtime(image="vllm/vllm-openai:v0.9.0"))
    assert deployment(answer, BACKEND)["spec"]["template"]["spec"]["containers"][0]["image"] == "vllm/vllm-openai:v0.9.0"


# --- the rules and helpers alone ------------------------------------------------------------


def test_diff_paths_names_containers_by_name() -> None:
    old = {"spec": {"containers": [{"name": "engine", "image": "a"}], "x": 1}}
    new = {"spec": {"containers": [{"name": "engine", "image": "b"}], "x": 1, "y": 2}}
    assert rollout.diff_paths(old, new) == ["spec.containers[engine].image", "spec.y"]
    assert rollout.diff_paths([1], [1, 2]) == ["."]


def test_inputs_ignore_defaults_a_new_release_adds() -> None:
    from hooks.api.llmservice import LLMServiceSpec
    bare = LLMServiceSpec.model_validate({"model": {"source": "hf://a/b"}, "runtime": {"name": "r"}})
    # What the API server hands over once the CRD defaults are filled in: the same inputs.
    explicit = LLMServiceSpec.model_validate({"model": {"source": "hf://a/b"}, "runtime": {"name": "r"},
                                              "scaling": {"min": 0, "max": 1, "cooldownPeriod": "5m"},
                                              "cache": {"strategy": "NodeLocalPVC", "size": "50Gi"}})
    assert rollout.inputs_digest(spec=bare) == rollout.inputs_digest(spec=explicit)


@pytest.mark.parametrize(("facts", "rule"), [
    ({"upgrades": {"policy": "Immediate"}, "warm": True}, "immediate_policy"),
    ({"warm": False}, "model_idle"),
    ({"warm": True, "approval": " d1 "}, "approved"),
    ({"warm": True, "upgrades": WINDOW, "now": "2026-01-04T02:30:00Z"}, "window_open"),
    ({"warm": True, "upgrades": WINDOW, "now": "2026-01-04T04:30:00Z"}, None),
    ({"warm": True, "approval": "d2"}, None),
])
def test_each_rule_alone(facts: dict, rule: str | None) -> None:
    from hooks.api.upgrades import Upgrades
    made = rollout.Facts(upgrades=Upgrades.model_validate(facts.get("upgrades", {})), warm=facts["warm"],
                         approval=facts.get("approval"), min_replicas=0,
                         now=lambda: rollout.parse_clock(facts.get("now", h.FIXED_TIME)))
    assert rollout.applying_rule(made, "d1") == rule
