"""The example alerting and recording rules, checked by Prometheus's own promtool (built from the
Prometheus Go module pinned in tools/kube-testenv/versions.env, cached outside the repository):
`promtool check rules` on the rule groups of the PrometheusRule, and `promtool test rules` feeding
series through the recording rules to check the accelerator-hours and cold-start numbers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.kube.apiserver import KubeUnavailable
from tests.kube.gobuild import promtool_binary
from tests.kube.manifests import EXAMPLES_DIR, load_documents

RULES = EXAMPLES_DIR / "observability" / "prometheusrule.yaml"


@pytest.fixture(scope="module")
def promtool() -> Path:
    try:
        return promtool_binary()
    except KubeUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def rule_file(tmp_path: Path) -> Path:
    (doc,) = load_documents(RULES)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}, sort_keys=False))
    return path


def test_promtool_accepts_every_rule(promtool: Path, rule_file: Path) -> None:
    result = subprocess.run([str(promtool), "check", "rules", str(rule_file)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def run_promtool_tests(promtool: Path, rule_file: Path, tmp_path: Path, series: str, *,
                       checks: list[dict[str, object]] | None = None, alerts: list[dict[str, object]] | None = None) -> None:
    """`promtool test rules` over ``series`` (one sample a minute): PromQL ``checks``
    (promql_expr_test) and ``alerts`` (alert_rule_test)."""
    test: dict[str, object] = {"interval": "1m", "input_series": yaml.safe_load(series)}
    if checks:
        test["promql_expr_test"] = checks
    if alerts:
        test["alert_rule_test"] = alerts
    tests = {"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": [test]}
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([str(promtool), "test", "rules", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


# A model with 2 accelerators per replica, scaled to zero for the first 12 hours and at one replica
# for the next 12, with two cold starts (8 s and 40 s) timed by its gateway.
SERIES = """
- series: 'kube_deployment_status_replicas{namespace="models", deployment="qwen-backend"}'
  values: '0x719 1x720'
- series: 'kube_deployment_status_replicas{namespace="models", deployment="unrelated-backend"}'
  values: '3x1439'
- series: 'noctaya_gateway_backend_accelerators_per_replica{namespace="models", llmservice="qwen", pod="qwen-gateway-a"}'
  values: '2x1439'
- series: 'noctaya_gateway_activation_duration_seconds_count{namespace="models", llmservice="qwen", pod="qwen-gateway-a"}'
  values: '0x600 1x400 2x438'
- series: 'noctaya_gateway_activation_duration_seconds_bucket{namespace="models", llmservice="qwen", pod="qwen-gateway-a", le="10.0"}'
  values: '0x600 1x838'
- series: 'noctaya_gateway_activation_duration_seconds_bucket{namespace="models", llmservice="qwen", pod="qwen-gateway-a", le="60.0"}'
  values: '0x600 1x400 2x438'
- series: 'noctaya_gateway_activation_duration_seconds_bucket{namespace="models", llmservice="qwen", pod="qwen-gateway-a", le="+Inf"}'
  values: '0x600 1x400 2x438'
