"""Every rendered child is a valid object of its Kubernetes kind; the ScaledObject matches KEDA's CRD."""

from __future__ import annotations

import pytest

from hooks.controller import autoscaling, sync
from tests.hooks import helpers as h
from tests.hooks import schemas
from tests.hooks.golden_cases import CASES


def test_walkers_catch_mistakes() -> None:
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {}, "template": {"spec": {"containers": [{"name": "c", "imagePullPolicyy": "Always"}]}}}}
    assert any("imagePullPolicyy" in p for p in schemas.child_problems(bad))
    schema = schemas.load_crd_schema()
    so = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {},
          "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "external-push", "metadata": {"a": 1}}],
                   "cooldownPeriod": "5m", "fallbak": {}}}
    problems = schemas.openapi_problems(so, schema)
    assert any("cooldownPeriod" in p for p in problems)
    assert any("fallbak" in p for p in problems)
    assert any("metadata.a" in p for p in problems)


@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c]()[0] in ("sync", "finalize")))
def test_children_are_valid_kubernetes_objects(case: str) -> None:
    hook, request = CASES[case]()
    answer = sync.sync(request, h.config())
    for child in answer["children"]:
        assert schemas.child_problems(child) == [], (case, child["kind"], child["metadata"]["name"])


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"scalerTLS": {"secretName": "tls", "triggerAuthentication": "keda-tls"}, "endpoint": {"replicas": 2}},
        {"scaling": {"min": 2, "max": 9, "cooldownPeriod": "2h", "pollingInterval": "1m30s", "triggers": [
            {"signal": "KVCacheUsage", "threshold": "0.9", "serverAddress": "https://prom:9090"},
            {"signal": "WaitingRequests", "threshold": "3", "serverAddress": "http://prom:9090", "query": "sum(x)"},
            {"signal": "InFlightRatio", "threshold": "0.5", "maxConcurrentSequences": 256, "serverAddress": "http://prom:9090"},
        ]}},
    ],
    ids=["defaults", "tls", "leading-signals"],
)
def test_scaled_object_matches_keda_crd(spec: dict) -> None:
    answer = autoscaling.sync(h.decorator_request(h.llmservice(**spec)), h.config())
    (so,) = answer["attachments"]
    assert schemas.openapi_problems(so, schemas.load_crd_schema()) == []
    window = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    assert window == min(so["spec"]["cooldownPeriod"], 3600)
    assert "fallback" not in so["spec"]  # deliberate: hold replicas while the scaler is unreachable
