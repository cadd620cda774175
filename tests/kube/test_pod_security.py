"""Every Pod the hooks render, for every example runtime (every vendor) and every cache strategy, is
admitted by the real API server's Pod Security admission in a namespace enforcing `baseline`; and
in one enforcing `restricted` wherever the project promises it (RESTRICTED below: the vLLM and SGLang
examples for NVIDIA and llama.cpp; BASELINE_ONLY says why the others are not).

The Pods are the rendered Deployments' templates, created with a server-side dry run (admission runs,
nothing is stored), as the ReplicaSet controller would create them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hooks.render import render_documents
from tests.kube.apiserver import ControlPlane
from tests.kube.manifests import EXAMPLES_DIR

pytestmark = pytest.mark.timeout(300, func_only=True)

RUNTIMES = sorted((EXAMPLES_DIR / "runtimes").glob("*.yaml"))
CACHES: dict[str, dict[str, Any]] = {
    "NodeLocalPVC": {"strategy": "NodeLocalPVC", "size": "20Gi"},
    "SharedPVC": {"strategy": "SharedPVC", "size": "20Gi"},
    "HostPath": {"strategy": "HostPath", "hostPath": "/var/lib/noctaya/models"},
    "None": {"strategy": "None"},
}
LEVELS = ("baseline", "restricted")


def runtime_doc(path: Path) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "InferenceRuntime"]
    return doc


def render_children(runtime: dict[str, Any], cache: str, multi: bool) -> list[dict[str, Any]]:
    vendor = runtime["spec"].get("accelerator", {}).get("vendor", "nvidia")
    service = {
        "apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "psa", "namespace": "psa"},
        "spec": {"model": {"source": "hf://org/model"}, "runtime": {"name": runtime["metadata"]["name"]},
                 "resources": {"accelerators": 0 if vendor == "none" else 1},
                 "cache": CACHES[cache], "endpoint": {"replicas": 2 if multi else 1}},
    }
    return render_documents([runtime, service])


def pods(runtime: dict[str, Any], cache: str, multi: bool) -> dict[str, dict[str, Any]]:
    """component -> a Pod built from each rendered Deployment's template."""
    out = {}
    for obj in render_children(runtime, cache, multi):
        if obj["kind"] == "Deployment":
            template = obj["spec"]["template"]
            component = template["metadata"]["labels"]["serving.noctaya.io/component"]
            out[component] = {"apiVersion": "v1", "kind": "Pod",
                              "metadata": {"name": f"psa-{component}", "labels": template["metadata"]["labels"]},
                              "spec": template["spec"]}
    return out


@pytest.fixture(scope="module")
def namespaces(kube: ControlPlane) -> dict[str, str]:
    """One namespace per level, enforcing it (and the `default` ServiceAccount Pods need)."""
    made = {}
    for level in LEVELS:
        name = f"psa-{level}"
        kube.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": level,
                                                  "pod-security.kubernetes.io/enforce-version": "latest"}}}))
        kube.kubectl("-n", name, "create", "serviceaccount", "default", check=False)
        # The gateway's own ServiceAccount, which the hooks render beside it (ServiceAccount admission
        # refuses a Pod naming one that does not exist; Metacontroller creates it with the Deployment).
        for account in accounts():
            kube.kubectl("-n", name, "apply", "--server-side", "-f", "-", stdin=json.dumps(account))
        made[level] = name
    return made


def accounts() -> list[dict[str, Any]]:
    """The ServiceAccounts rendered for the LLMService of `pods` (any runtime renders the same)."""
    found = [o for o in render_children(runtime_doc(RUNTIMES[0]), "None", multi=False) if o["kind"] == "ServiceAccount"]
    assert [o["metadata"]["name"] for o in found] == ["psa-gateway"]
    return [{**o, "metadata": {k: v for k, v in o["metadata"].items() if k != "namespace"}} for o in found]


def admitted(kube: ControlPlane, namespace: str, pod: dict[str, Any]) -> tuple[bool, str]:
    out = kube.kubectl("-n", namespace, "create", "--dry-run=server", "-o", "name", "-f", "-",
                       stdin=json.dumps(pod), check=False)
    return out.returncode == 0, out.stderr.strip()


# The promise per shipped runtime (docs/install.md, "Pod Security of the model namespaces", lists the
# same): `restricted` for these backends (any cache but HostPath) ...
RESTRICTED = {"llamacpp-cpu", "llamacpp-cpu-staged", "sglang-nvidia", "vllm-nvidia"}
# ... and `baseline` only for these, because their accelerator's device nodes belong to a host group
# whose gid differs between nodes, so the engine runs as the image's root user.
BASELINE_ONLY = {
    "vllm-amd-rocm": "ROCm's /dev/kfd and /dev/dri belong to the node's render group",
    "vllm-ascend": "the NPU devices and driver files belong to the node's HwHiAiUser group",
}


def test_every_shipped_runtime_has_a_promise_and_the_docs_list_the_exceptions() -> None:
    assert {p.stem for p in RUNTIMES} == RESTRICTED | set(BASELINE_ONLY)
    for path in RUNTIMES:
        assert runs_as_non_root(runtime_doc(path)) == (path.stem in RESTRICTED), path.stem
    docs = (EXAMPLES_DIR.parent / "docs" / "install.md").read_text(encoding="utf-8")
    section = docs[docs.index("### Pod Security of the model namespaces"):]
    section = section[:section.index("\n## ")]
    for name in (*RESTRICTED, *BASELINE_ONLY):
        assert f"`{name}`" in section, f"docs/install.md's Pod Security table does not name {name}"