"""


def test_recording_rules_compute_accelerator_hours_and_cold_starts(promtool: Path, rule_file: Path,
                                                                    tmp_path: Path) -> None:
    at = "1439m"
    run_promtool_tests(promtool, rule_file, tmp_path, SERIES, checks=[
        {"expr": "llmservice:noctaya_accelerators_held:max", "eval_time": "100m",
         "exp_samples": [{"labels": 'llmservice:noctaya_accelerators_held:max{namespace="models", llmservice="qwen"}', "value": 0}]},
        {"expr": "llmservice:noctaya_accelerators_always_on:max", "eval_time": "100m",
         "exp_samples": [{"labels": 'llmservice:noctaya_accelerators_always_on:max{namespace="models", llmservice="qwen"}', "value": 2}]},
        {"expr": "llmservice:noctaya_accelerators_held:max", "eval_time": "1000m",
         "exp_samples": [{"labels": 'llmservice:noctaya_accelerators_held:max{namespace="models", llmservice="qwen"}', "value": 2}]},
        # 24 h: 12 h at 2 accelerators held (24 accelerator-hours); min=1 would have held 48.
        {"expr": "round(llmservice:noctaya_accelerator_hours_held:24h)", "eval_time": at,
         "exp_samples": [{"labels": '{namespace="models", llmservice="qwen"}', "value": 24}]},
        {"expr": "round(llmservice:noctaya_accelerator_hours_saved:24h)", "eval_time": at,
         "exp_samples": [{"labels": '{namespace="models", llmservice="qwen"}', "value": 24}]},
        {"expr": "round(llmservice:noctaya_cold_starts:24h)", "eval_time": at,
         "exp_samples": [{"labels": '{namespace="models", llmservice="qwen"}', "value": 2}]},
        {"expr": "llmservice:noctaya_cold_start_seconds:p50_24h <= 10", "eval_time": at,
         "exp_samples": [{"labels": 'llmservice:noctaya_cold_start_seconds:p50_24h{namespace="models", llmservice="qwen"}', "value": 10}]},
        # p95 of {8 s, 40 s} from buckets 10 / 60: 10 + (1.9 - 1) × 50 = 55.
        {"expr": "round(llmservice:noctaya_cold_start_seconds:p95_24h)", "eval_time": at,
         "exp_samples": [{"labels": '{namespace="models", llmservice="qwen"}', "value": 55}]},
    ])


# Accelerator-hours of series shorter than 24 h and with gaps, evaluated at 1439m (a window holding
# minutes 0..1439): each model has 2 accelerators per replica.
PARTIAL_DAY = """
# Created 12 h ago (minute 720) and at one replica since: 12 h x 2 = 24 accelerator-hours, not 48.
- series: 'kube_deployment_status_replicas{namespace="models", deployment="young-backend"}'
  values: '_x720 1x719'
- series: 'noctaya_gateway_backend_accelerators_per_replica{namespace="models", llmservice="young", pod="young-gateway-a"}'
  values: '_x720 2x719'
# Created 12 h ago and at zero since: holds nothing; min 1 would have held 24.
- series: 'kube_deployment_status_replicas{namespace="models", deployment="idle-backend"}'
  values: '_x720 0x719'
- series: 'noctaya_gateway_backend_accelerators_per_replica{namespace="models", llmservice="idle", pod="idle-gateway-a"}'
  values: '_x720 2x719'
# One replica all day, but kube-state-metrics was not scraped from minute 360 to 719 (stale, then
# nothing): the 6 h without a value count as nothing, 18 h x 2 = 36.
- series: 'kube_deployment_status_replicas{namespace="models", deployment="gappy-backend"}'
  values: '1x359 stale _x359 1x719'
- series: 'noctaya_gateway_backend_accelerators_per_replica{namespace="models", llmservice="gappy", pod="gappy-gateway-a"}'
  values: '2x1439'
# One replica all day with two missed scrapes (no stale marker): bridged by the lookback, 24 h x 2 = 48.
- series: 'kube_deployment_status_replicas{namespace="models", deployment="blip-backend"}'
  values: '1x599 _ _ 1x837'
- series: 'noctaya_gateway_backend_accelerators_per_replica{namespace="models", llmservice="blip", pod="blip-gateway-a"}'
  values: '2x1439'
# Deleted 6 h ago (minute 1080): held 18 h x 2 = 36 over the last 24 h, as min 1 would have.
- series: 'kube_deployment_status_replicas{namespace="models", deployment="gone-backend"}'
  values: '1x1079 stale'
- series: 'noctaya_gateway_backend_accelerators_per_replica{namespace="models", llmservice="gone", pod="gone-gateway-a"}'
  values: '2x1079 stale'
