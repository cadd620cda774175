"""The AcceleratorPool's install on a real API server: its passive controller as stored, the RBAC it
needs (and nothing beyond: it reads Nodes, it never changes one), and the example pools."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.kube.apiserver import ControlPlane
from tests.kube.manifests import EXAMPLES_DIR

pytestmark = pytest.mark.timeout(180, func_only=True)

HOOK_HOST = "https://noctaya-hooks.noctaya-system.svc:8443"
METACONTROLLER_SA = "system:serviceaccount:metacontroller:metacontroller"


def get_json(kube: ControlPlane, *args: str) -> dict[str, Any]:
    return json.loads(kube.kubectl("get", "-o", "json", *args).stdout)


def can(kube: ControlPlane, verb: str, resource: str) -> bool:
    # `kubectl auth can-i VERB TYPE/NAME` reads the part after the slash as an object's name: a
    # subresource goes in --subresource.
    kind, _, sub = resource.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    out = kube.kubectl("auth", "can-i", verb, kind, *extra, "-A", f"--as={METACONTROLLER_SA}", check=False)
    return out.stdout.strip() == "yes"


def test_the_pool_controller_is_passive_with_customize_and_sync(installed: ControlPlane) -> None:
    spec = get_json(installed, "compositecontroller", "noctaya-acceleratorpool")["spec"]
    assert spec["generateSelector"] is True
    assert spec["parentResource"] == {"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "acceleratorpools"}
    assert not spec.get("childResources"), "the pool writes only its status"
    assert {name: hook["webhook"]["url"] for name, hook in spec["hooks"].items()} == {
        "customize": f"{HOOK_HOST}/v1/acceleratorpool/customize",
        "sync": f"{HOOK_HOST}/v1/acceleratorpool/sync",
    }
    assert {hook["version"] for hook in spec["hooks"].values()} == {"v2"}


@pytest.mark.parametrize("verb,resource", [
    ("list", "nodes"), ("watch", "nodes"), ("get", "nodes"),
    ("list", "acceleratorpools.serving.noctaya.io"), ("watch", "acceleratorpools.serving.noctaya.io"),
    ("update", "acceleratorpools.serving.noctaya.io"),
    ("update", "acceleratorpools.serving.noctaya.io/status"), ("patch", "acceleratorpools.serving.noctaya.io/status"),
    ("watch", "pods"), ("watch", "scaledobjects.keda.sh"),
])
def test_rbac_lets_metacontroller_run_pools(installed: ControlPlane, verb: str, resource: str) -> None:
    assert can(installed, verb, resource), f"{METACONTROLLER_SA} cannot {verb} {resource}"


@pytest.mark.parametrize("verb,resource", [
    ("update", "nodes"), ("patch", "nodes"), ("delete", "nodes"), ("update", "nodes/status"),
    ("create", "acceleratorpools.serving.noctaya.io"), ("delete", "acceleratorpools.serving.noctaya.io"),
    ("update", "acceleratorpools.serving.noctaya.io/finalizers"),
])
def test_rbac_grants_the_pool_nothing_more(installed: ControlPlane, verb: str, resource: str) -> None:
    assert not can(installed, verb, resource), f"{METACONTROLLER_SA} may {verb} {resource}"


def test_example_pools_apply_and_print_their_columns(installed: ControlPlane) -> None:
    for path in sorted((EXAMPLES_DIR / "pools").glob("*.yaml")):
        installed.kubectl("apply", "--server-side", "-f", str(path))
    names = {item["metadata"]["name"]: item["spec"]["resourceName"] for item in get_json(installed, "accpool")["items"]}
    assert names == {"nvidia-gpu": "nvidia.com/gpu", "amd-gpu": "amd.com/gpu"}
    header = installed.kubectl("get", "accpool").stdout.splitlines()[0].split()
    assert header[:2] == ["NAME", "RESOURCE"]