def runs_as_non_root(runtime: dict[str, Any]) -> bool:
    return bool(runtime["spec"].get("security", {}).get("runAsUser"))


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("path", RUNTIMES, ids=lambda p: p.stem)
def test_rendered_pods_meet_the_pod_security_levels_promised(kube: ControlPlane, namespaces: dict[str, str],
                                                              path: Path, cache: str) -> None:
    runtime = runtime_doc(path)
    rendered = {**pods(runtime, cache, multi=False), **pods(runtime, cache, multi=True)}
    assert set(rendered) == {"backend", "gateway", "aggregator"}
    for component, pod in rendered.items():
        for level in LEVELS:
            ok, why = admitted(kube, namespaces[level], pod)
            if component != "backend":
                # Noctaya's own Pods run as a fixed non-root user with nothing to relax.
                assert ok, f"{component} refused by {level}: {why}"
            elif cache == "HostPath":
                # A node directory is what `baseline` forbids: HostPath caches need a privileged namespace.
                assert not ok and "hostPath" in why, f"{level}: {why or 'admitted'}"
            elif level == "baseline" or path.stem in RESTRICTED:
                assert ok, f"backend ({path.stem}, {cache}) refused by {level}: {why}"
            else:
                # An engine image that runs as root: the user is the only thing `restricted` objects to.
                assert not ok and "runAsNonRoot" in why, why
                assert "allowPrivilegeEscalation" not in why and "capabilities" not in why and "seccomp" not in why, why


def test_a_runtime_relaxing_capabilities_leaves_restricted_only_as_far_as_it_asks(
        kube: ControlPlane, namespaces: dict[str, str]) -> None:
    runtime = runtime_doc(EXAMPLES_DIR / "runtimes" / "llamacpp-cpu.yaml")
    runtime["spec"]["security"] = {"runAsUser": 1000, "addCapabilities": ["CHOWN"]}
    backend = pods(runtime, "None", multi=False)["backend"]
    ok, why = admitted(kube, namespaces["baseline"], backend)
    assert ok, why  # CHOWN is in the container runtime's default set, which baseline allows
    ok, why = admitted(kube, namespaces["restricted"], backend)
    assert not ok and "CHOWN" in why
    runtime["spec"]["security"] = {"runAsUser": 1000, "addCapabilities": ["IPC_LOCK"]}
    ok, why = admitted(kube, namespaces["baseline"], pods(runtime, "None", multi=False)["backend"])
    assert not ok and "IPC_LOCK" in why  # RDMA's pinned memory needs a privileged namespace


def prewarmed_pods(runtime: dict[str, Any], cache: str) -> dict[str, dict[str, Any]]:
    """The prewarm Job's Pod, and the backend Pod once that Job has succeeded (marker wait in front)."""
    from hooks.controller import sync
    from tests.hooks import helpers as h

    vendor = runtime["spec"].get("accelerator", {}).get("vendor", "nvidia")
    svc = h.llmservice(model={"source": "hf://org/model", "credentialsSecret": {"name": "hub-token"}},
                       runtime={"name": runtime["metadata"]["name"]},
                       resources={"accelerators": 0 if vendor == "none" else 1},
                       cache={**CACHES[cache], "prewarm": True})
    first = sync.sync(h.sync_request(svc, runtimes=[runtime]), h.config())
    observed = h.observed_with_jobs_complete(first)
    second = sync.sync(h.sync_request({**svc, "status": first["status"]}, runtimes=[runtime], children=observed), h.config())
    out = {}
    for obj in second["children"]:
        component = obj["metadata"]["labels"]["serving.noctaya.io/component"]
        if obj["kind"] in ("Job", "Deployment") and component in ("prewarm", "backend"):
            template = obj["spec"]["template"]
            out[component] = {"apiVersion": "v1", "kind": "Pod",
                              "metadata": {"name": f"psa-{component}", "labels": template["metadata"]["labels"]},
                              "spec": template["spec"]}
    return out


@pytest.mark.parametrize("cache", ["NodeLocalPVC", "SharedPVC", "HostPath"])
@pytest.mark.parametrize("path", RUNTIMES, ids=lambda p: p.stem)
def test_prewarm_job_and_staged_backend_meet_the_levels_promised(kube: ControlPlane, namespaces: dict[str, str],
                                                                  path: Path, cache: str) -> None:
    runtime = runtime_doc(path)
    rendered = prewarmed_pods(runtime, cache)
    assert set(rendered) == {"prewarm", "backend"}
    assert rendered["backend"]["spec"]["initContainers"][0]["name"] == "wait-for-weights"
    for component, pod in rendered.items():
        for level in LEVELS:
            ok, why = admitted(kube, namespaces[level], pod)
            if cache == "HostPath":
                assert not ok and "hostPath" in why, f"{component} {level}: {why or 'admitted'}"
            elif component == "prewarm" or level == "baseline" or path.stem in RESTRICTED:
                # The Job (and the marker wait) are Noctaya's image: restricted wherever the cache allows.
                assert ok, f"{component} ({path.stem}, {cache}) refused by {level}: {why}"
            else:
                assert not ok and "runAsNonRoot" in why and "wait-for-weights" not in why, why
