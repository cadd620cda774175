"""LocalPods plays the kubelet's projected service-account token (tests/e2e/pods.py): a Pod template
naming a ServiceAccount whose token is automounted gets a token for it from the TokenRequest API, the
API server's CA and its namespace, as a process of Noctaya's image reads them in a cluster
(``python -m tests.e2e.whoami`` asks the API server who it is with them)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.e2e.cluster import Cluster
from tests.e2e.pods import TOKEN_SECONDS, LocalPods

pytestmark = pytest.mark.timeout(120)

NAMESPACE = "e2e-credentials"


@pytest.fixture(scope="module")
def namespace(cluster: Cluster) -> Iterator[str]:
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("-n", NAMESPACE, "create", "serviceaccount", "gateway")
    cluster.kubectl("-n", NAMESPACE, "apply", "--server-side", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "no-automount"},
        "automountServiceAccountToken": False}))
    yield NAMESPACE
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def deployment(cluster: Cluster, name: str, **pod_spec: Any) -> None:
    """A Deployment at 0 replicas (kwok runs none of its Pods; LocalPods runs the processes) whose
    container runs tests/e2e/whoami.py as Noctaya's image would run a module."""
    cluster.kubectl("-n", NAMESPACE, "apply", "--server-side", "-f", "-", stdin=json.dumps({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": {
                     "containers": [{"name": "main", "image": "noctaya:test",
                                     "command": ["python", "-m", "tests.e2e.whoami"]}], **pod_spec}}}}))


def said(cluster: Cluster, process: str, timeout: float = 30.0) -> str:
    """The first line the process printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = cluster.log_tail(process).splitlines()
        if lines:
            return lines[0]
        time.sleep(0.2)
    raise AssertionError(f"{process} printed nothing within {timeout}s")


def test_a_pod_with_a_service_account_gets_its_token_and_the_kubelets_env(cluster: Cluster, namespace: str) -> None:
    deployment(cluster, "whoami-sa", serviceAccountName="gateway", automountServiceAccountToken=True)
    pods = LocalPods(cluster, namespace, "whoami-sa").start(1)
    try:
        assert said(cluster, "whoami-sa-0") == f"user system:serviceaccount:{namespace}:gateway namespace {namespace}"
        (token,) = pods._tokens
        assert {p.name for p in token.directory.iterdir() if not p.name.startswith("..")} == \
            {"token", "ca.crt", "namespace"}
        # Renewed as the kubelet renews it: not while fresh, once 80 % of its lifetime has passed.
        assert pods.renew_tokens() == 0 and token.renewals == 0
        assert pods.renew_tokens(at=time.monotonic() + TOKEN_SECONDS) == 1 and token.renewals == 1
        renewed = (token.directory / "token").read_text()
        review = requests.post(f"{cluster.plane.url}/apis/authentication.k8s.io/v1/selfsubjectreviews",
                               json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
                               headers={"Authorization": f"Bearer {renewed}"},
                               verify=str(token.directory / "ca.crt"), timeout=10)
        assert review.json()["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:gateway"
    finally:
        pods.stop()


@pytest.mark.parametrize(("name", "pod_spec"), [
    ("whoami-none", {}),
    ("whoami-off", {"serviceAccountName": "gateway", "automountServiceAccountToken": False}),
    ("whoami-sa-off", {"serviceAccountName": "no-automount"}),
], ids=["no-service-account", "automount-false", "service-account-says-no"])
def test_no_credentials_without_an_automounted_service_account(cluster: Cluster, namespace: str, name: str,
                                                               pod_spec: dict[str, Any]) -> None:
    deployment(cluster, name, **pod_spec)
    pods = LocalPods(cluster, namespace, name).start(1)
    try:
        assert said(cluster, f"{name}-0") == "no credentials"
        assert pods._tokens == []
    finally:
        pods.stop()


def test_a_missing_service_account_keeps_the_pod_from_starting(cluster: Cluster, namespace: str) -> None:
    deployment(cluster, "whoami-missing", serviceAccountName="nobody", automountServiceAccountToken=True)
    pods = LocalPods(cluster, namespace, "whoami-missing")
    pods.service_account_wait = 2.0
    with pytest.raises(AssertionError, match=f"serviceaccount {namespace}/nobody does not exist"):
        pods.start(1)