"""




def test_accelerator_hours_count_only_the_minutes_with_a_value(promtool: Path, rule_file: Path,
                                                               tmp_path: Path) -> None:
    expected = {"young": (24, 0), "idle": (0, 24), "gappy": (36, 0), "blip": (48, 0), "gone": (36, 0)}
    checks: list[dict[str, object]] = []
    for record, column in (("llmservice:noctaya_accelerator_hours_held:24h", 0),
                           ("llmservice:noctaya_accelerator_hours_saved:24h", 1)):
        checks.append({"expr": f"{record} * 1000", "eval_time": "1439m", "exp_samples": [
            {"labels": f'{{namespace="models", llmservice="{name}"}}', "value": hours[column] * 1000}
            for name, hours in expected.items()]})
    # Half-way through the young model's first day: 6 h held so far, 12 accelerator-hours.
    checks.append({"expr": 'llmservice:noctaya_accelerator_hours_held:24h{llmservice="young"}', "eval_time": "1079m",
                   "exp_samples": [{"labels": 'llmservice:noctaya_accelerator_hours_held:24h{namespace="models", llmservice="young"}',
                                    "value": 12}]})
    run_promtool_tests(promtool, rule_file, tmp_path, PARTIAL_DAY, checks=checks)


# Certificate expiry, evaluated around minute 120 (promtool's clock starts at Unix time 0). The hook
# server's two replicas serve certificates whose notAfter lies 21 days + 2 h and 60 days after time 0
# (the alert takes the earlier one, replica a's), a model's scaler one 7 days + 2 h after: at 120m the
# first is exactly 21 days away and the second exactly 7, the limits, which do not fire; a minute later
# both do. A shared gateway's scaler certificate, far from expiry, never fires.
DAY = 86400
EXPIRY_SERIES = f"""
- series: 'noctaya_tls_certificate_not_after_timestamp_seconds{{namespace="noctaya-system", pod="noctaya-hooks-a", role="hooks"}}'
  values: '{21 * DAY + 7200}x180'
- series: 'noctaya_tls_certificate_not_after_timestamp_seconds{{namespace="noctaya-system", pod="noctaya-hooks-b", role="hooks"}}'
  values: '{60 * DAY}x180'
- series: 'noctaya_tls_certificate_not_after_timestamp_seconds{{namespace="models", llmservice="qwen", pod="qwen-gateway-a", role="scaler"}}'
  values: '{7 * DAY + 7200}x180'
- series: 'noctaya_tls_certificate_not_after_timestamp_seconds{{namespace="models", llmgateway="front", pod="front-llmgw-a", model="", role="scaler"}}'
  values: '{90 * DAY}x180'
"""
RENEW = ("Renew its Secret (hooks: noctaya-hooks-tls, `tools/make-hook-cert.sh` or cert-manager; scaler and report: "
         "the LLMService's spec.scalerTLS.secretName); the process loads it without a restart. See \"Certificates: "
         "rotation and expiry\" in docs/install.md.")


def expiry_alert(severity: str, namespace: str, role: str, left: str, llmservice: str | None = None) -> dict[str, object]:
    labels = {"severity": severity, "namespace": namespace, "role": role}
    served = role
    if llmservice:
        labels["llmservice"] = llmservice
        served += f", LLMService {llmservice}"
    if severity == "warning":
        description = f"A certificate Noctaya serves ({served}) expires within 21 days. {RENEW}"
    else:
        description = (f"A certificate Noctaya serves ({served}) expires within 7 days. When it does, Metacontroller's "
                       "hook calls (hooks) or KEDA's scaler calls and the gateways' demand reports (scaler, report) "
                       "fail. Renew its Secret now (docs/install.md, \"Certificates: rotation and expiry\"); if it "
                       "was renewed and this still fires, the process refused the new files: its log says why.")
    return {"exp_labels": labels, "exp_annotations": {
        "summary": f"{namespace}: the {role} certificate expires in {left}", "description": description}}


def test_certificate_expiry_alerts_fire_past_21_and_7_days_and_not_at_the_limit(promtool: Path, rule_file: Path,
                                                                                   tmp_path: Path) -> None:
    soon, very_soon = "NoctayaCertificateExpiresSoon", "NoctayaCertificateExpiresVerySoon"
    cases = [
        (soon, "119m", [expiry_alert("warning", "models", "scaler", "7d 0h 1m 0s", "qwen")]),
        (soon, "120m", [expiry_alert("warning", "models", "scaler", "7d 0h 0m 0s", "qwen")]),
        (soon, "121m", [expiry_alert("warning", "noctaya-system", "hooks", "20d 23h 59m 0s"),
                        expiry_alert("warning", "models", "scaler", "6d 23h 59m 0s", "qwen")]),
        (very_soon, "119m", []),
        (very_soon, "120m", []),
        (very_soon, "121m", [expiry_alert("critical", "models", "scaler", "6d 23h 59m 0s", "qwen")]),
    ]
    run_promtool_tests(promtool, rule_file, tmp_path, EXPIRY_SERIES, alerts=[
        {"alertname": name, "eval_time": at, "exp_alerts": alerts} for name, at, alerts in cases])
