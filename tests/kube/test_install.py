"""The install manifests and every example, applied to a real API server with server-side apply.

`kubectl apply --server-side` validates strictly on the server: an unknown or misspelt field, a
wrong type, a failed CEL rule or a missing CRD fails the apply.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from hooks.app import HOOK_ROUTES
from hooks.version import RELEASE_IMAGE
from tests.kube.apiserver import ControlPlane
from tests.kube.manifests import METACONTROLLER_DIR, ApplyUnit, example_units, has_explicit_namespace

# Fixture setup (which may build the binaries) has its own deadlines; each test body gets this.
pytestmark = pytest.mark.timeout(180, func_only=True)

HOOK_HOST = "https://noctaya-hooks.noctaya-system.svc:8443"
EXAMPLES_NAMESPACE = "examples"


def get_json(kube: ControlPlane, *args: str) -> dict[str, Any]:
    return json.loads(kube.kubectl("get", "-o", "json", *args).stdout)


def test_noctaya_crds_are_established_and_structural(kube: ControlPlane, noctaya_crds: list[str]) -> None:
    assert sorted(noctaya_crds) == ["acceleratorpools.serving.noctaya.io", "inferenceruntimes.serving.noctaya.io",
                                    "llmgateways.serving.noctaya.io", "llmservices.serving.noctaya.io"]
    for name in noctaya_crds:
        crd = get_json(kube, "crd", name)
        conditions = {c["type"]: c for c in crd["status"]["conditions"]}
        assert conditions["Established"]["status"] == "True"
        assert conditions["NamesAccepted"]["status"] == "True"
        # The API server flags schemas it cannot prune or default as NonStructuralSchema.
        assert "NonStructuralSchema" not in conditions, conditions["NonStructuralSchema"]["message"]
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"] == {"status": {}}


def test_metacontroller_kustomization_installs_everything(installed: ControlPlane) -> None:
    names = installed.kubectl("get", "-k", str(METACONTROLLER_DIR), "-o", "name").stdout.split()
    assert set(names) >= {
        "namespace/noctaya-system",
        "customresourcedefinition.apiextensions.k8s.io/llmservices.serving.noctaya.io",
        "customresourcedefinition.apiextensions.k8s.io/inferenceruntimes.serving.noctaya.io",
        "compositecontroller.metacontroller.k8s.io/noctaya-llmservice",
        "compositecontroller.metacontroller.k8s.io/noctaya-inferenceruntime",
        "compositecontroller.metacontroller.k8s.io/noctaya-acceleratorpool",
        "customresourcedefinition.apiextensions.k8s.io/acceleratorpools.serving.noctaya.io",
        "compositecontroller.metacontroller.k8s.io/noctaya-llmgateway",
        "customresourcedefinition.apiextensions.k8s.io/llmgateways.serving.noctaya.io",
        "decoratorcontroller.metacontroller.k8s.io/noctaya-llmservice-autoscaling",
        "deployment.apps/noctaya-hooks",
        "service/noctaya-hooks",
        "poddisruptionbudget.policy/noctaya-hooks",
        "serviceaccount/noctaya-hooks",
        "clusterrole.rbac.authorization.k8s.io/noctaya-metacontroller",
        "clusterrolebinding.rbac.authorization.k8s.io/noctaya-metacontroller",
        # Bound per namespace only (metacontroller/llmgateway-namespace/), never by the install itself.
        "clusterrole.rbac.authorization.k8s.io/noctaya-metacontroller-llmgateway",
        # Bound by each gateway's own RoleBinding, which the hooks render in the gateway's namespace.
        "clusterrole.rbac.authorization.k8s.io/noctaya-gateway-endpoints",
    }


def _controller_hooks(installed: ControlPlane) -> list[dict[str, Any]]:
    """Every hook of every Noctaya controller as the API server stored it, with its URL path."""
    hooks: list[dict[str, Any]] = []
    for kind in ("compositecontrollers", "decoratorcontrollers"):
        for item in get_json(installed, kind)["items"]:
            for hook_name, hook in item["spec"]["hooks"].items():
                url = hook["webhook"]["url"]
                assert url.startswith(HOOK_HOST + "/"), f"{item['metadata']['name']}.{hook_name}: {url}"
                hooks.append(
                    {"controller": item["metadata"]["name"], "hook": hook_name, "path": url[len(HOOK_HOST) :], **hook}
                )
    return hooks


def test_controller_hooks_match_the_hook_server_routes(installed: ControlPlane) -> None:
    hooks = _controller_hooks(installed)
    by_path: dict[str, list[str]] = {}
    for hook in hooks:
        by_path.setdefault(hook["path"], []).append(f"{hook['controller']}.{hook['hook']}")
    # Every route the hook server serves is called by a controller hook, and no hook points at a
    # path the server does not serve.
    assert sorted(by_path) == sorted(route.path for route in HOOK_ROUTES)
    # Only the decorator's finalize shares a route: its sync function answers `finalizing: true`.
    shared = {path: sorted(users) for path, users in by_path.items() if len(users) > 1}
    assert shared == {
        "/v1/llmservice/autoscaling/sync": [
            "noctaya-llmservice-autoscaling.finalize",
            "noctaya-llmservice-autoscaling.sync",
        ]
    }
    for hook in hooks:
        # v2 on every hook: v1 drops the cluster-scoped InferenceRuntime seen from a namespaced parent.
        assert hook["version"] == "v2", hook
        auth = hook["webhook"]["authorization"]
        assert auth["type"] == "Bearer"
        assert auth["secretRef"] == {"name": "noctaya-hooks", "namespace": "noctaya-system", "key": "hook-token"}
        # HTTPS only, verified against the hook server's own CA.
        assert hook["webhook"]["url"].startswith("https://"), hook
        assert hook["webhook"]["caBundle"] == {"secretRef": {"name": "noctaya-hooks-tls", "namespace": "noctaya-system",
                                                             "key": "ca.crt"}}
    composite = {h["hook"] for h in hooks if h["controller"] == "noctaya-llmservice"}
    assert composite == {"customize", "sync", "finalize"}


def test_llmservice_controller_children_and_update_strategies(installed: ControlPlane) -> None:
    spec = get_json(installed, "compositecontroller", "noctaya-llmservice")["spec"]
    assert spec["generateSelector"] is True
    assert spec["parentResource"] == {"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "llmservices"}
    strategies = {(c["apiVersion"], c["resource"]): c["updateStrategy"]["method"] for c in spec["childResources"]}
    assert strategies == {
        ("apps/v1", "deployments"): "InPlace",
        ("v1", "services"): "InPlace",
        ("v1", "secrets"): "InPlace",
        ("policy/v1", "poddisruptionbudgets"): "InPlace",
        ("v1", "persistentvolumeclaims"): "OnDelete",
        ("batch/v1", "jobs"): "OnDelete",
        # The gateway's identity: the hooks render it only while both are listed (hooks.controller.observe).
        ("v1", "serviceaccounts"): "InPlace",
        ("rbac.authorization.k8s.io/v1", "rolebindings"): "InPlace",
    }
    # KEDA is optional at install time: a missing child CRD would stop this whole controller.
    assert not any(c["apiVersion"].startswith("keda.sh/") for c in spec["childResources"])

    decorator = get_json(installed, "decoratorcontroller", "noctaya-llmservice-autoscaling")["spec"]
    assert decorator["resources"] == [{"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "llmservices"}]
    assert decorator["attachments"] == [
        {"apiVersion": "keda.sh/v1alpha1", "resource": "scaledobjects", "updateStrategy": {"method": "InPlace"}}
    ]
    runtime = get_json(installed, "compositecontroller", "noctaya-inferenceruntime")["spec"]
    assert runtime["parentResource"]["resource"] == "inferenceruntimes"
    assert not runtime.get("childResources"), "the InferenceRuntime controller is passive"


def test_hook_server_deployment_is_hardened(installed: ControlPlane) -> None:
    deploy = get_json(installed, "-n", "noctaya-system", "deployment", "noctaya-hooks")
    assert deploy["spec"]["replicas"] == 2
    pod = deploy["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "hooks", "serve"]
    assert container["image"] == RELEASE_IMAGE
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert {"name": "https", "containerPort": 8443, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NOCTAYA_HOOK_TLS_CERT_FILE"] == "/etc/noctaya/tls/tls.crt"
    assert {"name": "tls", "secret": {"secretName": "noctaya-hooks-tls", "defaultMode": 0o440}} in pod["volumes"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert "memory" in container["resources"]["limits"]

    pdb = get_json(installed, "-n", "noctaya-system", "pdb", "noctaya-hooks")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == deploy["spec"]["selector"]
    svc = get_json(installed, "-n", "noctaya-system", "service", "noctaya-hooks")
    assert svc["spec"]["ports"] == [{"name": "https", "port": 8443, "protocol": "TCP", "targetPort": "https"}]
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]


# What Metacontroller may do (and the hook server may not): tests/kube/test_rbac.py.


@pytest.fixture(scope="module")
def examples_namespace(installed: ControlPlane) -> str:
    installed.kubectl("create", "namespace", EXAMPLES_NAMESPACE)
    return EXAMPLES_NAMESPACE


@pytest.mark.parametrize("unit", example_units(), ids=lambda u: u.label)
def test_example_applies_server_side(installed: ControlPlane, examples_namespace: str, unit: ApplyUnit) -> None:
    ns_args = [] if has_explicit_namespace(unit) else ["-n", examples_namespace]
    out = installed.kubectl("apply", "--server-side", *ns_args, *unit.kubectl_args())
    applied = [line for line in out.stdout.splitlines() if "serverside-applied" in line]
    assert applied, f"{unit.label} applied nothing: {out.stdout}"


def pod_from_template(workload: dict[str, Any], namespace: str) -> dict[str, Any]:
    """The Pod a Deployment's template produces, for admission checks without a controller."""
    template = workload["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": workload["metadata"]["name"],
            "namespace": namespace,
            "labels": template["metadata"].get("labels", {}),
        },
        "spec": template["spec"],
    }


def test_hook_server_pod_passes_restricted_pod_security(installed: ControlPlane) -> None:
    """noctaya-system enforces Pod Security `restricted`; the API server's PodSecurity admission
    (and ServiceAccount admission) judge the hook server's Pod on a server-side dry-run."""
    ns = get_json(installed, "namespace", "noctaya-system")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    deploy = get_json(installed, "-n", "noctaya-system", "deployment", "noctaya-hooks")
    pod = pod_from_template(deploy, "noctaya-system")
    out = installed.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(pod), check=False)
    assert out.returncode == 0, out.stderr
    assert "violate" not in out.stderr, out.stderr
