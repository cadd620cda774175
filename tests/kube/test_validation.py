"""The CRDs' validation on the real API server: invalid objects are rejected with readable messages,
and the pydantic models (what the hooks parse with) reject them with the same message."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic
import pytest

from hooks.api import InferenceRuntime, LLMService
from tests.kube.apiserver import ControlPlane

pytestmark = pytest.mark.timeout(180, func_only=True)

NAMESPACE = "validation"
DIGEST = "sha256:" + "ab" * 32

VALID_LLMSERVICE: dict[str, Any] = {
    "apiVersion": "serving.noctaya.io/v1alpha1",
    "kind": "LLMService",
    "metadata": {"name": "case", "namespace": NAMESPACE},
    "spec": {"model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct"}, "runtime": {"name": "vllm-nvidia"}},
}
VALID_RUNTIME: dict[str, Any] = {
    "apiVersion": "serving.noctaya.io/v1alpha1",
    "kind": "InferenceRuntime",
    "metadata": {"name": "case"},
    "spec": {"engine": "vllm", "image": "vllm/vllm-openai:v0.11.0"},
}


@dataclass(frozen=True)
class Case:
    id: str
    base: dict[str, Any]
    mutate: Callable[[dict[str, Any]], None]
    message: str  # what the user reads in kubectl's error
    cel: bool = True  # a CEL rule (shared with pydantic) rather than an OpenAPI pattern/enum

    def build(self) -> dict[str, Any]:
        obj = copy.deepcopy(self.base)
        obj["metadata"]["name"] = self.id
        self.mutate(obj["spec"])
        return obj


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(spec: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def _all(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(spec: dict[str, Any]) -> None:
        for m in mutations:
            m(spec)

    return mutate


CASES = [
    Case(
        "min-above-max",
        VALID_LLMSERVICE,
        _set("scaling", {"min": 3, "max": 2}),
        "scaling.min must not exceed scaling.max",
    ),
    Case(
        "runtime-name-and-selector",
        VALID_LLMSERVICE,
        _set("runtime", {"name": "vllm-nvidia", "selector": {"matchLabels": {"engine": "vllm"}}}),
        "set exactly one of runtime.name or runtime.selector",
    ),
    Case(
        "runtime-neither",
        VALID_LLMSERVICE,
        _set("runtime", {"args": ["--x"]}),
        "set exactly one of runtime.name or runtime.selector",
    ),
    Case(
        "empty-runtime-selector",
        VALID_LLMSERVICE,
        _set("runtime", {"selector": {}}),
        "an empty selector would match every runtime",
    ),
    Case(
        "hostpath-without-path",
        VALID_LLMSERVICE,
        _set("cache", {"strategy": "HostPath"}),
        "cache.hostPath is required with strategy HostPath",
    ),
    Case(
        "prewarm-without-persistent-cache",
        VALID_LLMSERVICE,
        _set("cache", {"strategy": "None", "prewarm": True}),
        "cache.prewarm needs a persistent cache",
    ),
    Case(
        "pvc-with-prewarm",
        VALID_LLMSERVICE,
        _all(_set("model.source", "pvc://weights/llama"), _set("cache.prewarm", True)),
        "a pvc:// source is pre-staged: cache.prewarm does not apply",
    ),
    Case(
        "pvc-path-traversal",
        VALID_LLMSERVICE,
        _set("model.source", "pvc://weights/../../etc"),
        "a pvc:// source must not contain '.' or '..' path segments",
    ),
    Case(
        "oci-without-cache",
        VALID_LLMSERVICE,
        _all(_set("model.source", f"oci://registry.example.com/models/m@{DIGEST}"), _set("cache.strategy", "None")),
        "an oci:// source is staged by a Job into the cache",
    ),
    Case(
        "revision-on-oci",
        VALID_LLMSERVICE,
        _all(_set("model.source", f"oci://registry.example.com/models/m@{DIGEST}"), _set("model.revision", "v1")),
        "revision applies only to hf:// and modelscope:// sources",
    ),
    Case(
        "activation-timeout-too-long",
        VALID_LLMSERVICE,
        _set("scaling.activationTimeout", "2h"),
        "scaling.activationTimeout must be between 1s and 1h",
    ),
    Case(
        "inflight-ratio-without-max-seqs",
        VALID_LLMSERVICE,
        _set(
            "scaling.triggers",
            [{"signal": "InFlightRatio", "threshold": "0.8", "serverAddress": "http://prometheus.monitoring.svc:9090"}],
        ),
        "InFlightRatio needs maxConcurrentSequences",
    ),
    Case(
        "env-value-and-value-from",
        VALID_LLMSERVICE,
        _set("runtime.env", [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]),
        "set either value or valueFrom, not both",
    ),
    Case(
        "in-operator-without-values",
        VALID_LLMSERVICE,
        _set("runtime", {"selector": {"matchExpressions": [{"key": "engine", "operator": "In"}]}}),
        "In and NotIn need values",
    ),
    Case(
        "oci-without-digest",
        VALID_LLMSERVICE,
        _set("model.source", "oci://registry.example.com/models/m:latest"),
        "an oci:// source must pin a digest",
    ),
    Case(
        "hub-source-without-org",
        VALID_LLMSERVICE,
        _set("model.source", "hf://just-a-name"),
        "a hub source is hf://org/name or modelscope://org/name",
    ),
    Case(
        "unknown-source-scheme",
        VALID_LLMSERVICE,
        _set("model.source", "s3://bucket/model"),
        "spec.model.source",
        cel=False,
    ),
    Case(
        "custom-engine-without-command",
        VALID_RUNTIME,
        _set("engine", "custom"),
        "a custom engine needs a command or args",
    ),
    Case(
        "grace-shorter-than-drain",
        VALID_RUNTIME,
        _set("lifecycle", {"drainTimeout": "2m", "terminationGracePeriodSeconds": 60}),
        "terminationGracePeriodSeconds must be at least drainTimeout + 10 seconds",
    ),
    # Runtime volumes against Noctaya's own mounts (#20, item 6): each would make every backend
    # Deployment invalid. The first is what vLLM's own Kubernetes guide writes.
    Case(
        "volume-at-dev-shm",
        VALID_RUNTIME,
        _set("volumes", [{"name": "shm", "mountPath": "/dev/shm", "emptyDir": True, "readOnly": False}]),
        "a runtime volume cannot mount at /dev/shm: Noctaya mounts a memory-backed /dev/shm",
    ),
    Case(
        "volume-with-a-backstep",
        VALID_RUNTIME,
        _set("volumes", [{"name": "shm", "mountPath": "/dev/../dev/shm", "emptyDir": True, "readOnly": False}]),
        "spec.volumes[0].mountPath",
        cel=False,
    ),
    Case(
        "volume-at-dev-shm-with-a-trailing-slash",
        VALID_RUNTIME,
        _set("volumes", [{"name": "shm", "mountPath": "/dev/shm/", "emptyDir": True, "readOnly": False}]),
        "a runtime volume cannot mount at /dev/shm: Noctaya mounts a memory-backed /dev/shm",
    ),
    Case(
        "volume-at-cache-path",
        VALID_RUNTIME,
        _set("volumes", [{"name": "hf", "mountPath": "/cache", "emptyDir": True, "readOnly": False}]),
        "a runtime volume cannot mount at cacheMountPath or modelMountPath",
    ),
    Case(
        "volume-at-custom-model-path",
        VALID_RUNTIME,
        _all(_set("modelMountPath", "/weights/"),
             _set("volumes", [{"name": "w", "mountPath": "/weights", "hostPath": "/srv/weights"}])),
        "a runtime volume cannot mount at cacheMountPath or modelMountPath",
    ),
    Case(
        "volume-named-like-noctayas",
        VALID_RUNTIME,
        _set("volumes", [{"name": "model-cache", "mountPath": "/scratch", "emptyDir": True}]),
        "runtime volume names model-cache, model and dshm are Noctaya's own",
    ),
    Case(
        "two-volumes-one-name",
        VALID_RUNTIME,
        _set("volumes", [{"name": "tmp", "mountPath": "/tmp", "emptyDir": True},
                         {"name": "tmp", "mountPath": "/var/tmp", "emptyDir": True}]),
        "runtime volume names must be unique",
    ),
    Case(
        "two-volumes-one-path",
        VALID_RUNTIME,
        _set("volumes", [{"name": "a", "mountPath": "/tmp", "emptyDir": True},
                         {"name": "b", "mountPath": "/tmp", "configMap": "c"}]),
        "two runtime volumes cannot mount at the same path",
    ),
    Case(
        "cache-path-with-a-backstep",
        VALID_RUNTIME,
        _set("cacheMountPath", "/x/../cache"),
        "spec.cacheMountPath",
        cel=False,
    ),
    Case(
        "cache-path-is-the-root",
        VALID_RUNTIME,
        _set("cacheMountPath", "/./"),
        "cacheMountPath and modelMountPath cannot be the container's root directory /",
    ),
    Case(
        "cache-path-is-dev-shm",
        VALID_RUNTIME,
        _set("cacheMountPath", "/dev/shm"),
        "cacheMountPath, modelMountPath and /dev/shm must be three different paths",
    ),
    Case(
        "window-bad-cron",
        VALID_LLMSERVICE,
        _set("scaling", {"schedules": [{"start": "61 8 * * *", "end": "0 18 * * *"}]}),
        "schedules[].start must be a 5-field cron expression",
    ),
    Case(
        "window-four-fields",
        VALID_LLMSERVICE,
        _set("scaling", {"schedules": [{"start": "0 8 * *", "end": "0 18 * * *"}]}),
        "schedules[].start must be a 5-field cron expression",
    ),
    Case(
        "window-bad-end",
        VALID_LLMSERVICE,
        _set("scaling", {"schedules": [{"start": "0 8 * * *", "end": "0 18 * * MONDAYS"}]}),
        "schedules[].end must be a 5-field cron expression",
    ),
    Case(
        "window-start-is-end",
        VALID_LLMSERVICE,
        _set("scaling", {"schedules": [{"start": "0 8 * * *", "end": "0 8 * * *"}]}),
        "schedules[].start and end must differ",
    ),
    Case(
        "window-lead-too-long",
        VALID_LLMSERVICE,
        _set("scaling", {"schedules": [{"start": "0 8 * * *", "end": "0 18 * * *", "leadTime": "2h"}]}),
        "schedules[].leadTime must be auto or a duration up to 1h",
    ),
    Case(
        "window-more-replicas-than-max",
        VALID_LLMSERVICE,
        _set("scaling", {"max": 2, "schedules": [{"start": "0 8 * * *", "end": "0 18 * * *", "replicas": 3}]}),
        "scaling.schedules[].replicas must not exceed scaling.max",
    ),
    Case(
        "nine-windows",
        VALID_LLMSERVICE,
        _set("scaling", {"schedules": [{"start": f"0 {h} * * *", "end": f"30 {h} * * *"} for h in range(9)]}),
        "must have at most 8 items",
        cel=False,
    ),
    Case("unknown-engine", VALID_RUNTIME, _set("engine", "triton"), 'Unsupported value: "triton"', cel=False),
    Case(
        "unknown-vendor", VALID_RUNTIME, _set("accelerator", {"vendor": "tpu"}), 'Unsupported value: "tpu"', cel=False
    ),
]


@pytest.fixture(scope="module")
def validating(kube: ControlPlane, noctaya_crds: list[str]) -> ControlPlane:
    kube.kubectl("create", "namespace", NAMESPACE)
    return kube


def server_create(kube: ControlPlane, obj: dict[str, Any]) -> tuple[bool, str]:
    out = kube.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(obj), check=False)
    return out.returncode == 0, out.stderr + out.stdout


def model_for(obj: dict[str, Any]) -> type[pydantic.BaseModel]:
    return LLMService if obj["kind"] == "LLMService" else InferenceRuntime


@pytest.mark.parametrize("base", [VALID_LLMSERVICE, VALID_RUNTIME], ids=["llmservice", "inferenceruntime"])
def test_minimal_objects_are_accepted(validating: ControlPlane, base: dict[str, Any]) -> None:
    ok, output = server_create(validating, base)
    assert ok, output
    model_for(base).model_validate(base)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_object_is_rejected_with_a_readable_message(validating: ControlPlane, case: Case) -> None:
    obj = case.build()
    ok, output = server_create(validating, obj)
    assert not ok, f"the API server accepted invalid {case.id}: {output}"
    assert case.message in output, f"expected {case.message!r} in the API server's error:\n{output}"
    if case.cel:
        # The hooks parse with the same rule and must say the same thing.
        with pytest.raises(pydantic.ValidationError, match=re.escape(case.message)):
            model_for(obj).model_validate(obj)


# Accepted by the API server (CEL cannot read the time zone database or compare a range's ends), so
# the hooks refuse them: Ready=False InvalidSpec with this message, every child kept
# (tests/hooks/test_schedules.py).
HOOK_ONLY = [
    ({"start": "0 8 * * *", "end": "0 18 * * *", "timeZone": "Mars/Olympus"}, "is not an IANA time zone"),
    ({"start": "0 18-8 * * *", "end": "0 19 * * *"}, "range 18-8 runs backwards"),
    ({"start": "*/15 8 * * *", "end": "0 18 * * *", "leadTime": "5m"}, "cannot move start"),
    ({"start": "*/15 9-17 * * 1-5", "end": "0 18 * * 1-5"}, "fires 36 times before end"),
    ({"start": "30 3 * * *", "end": "0 18 * * *", "timeZone": "Europe/Berlin", "leadTime": "1h"}, "which does not exist"),
]


@pytest.mark.parametrize(("window", "message"), HOOK_ONLY, ids=["time-zone", "backwards-range", "unshiftable-lead",
                                                                 "start-fires-before-end", "lead-into-dst-gap"])
def test_what_cel_cannot_check_is_admitted_and_refused_by_the_hooks(validating: ControlPlane, window: dict[str, Any],
                                                                   message: str) -> None:
    obj = copy.deepcopy(VALID_LLMSERVICE)
    obj["spec"]["scaling"] = {"schedules": [window]}
    ok, output = server_create(validating, obj)
    assert ok, output
    with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
        LLMService.model_validate(obj)


def test_a_valid_window_is_admitted(validating: ControlPlane) -> None:
    eight = copy.deepcopy(VALID_LLMSERVICE)
    eight["spec"]["scaling"] = {"schedules": [{"start": f"0 {h} * * *", "end": f"30 {h} * * *"} for h in range(8)]}
    ok, output = server_create(validating, eight)
    assert ok, output  # the limit itself is admitted (nine are not: the nine-windows case)
    obj = copy.deepcopy(VALID_LLMSERVICE)
    obj["spec"]["scaling"] = {"max": 2, "schedules": [
        {"start": "0 8 * * MON-FRI", "end": "0 18 * * MON-FRI", "timeZone": "Europe/Berlin", "replicas": 2, "leadTime": "auto"},
        {"start": "0 9 1,15 jan-jun ?", "end": "59 23 1,15 jan-JUN ?", "leadTime": "0s"}]}
    ok, output = server_create(validating, obj)
    assert ok, output
    LLMService.model_validate(obj)
