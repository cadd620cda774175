"""Every object the hooks render passes the real API server's own validation (server-side dry-run
create): the children in each golden fixture's expected response, and the children `python -m hooks
render` produces for every example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.apiserver import REPO_ROOT, ControlPlane
from tests.kube.manifests import EXAMPLES_DIR, load_documents

pytestmark = pytest.mark.timeout(180, func_only=True)

FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures" / "hooks"
RENDER_FIXTURE = FIXTURES_DIR / "render" / "expected.yaml"
# What the LLMService examples need rendered: the runtimes they name, and the models themselves.
RENDERED_EXAMPLES = [EXAMPLES_DIR / "runtimes", EXAMPLES_DIR / "models", EXAMPLES_DIR / "security" / "scaler-mtls.yaml"]


def rendered_objects(response: dict[str, Any]) -> list[dict[str, Any]]:
    """Children of a CompositeController response, attachments of a DecoratorController response."""
    return [*(response.get("children") or []), *(response.get("attachments") or [])]


def golden_cases() -> list[Path]:
    """Fixture directories whose expected response renders objects (customize and finished
    finalize responses have none)."""
    cases = sorted(p.parent for p in FIXTURES_DIR.glob("*/expected.json"))
    return [c for c in cases if rendered_objects(json.loads((c / "expected.json").read_text()))]


def parent_namespace(request: dict[str, Any]) -> str | None:
    parent = request.get("parent") or request.get("object") or {}
    return parent.get("metadata", {}).get("namespace")


@pytest.fixture(scope="module")
def cluster(kube: ControlPlane, third_party_crds: list[str], noctaya_crds: list[str]) -> ControlPlane:
    """CRDs of Noctaya and of the child types (KEDA ScaledObject) installed."""
    return kube


def ensure_namespaces(kube: ControlPlane, objects: list[dict[str, Any]]) -> None:
    wanted = sorted({o["metadata"].get("namespace") for o in objects} - {None})
    existing = set(kube.kubectl("get", "namespaces", "-o", "name").stdout.split())
    for ns in wanted:
        if f"namespace/{ns}" not in existing:
            kube.kubectl("create", "namespace", ns)


def dry_run_create(kube: ControlPlane, objects: list[dict[str, Any]], what: str) -> None:
    ensure_namespaces(kube, objects)
    listing = {"apiVersion": "v1", "kind": "List", "items": objects}
    out = kube.kubectl("create", "--dry-run=server", "-o", "name", "-f", "-", stdin=json.dumps(listing), check=False)
    assert out.returncode == 0, f"{what}: the API server rejected a rendered object:\n{out.stderr}"
    created = out.stdout.split()
    assert len(created) == len(objects), f"{what}: {len(objects)} objects, server answered {created}"


def test_golden_fixtures_render_children() -> None:
    kinds = {o["kind"] for c in golden_cases() for o in rendered_objects(json.loads((c / "expected.json").read_text()))}
    # The dry-run below covers every child kind the hooks render.
    assert {"Deployment", "Service", "Secret", "PodDisruptionBudget", "PersistentVolumeClaim", "ScaledObject",
            "ServiceAccount", "RoleBinding"} <= kinds


@pytest.mark.parametrize("case", golden_cases(), ids=lambda p: p.name)
def test_golden_fixture_children_pass_server_side_dry_run(cluster: ControlPlane, case: Path) -> None:
    request = json.loads((case / "request.json").read_text())
    response = json.loads((case / "expected.json").read_text())
    objects = rendered_objects(response)
    namespace = parent_namespace(request)
    for obj in objects:
        # Metacontroller puts a child in the parent's namespace when the hook leaves it out.
        if namespace is not None:
            obj["metadata"].setdefault("namespace", namespace)
    dry_run_create(cluster, objects, case.name)


def test_render_fixture_children_pass_server_side_dry_run(cluster: ControlPlane) -> None:
    if not RENDER_FIXTURE.exists():
        pytest.skip(f"{RENDER_FIXTURE} not present")
    objects = load_documents(RENDER_FIXTURE)
    assert objects
    dry_run_create(cluster, objects, str(RENDER_FIXTURE.relative_to(REPO_ROOT)))


def test_rendered_examples_pass_server_side_dry_run(cluster: ControlPlane) -> None:
    """`python -m hooks render` over the examples (as a user runs it), then a dry-run of its output."""
    out = subprocess.run(
        [sys.executable, "-m", "hooks", "render", *map(str, RENDERED_EXAMPLES)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    objects = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ScaledObject"} <= kinds, kinds
    # Every LLMService example renders something.
    models = [
        d
        for p in RENDERED_EXAMPLES
        for f in ([p] if p.is_file() else sorted(p.glob("*.yaml")))
        for d in load_documents(f)
        if d.get("kind") == "LLMService"
    ]
    rendered_for = {o["metadata"].get("labels", {}).get("serving.noctaya.io/llmservice") for o in objects}
    assert {m["metadata"]["name"] for m in models} <= rendered_for
    dry_run_create(cluster, objects, "python -m hooks render examples/...")


RESTRICTED_NAMESPACE = "restricted-pods"
# Components that run Noctaya's own image: their Pods must meet Pod Security `restricted`.
NOCTAYA_COMPONENTS = ("gateway", "aggregator")


def noctaya_deployments() -> list[tuple[str, dict[str, Any]]]:
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for case in golden_cases():
        for obj in rendered_objects(json.loads((case / "expected.json").read_text())):
            component = obj["metadata"].get("labels", {}).get("serving.noctaya.io/component")
            if obj["kind"] == "Deployment" and component in NOCTAYA_COMPONENTS:
                # One per distinct pod spec is enough; the fixtures repeat the same shapes.
                found.setdefault(json.dumps(obj["spec"]["template"], sort_keys=True), (case.name, obj))
    return sorted(found.values(), key=lambda item: (item[0], item[1]["metadata"]["name"]))


@pytest.fixture(scope="module")
def restricted_namespace(cluster: ControlPlane) -> str:
    ns = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": RESTRICTED_NAMESPACE, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}},
    }
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(ns))
    # No controller-manager here: create the `default` ServiceAccount ServiceAccount admission wants.
    cluster.kubectl("create", "-n", RESTRICTED_NAMESPACE, "serviceaccount", "default")
    return RESTRICTED_NAMESPACE


def test_noctaya_pods_are_found_in_the_fixtures() -> None:
    components = {obj["metadata"]["labels"]["serving.noctaya.io/component"] for _, obj in noctaya_deployments()}
    assert components == set(NOCTAYA_COMPONENTS)


@pytest.mark.parametrize("item", noctaya_deployments(), ids=lambda i: f"{i[0]}-{i[1]['metadata']['name']}")
def test_gateway_and_aggregator_pods_pass_restricted_pod_security(
    cluster: ControlPlane, restricted_namespace: str, item: tuple[str, dict[str, Any]]
) -> None:
    case, deployment = item
    template = deployment["spec"]["template"]
    account = template["spec"].get("serviceAccountName")
    if account is not None:
        # The gateway's own ServiceAccount, a child of the same answer (Metacontroller creates it with
        # the Deployment): ServiceAccount admission refuses a Pod naming one that does not exist.
        children = rendered_objects(json.loads((FIXTURES_DIR / case / "expected.json").read_text()))
        assert ("ServiceAccount", account) in {(o["kind"], o["metadata"]["name"]) for o in children}, case
        cluster.kubectl("-n", restricted_namespace, "create", "serviceaccount", account, check=False)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": deployment["metadata"]["name"],
            "namespace": restricted_namespace,
            "labels": template["metadata"].get("labels", {}),
        },
        "spec": template["spec"],
    }
    out = cluster.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(pod), check=False)
    assert out.returncode == 0, out.stderr
