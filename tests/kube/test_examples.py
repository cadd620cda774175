"""The examples as the hooks and Prometheus read them (no API server needed): every LLMService and
InferenceRuntime parses with the pydantic models, runtimes named by models exist, and every Noctaya
metric the alerts and the dashboard query is one the programs really export."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import REJECTION_REASONS, GatewayMetrics
from hooks.api import InferenceRuntime, LLMService
from hooks.api.llmgateway import LLMGateway
from hooks.metrics import HookMetrics
from tests.kube.manifests import EXAMPLES_DIR, example_documents, load_documents

OBSERVABILITY_DIR = EXAMPLES_DIR / "observability"


def _id(item: tuple[Path, dict[str, Any]]) -> str:
    path, doc = item
    return f"{path.relative_to(EXAMPLES_DIR)}:{doc['metadata']['name']}"


@pytest.mark.parametrize("item", example_documents("LLMService"), ids=_id)
def test_llmservice_example_parses_with_the_model(item: tuple[Path, dict[str, Any]]) -> None:
    _path, doc = item
    LLMService.model_validate({**doc, "metadata": {**doc["metadata"], "namespace": "examples"}})


@pytest.mark.parametrize("item", example_documents("LLMGateway"), ids=_id)
def test_llmgateway_example_parses_and_its_members_and_key_scopes_are_in_the_same_file(
        item: tuple[Path, dict[str, Any]]) -> None:
    path, doc = item
    gateway = LLMGateway.model_validate({**doc, "metadata": {**doc["metadata"], "namespace": "examples"}})
    members = [LLMService.model_validate({**d, "metadata": {**d["metadata"], "namespace": "examples"}})
               for d in load_documents(path) if d.get("kind") == "LLMService"]
    served = {m.served_name for m in members if m.spec.endpoint.gateway == gateway.metadata.name}
    assert len(served) >= 3, f"{path.name}: an LLMGateway example shows several models behind one endpoint"
    for key in gateway.spec.api_keys:
        assert set(key.models) <= served, f"{path.name}: a key scoped to a model the example does not define"


@pytest.mark.parametrize("item", example_documents("InferenceRuntime"), ids=_id)
def test_runtime_example_parses_with_the_model(item: tuple[Path, dict[str, Any]]) -> None:
    InferenceRuntime.model_validate(item[1])


def test_examples_cover_every_vendor_family_and_model_source() -> None:
    runtimes = [InferenceRuntime.model_validate(d) for _, d in example_documents("InferenceRuntime")]
    assert {"nvidia", "amd", "none"} <= {r.spec.accelerator.vendor for r in runtimes}
    assert {"ascend", "intel-gaudi"} & {r.spec.accelerator.vendor for r in runtimes}
    assert {"vllm", "sglang", "llamacpp"} <= {r.spec.engine for r in runtimes}
    services = [LLMService.model_validate(d) for _, d in example_documents("LLMService")]
    assert {"hf", "oci", "pvc"} <= {s.spec.model.parsed.scheme for s in services}
    assert any(s.spec.scaling.min == 0 for s in services) and any(s.spec.scaling.min >= 1 for s in services)
    assert any(s.spec.endpoint.replicas > 1 for s in services)
    assert any(s.spec.cache.strategy == "SharedPVC" and s.spec.cache.prewarm for s in services)
    assert any(s.spec.endpoint.auth is not None for s in services)
    assert any(s.spec.scaling.triggers for s in services)
    assert any(s.spec.scaler_tls is not None for s in services)


def test_models_name_runtimes_that_exist_in_the_examples() -> None:
    runtimes = {d["metadata"]["name"]: d for _, d in example_documents("InferenceRuntime")}
    for path, doc in example_documents("LLMService"):
        ref = doc["spec"]["runtime"]
        if "name" in ref:
            assert ref["name"] in runtimes, f"{path.name}: runtime {ref['name']} is not among the examples"
        else:
            want = ref["selector"].get("matchLabels", {})
            matches = [n for n, r in runtimes.items() if want.items() <= r["metadata"].get("labels", {}).items()]
            assert matches, f"{path.name}: the runtime selector matches no example runtime"


# kube-state-metrics series the rules and dashboard read (names as its docs/metrics/workload pages
# list them; its Go module is not served here, so the list is kept by hand and kept short).
KUBE_STATE_METRICS = frozenset({
    "kube_deployment_spec_replicas", "kube_deployment_status_replicas", "kube_deployment_status_replicas_ready",
    "kube_job_failed", "kube_job_labels",
})
# PromQL words that look like names: aggregations, keywords (functions are told by their "(").
PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                          "unless", "offset", "atan2", "Inf", "NaN"})


def metric_names_in(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (label matchers, grouping labels, ranges,
    strings and function names taken out first)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", e):
        if m.group(2) is None and m.group(1) not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def recorded_names() -> set[str]:
    (doc,) = load_documents(OBSERVABILITY_DIR / "prometheusrule.yaml")
    return {r["record"] for g in doc["spec"]["groups"] for r in g["rules"] if "record" in r}


def test_metric_name_extraction() -> None:
    assert metric_names_in('histogram_quantile(0.5, sum by (le, phase) (rate(a_b_bucket{x="y{z}"}[$__range])))') == {"a_b_bucket"}
    assert metric_names_in('max by (ns) (label_replace(k{d=~".+"}, "l", "$1", "d", "(.+)")) * on (ns) group_left (l) m > 0') \
        == {"k", "m"}
    assert metric_names_in("avg_over_time(rec:a:max[24h]) * 24 - on (namespace) rec:b:24h") == {"rec:a:max", "rec:b:24h"}


def exported_metric_names() -> set[str]:
    """Sample names the gateway and hook server expose (counters with _total, histogram series; the
    certificate-expiry gauge, which the hook server and aggregate scaler export too, from a gateway)."""
    gateway = GatewayMetrics()
    gateway.count_response(200)
    for reason in REJECTION_REASONS:
        gateway.reject(reason)
    gateway.activation_duration.observe(1)
    gateway.ttfb.observe(0.1)
    gateway.pod.mark_scaler_certificate(2e9)  # exported with scaler TLS only
    hooks = HookMetrics()
    hooks.prime(["llmservice_sync"])
    hooks.observe_pool("example", None, {"yielding": [{"scaledObject": "ns/a-backend", "for": "ns/c-backend-0"}]})
    names: set[str] = set()
    for registry in (gateway.registry, hooks.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names |= {sample.name for sample in family.samples}
    return names


def queried_metric_names() -> dict[str, str]:
    """Every metric name in the rules and dashboard queries, mapped to where it appears first."""
    found: dict[str, str] = {}
    for doc in load_documents(OBSERVABILITY_DIR / "prometheusrule.yaml"):
        for group in doc["spec"]["groups"]:
            for rule in group["rules"]:
                for name in metric_names_in(rule["expr"]):
                    found.setdefault(name, f"rule {rule.get('alert') or rule.get('record')}")
    dashboard = json.loads((OBSERVABILITY_DIR / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name in metric_names_in(target["expr"]):
                found.setdefault(name, f"panel {panel['title']}")
    return found


def test_alerts_and_dashboard_query_exported_metrics() -> None:
    exported = exported_metric_names()
    queried = queried_metric_names()
    assert len(queried) >= 8
    known = exported | recorded_names() | KUBE_STATE_METRICS
    unknown = {name: where for name, where in queried.items() if name not in known}
    assert not unknown, f"queried but never exported: {unknown}; exported: {sorted(exported)}"
    assert {n for n in queried if n.startswith("noctaya_")} <= exported


def test_alerts_cover_the_operational_failures() -> None:
    (rule_doc,) = load_documents(OBSERVABILITY_DIR / "prometheusrule.yaml")
    alerts = {r["alert"]: r for g in rule_doc["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {"NoctayaActivationTimeouts", "NoctayaHigh429Rate", "NoctayaPrewarmFailed", "NoctayaStuckActivating"} <= set(
        alerts
    )
    assert 'reason="activation_timeout"' in alerts["NoctayaActivationTimeouts"]["expr"]
    assert "activation_timeout" in REJECTION_REASONS
    assert 'code="429"' in alerts["NoctayaHigh429Rate"]["expr"]
    for alert in alerts.values():
        assert alert["annotations"]["summary"] and alert["labels"]["severity"]


def test_dashboard_shows_queue_in_flight_activation_and_replicas() -> None:
    dashboard = json.loads((OBSERVABILITY_DIR / "grafana-dashboard.json").read_text())
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in dashboard["panels"]}
    assert "noctaya_gateway_queue_depth" in exprs["Queue depth"]
    assert "noctaya_gateway_in_flight" in exprs["In flight"]
    assert "noctaya_gateway_activation_duration_seconds_bucket" in exprs["Activation time"]
    assert "kube_deployment_status_replicas_ready" in exprs["Backend replicas"]
    assert "noctaya_gateway_activation_phase_seconds_bucket" in exprs["Where a cold start's time goes (p50 per phase)"]
    assert "llmservice:noctaya_accelerator_hours_saved:24h" in exprs["Accelerator-hours per day: held and saved by scale-to-zero"]
    assert "llmservice:noctaya_cold_start_seconds:p95_24h" in exprs["Cold starts per day and their total (p50 / p95)"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "llmservice"} <= variables


def _egress_ports(policy: dict[str, Any]) -> set[tuple[int | str, str]]:
    return {(p["port"], p.get("protocol", "TCP")) for rule in policy["spec"].get("egress") or []
            for p in rule.get("ports") or []}


def test_network_policies_give_serving_pods_dns_only_and_the_prewarm_job_https() -> None:
    policies = {d["metadata"]["name"]: d for d in load_documents(EXAMPLES_DIR / "security" / "network-policies.yaml")}
    dns = {(53, "UDP"), (53, "TCP")}
    backend = policies["noctaya-backend"]
    assert backend["spec"]["podSelector"]["matchLabels"] == {"serving.noctaya.io/component": "backend"}
    assert "Egress" in backend["spec"]["policyTypes"] and _egress_ports(backend) == dns
    for rule in backend["spec"]["egress"]:  # DNS to the cluster's resolver only, nowhere else
        assert rule["to"][0]["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
    prewarm = policies["noctaya-prewarm-egress"]
    assert prewarm["spec"]["podSelector"]["matchLabels"] == {"serving.noctaya.io/component": "prewarm"}
    assert _egress_ports(prewarm) == dns | {(443, "TCP")}
    assert "ingress" not in prewarm["spec"] and "Ingress" in prewarm["spec"]["policyTypes"]  # nothing reaches it
    # The opt-in for a model that downloads at start-up is scoped to one LLMService's backends.
    download = policies["noctaya-backend-download-qwen-7b"]
    assert set(download["spec"]["podSelector"]["matchLabels"]) == {"serving.noctaya.io/llmservice",
                                                                   "serving.noctaya.io/component"}
    assert _egress_ports(download) == {(443, "TCP")}
    # Gateways reach the API server (their EndpointSlice watch) at one address the user sets, nowhere else.
    kube_api = policies["noctaya-gateway-kube-api"]
    assert kube_api["spec"]["podSelector"]["matchLabels"] == {"serving.noctaya.io/component": "gateway"}
    assert kube_api["spec"]["policyTypes"] == ["Egress"]
    assert _egress_ports(kube_api) == {(6443, "TCP"), (443, "TCP")}
    for rule in kube_api["spec"]["egress"]:
        assert [peer["ipBlock"]["cidr"].endswith("/32") for peer in rule["to"]] == [True], rule
    # No other policy opens egress beyond DNS and Noctaya's own ports.
    for name, policy in policies.items():
        if name not in ("noctaya-prewarm-egress", "noctaya-backend-download-qwen-7b", "noctaya-gateway-kube-api"):
            assert (443, "TCP") not in _egress_ports(policy), name
