"""The Helm chart (charts/noctaya): generated from the kustomize install, linted and rendered by a
real helm (built from its Go module), and its output applied server-side to the test API server."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.apiserver import REPO_ROOT, ControlPlane, KubeUnavailable
from tests.kube.gobuild import helm_binary

CHART = REPO_ROOT / "charts" / "noctaya"
NAMESPACE = "noctaya-system"


def test_chart_is_generated_from_the_kustomize_install() -> None:
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "chart" / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, f"charts/noctaya is stale: run `make chart`\n{out.stderr}"


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return helm_binary()
    except KubeUnavailable as exc:
        pytest.skip(str(exc))


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    home = helm.parent.parent / "home"  # helm's cache/config/data dirs, inside the build cache
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
    out = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, check=False, env=env)
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{out.stderr}{out.stdout}")
    return out


# What `helm install` users set (the chart generates the hook Secrets once); the tests of other values
# render on top of it. A render without it or existing Secrets fails by design (see the GitOps tests).
GENERATE = ("--set", "hooks.generateSecrets=true")
# What a GitOps render sets instead: Secrets created outside the chart (by hand, cert-manager, ...).
EXISTING = ("--set", "hooks.existingSecret=noctaya-hooks", "--set", "hooks.tls.existingSecret=noctaya-hooks-tls")


def template(helm: Path, *values: str) -> list[dict[str, Any]]:
    out = run_helm(helm, "template", "noctaya", str(CHART), "--namespace", NAMESPACE, "--include-crds", *GENERATE,
                   *values)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_helm_lint_passes_and_the_schema_refuses_bad_values(helm: Path) -> None:
    # helm lint treats `fail` as a note, so the defaults lint clean although they do not render.
    for values in ((), GENERATE, EXISTING):
        run_helm(helm, "lint", "--strict", str(CHART), *values)
    for bad in ("hooks.replicas=0", "image.pullPolicy=Sometimes", "unknownKey=1", "clusterDomain=Corp_Example",
                "imagePullSecrets[0].name=Bad_Name", "hooks.tolerations[0].operator=Maybe",
                "hooks.affinity.nodeSelector.a=b", "hooks.resources.request.cpu=1", "hooks.generateSecrets=maybe"):
        out = run_helm(helm, "lint", str(CHART), *EXISTING, "--set", bad, check=False)
        assert out.returncode != 0, f"--set {bad} was accepted"
        assert "values don't meet the specifications of the schema" in out.stdout + out.stderr, out.stdout


def test_helm_template_renders_exactly_the_kustomize_install(helm: Path, kube: ControlPlane) -> None:
    chart = by_key(template(helm))
    kustomized = by_key([d for d in yaml.safe_load_all(kube.kubectl("kustomize", str(REPO_ROOT / "metacontroller")).stdout) if d])
    secret = chart.pop(("Secret", "noctaya-hooks"))
    tls = chart.pop(("Secret", "noctaya-hooks-tls"))
    kustomized.pop(("Namespace", NAMESPACE))  # the release namespace (helm --create-namespace)
    assert set(chart) == set(kustomized)
    for key, obj in kustomized.items():
        assert json.dumps(chart[key], sort_keys=True) == json.dumps(obj, sort_keys=True), f"{key} differs"
    # The generated hook Secret: both keys, random, kept on uninstall.
    assert set(secret["data"]) == {"hook-token", "token-key"}
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    again = by_key(template(helm))[("Secret", "noctaya-hooks")]
    assert again["data"]["hook-token"] != secret["data"]["hook-token"]  # random (no cluster to look up)
    # The generated serving certificate: for the Service Metacontroller dials, signed by ca.crt.
    assert tls["type"] == "kubernetes.io/tls" and set(tls["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert tls["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    cert = base64.b64decode(tls["data"]["tls.crt"])
    text = subprocess.run(["openssl", "x509", "-noout", "-text"], input=cert, capture_output=True, check=True,
                          timeout=30).stdout.decode()
    assert f"DNS:noctaya-hooks.{NAMESPACE}.svc" in text
    with tempfile.TemporaryDirectory() as work:
        Path(work, "ca.crt").write_bytes(base64.b64decode(tls["data"]["ca.crt"]))
        Path(work, "tls.crt").write_bytes(cert)
        verified = subprocess.run(["openssl", "verify", "-CAfile", "ca.crt", "tls.crt"], cwd=work, capture_output=True,
                                  timeout=30)
        assert verified.returncode == 0, verified.stderr


def test_values_change_only_what_they_name(helm: Path) -> None:
    docs = by_key(template(helm, "--set", "image.tag=9.9.9", "--set", "hooks.existingSecret=my-hooks",
                           "--set", "hooks.tls.existingSecret=my-tls",
                           "--set", "hooks.replicas=3", "--set", "metacontroller.serviceAccount.namespace=mc"))
    assert ("Secret", "noctaya-hooks") not in docs  # the user's Secret is used, none generated
    hooks = docs[("Deployment", "noctaya-hooks")]
    assert hooks["spec"]["replicas"] == 3
    container = hooks["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/noctaya/noctaya:9.9.9"
    assert {"name": "NOCTAYA_IMAGE", "value": "ghcr.io/noctaya/noctaya:9.9.9"} in container["env"]
    assert hooks["spec"]["template"]["spec"]["volumes"][1]["secret"]["secretName"] == "my-hooks"
    assert ("Secret", "noctaya-hooks-tls") not in docs
    assert hooks["spec"]["template"]["spec"]["volumes"][2]["secret"]["secretName"] == "my-tls"
    controller = docs[("CompositeController", "noctaya-llmservice")]
    assert controller["spec"]["hooks"]["sync"]["webhook"]["authorization"]["secretRef"]["name"] == "my-hooks"
    assert controller["spec"]["hooks"]["sync"]["webhook"]["caBundle"]["secretRef"]["name"] == "my-tls"
    binding = docs[("ClusterRoleBinding", "noctaya-metacontroller")]
    assert binding["subjects"][0]["namespace"] == "mc"


def test_llmgateway_namespaces_get_the_rolebinding_users_apply_by_hand(helm: Path, kube: ControlPlane, tmp_path: Path) -> None:
    """`llmGateway.namespaces` renders, in each, exactly what `kubectl apply -n <ns> -f
    metacontroller/llmgateway-namespace/rolebinding.yaml` creates (docs/install.md), and nothing else."""
    assert effect(helm, tmp_path, {"llmGateway": {"namespaces": ["models"]}}) == {
        "RoleBinding/noctaya-llmgateway": (None, "present")}
    rendered = [d for d in template(helm, "--set", "llmGateway.namespaces={models,team-a}") if d["kind"] == "RoleBinding"]
    by_hand = [json.loads(kube.kubectl("create", "--dry-run=client", "-o", "json", "-n", ns, "-f",
                                       str(REPO_ROOT / "metacontroller" / "llmgateway-namespace" / "rolebinding.yaml")).stdout)
               for ns in ("models", "team-a")]
    assert [json.dumps(d, sort_keys=True) for d in rendered] == [json.dumps(d, sort_keys=True) for d in by_hand]
    # The subject follows the ServiceAccount Metacontroller runs as, like the ClusterRoleBinding's.
    moved = by_key(template(helm, "--set", "llmGateway.namespaces={models}", "--set", "metacontroller.serviceAccount.namespace=mc",
                           "--set", "metacontroller.serviceAccount.name=mctl"))
    subject = {"kind": "ServiceAccount", "name": "mctl", "namespace": "mc"}
    assert moved[("RoleBinding", "noctaya-llmgateway")]["subjects"] == [subject]
    assert moved[("ClusterRoleBinding", "noctaya-metacontroller")]["subjects"] == [subject]
    for bad in ("llmGateway.namespaces={Models}", "llmGateway.namespaces={a,a}", "llmGateway.other=1"):
        assert run_helm(helm, "lint", str(CHART), "--set", bad, check=False).returncode != 0, f"--set {bad} was accepted"


def test_every_value_is_documented() -> None:
    """docs/install.md's values table names every value of the schema (objects with fixed keys are
    followed down; `a.b.c` / `.d` in one row documents a.b.d)."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def leaves(node: dict[str, Any], path: str) -> list[str]:
        if "required" not in node:  # a value given whole: resources, affinity, a list
            return [path]
        return [p for key, child in node["properties"].items() for p in leaves(child, f"{path}.{key}" if path else key)]

    text = (REPO_ROOT / "docs" / "install.md").read_text()
    section = text[text.index("### Or with Helm"):text.index("## 4.")]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for path in leaves(schema, ""):
        parent, _, last = path.rpartition(".")
        assert any(f"`{path}`" in row or (parent and f"`{parent}." in row and f"`.{last}`" in row) for row in rows), (
            f"the values table in docs/install.md does not name {path}")


def flatten(node: Any, path: str = "") -> dict[str, Any]:
    """Leaf paths of an object; list items that all have a `name` are addressed by it (env[NOCTAYA_IMAGE])."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{path}.{key}" if path else key))
        return out or {path: {}}
    if isinstance(node, list):
        named = all(isinstance(v, dict) and "name" in v for v in node) and len({v["name"] for v in node}) == len(node)
        out = {}
        for index, value in enumerate(node):
            out.update(flatten(value, f"{path}[{value['name'] if named else index}]"))
        return out or {path: []}
    return {path: node}


def effect(helm: Path, tmp_path: Path, values: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """What a values file changes against the defaults: `Kind/name: path` -> (default, with it); a whole
    object that appears or goes away is `Kind/name` -> (None, "present") or ("present", None). The
    random generated Secrets are left out."""
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump(values))

    def rendered(*args: str) -> dict[str, dict[str, Any]]:
        return {f"{kind}/{name}": flatten(doc) for (kind, name), doc in by_key(template(helm, *args)).items()
                if kind != "Secret"}

    base, other = rendered(), rendered("--values", str(file))
    changes: dict[str, tuple[Any, Any]] = {}
    for key in base.keys() | other.keys():
        if key not in other or key not in base:
            changes[key] = ("present" if key in base else None, "present" if key in other else None)
            continue
        for path in base[key].keys() | other[key].keys():
            if base[key].get(path) != other[key].get(path):
                changes[f"{key}: {path}"] = (base[key].get(path), other[key].get(path))
    return changes


POD = "Deployment/noctaya-hooks: spec.template.spec"
CONTAINER = f"{POD}.containers[hooks]"


def test_image_pull_policy_reaches_the_hook_server_and_what_it_renders(helm: Path, tmp_path: Path) -> None:
    assert effect(helm, tmp_path, {"image": {"pullPolicy": "Always"}}) == {
        f"{CONTAINER}.imagePullPolicy": ("IfNotPresent", "Always"),
        f"{CONTAINER}.env[NOCTAYA_IMAGE_PULL_POLICY].value": ("IfNotPresent", "Always"),
    }


def test_one_hook_replica_has_no_disruption_budget(helm: Path, tmp_path: Path) -> None:
    # minAvailable: 1 over one replica would refuse every eviction: the node could never be drained.
    assert effect(helm, tmp_path, {"hooks": {"replicas": 1}}) == {
        "Deployment/noctaya-hooks: spec.replicas": (2, 1),
        "PodDisruptionBudget/noctaya-hooks": ("present", None),
    }
    assert effect(helm, tmp_path, {"hooks": {"replicas": 3}}) == {"Deployment/noctaya-hooks: spec.replicas": (2, 3)}
    pdb = by_key(template(helm, "--set", "hooks.replicas=3"))[("PodDisruptionBudget", "noctaya-hooks")]
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "noctaya-hooks"}}}


def test_hook_server_resources(helm: Path, tmp_path: Path) -> None:
    assert effect(helm, tmp_path, {"hooks": {"resources": {"requests": {"cpu": "50m"}, "limits": {"cpu": 2, "memory": "1Gi"}}}}) == {
        f"{CONTAINER}.resources.requests.cpu": ("100m", "50m"),
        f"{CONTAINER}.resources.limits.cpu": (None, 2),
        f"{CONTAINER}.resources.limits.memory": ("512Mi", "1Gi"),
    }


def test_hook_server_placement(helm: Path, tmp_path: Path) -> None:
    assert effect(helm, tmp_path, {"hooks": {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}}) == {
        f"{POD}.nodeSelector.node-role.kubernetes.io/control-plane": (None, ""),
    }
    toleration = {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}
    assert effect(helm, tmp_path, {"hooks": {"tolerations": [toleration]}}) == {
        f"{POD}.tolerations[0].{k}": (None, v) for k, v in toleration.items()
    }
    # Node affinity adds to the default spread over nodes ...
    term = {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]}]}
    node_affinity = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    prefix = f"{POD}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0]"
    assert effect(helm, tmp_path, {"hooks": {"affinity": {"nodeAffinity": node_affinity}}}) == {
        f"{prefix}.key": (None, "kubernetes.io/arch"), f"{prefix}.operator": (None, "In"), f"{prefix}.values[0]": (None, "arm64"),
    }
    # ... and null removes that spread (then the whole affinity, which is empty).
    removed = effect(helm, tmp_path, {"hooks": {"affinity": {"podAntiAffinity": None}}})
    assert removed and all(path.startswith(f"{POD}.affinity.podAntiAffinity.") and new is None
                           for path, (_, new) in removed.items())
    docs = by_key(template(helm, "--values", str(tmp_path / "values.yaml")))
    assert "affinity" not in docs[("Deployment", "noctaya-hooks")]["spec"]["template"]["spec"]


def test_image_pull_secrets_for_a_private_mirror(helm: Path, tmp_path: Path) -> None:
    assert effect(helm, tmp_path, {"imagePullSecrets": [{"name": "mirror-pull"}, {"name": "fallback"}]}) == {
        f"{POD}.imagePullSecrets[mirror-pull].name": (None, "mirror-pull"),
        f"{POD}.imagePullSecrets[fallback].name": (None, "fallback"),
    }


def test_cluster_domain_reaches_the_hooks_and_the_certificate(helm: Path, tmp_path: Path) -> None:
    assert effect(helm, tmp_path, {"clusterDomain": "corp.example"}) == {
        f"{CONTAINER}.env[NOCTAYA_CLUSTER_DOMAIN].value": ("cluster.local", "corp.example"),
    }
    tls = by_key(template(helm, "--set", "clusterDomain=corp.example"))[("Secret", "noctaya-hooks-tls")]
    text = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName"], input=base64.b64decode(tls["data"]["tls.crt"]),
                          capture_output=True, check=True, timeout=30).stdout.decode()
    assert f"DNS:noctaya-hooks.{NAMESPACE}.svc, DNS:noctaya-hooks.{NAMESPACE}.svc.corp.example" in text
    assert "cluster.local" not in text


def test_the_hooks_render_with_what_the_chart_sets(helm: Path) -> None:
    """The env the chart gives the hook server, read the way the hook server reads it, changes what the
    hooks render: the scaler addresses in the cluster domain, the pull policy of Noctaya's containers."""
    from hooks.config import HookConfig
    from hooks.render import render_documents
    from tests.kube.manifests import EXAMPLES_DIR, load_documents

    hooks = by_key(template(helm, "--set", "clusterDomain=corp.example", "--set", "image.pullPolicy=Always",
                            "--set", "image.tag=9.9.9"))[("Deployment", "noctaya-hooks")]
    env = {e["name"]: e["value"] for e in hooks["spec"]["template"]["spec"]["containers"][0]["env"]}
    env.pop("NOCTAYA_TOKEN_KEY_FILE")  # a file in the Pod
    inputs = load_documents(EXAMPLES_DIR / "runtimes" / "vllm-nvidia.yaml") + load_documents(
        EXAMPLES_DIR / "models" / "multi-gateway.yaml")
    for doc in inputs:
        if doc["kind"] == "LLMService":
            doc["metadata"].setdefault("namespace", "models")
    text = json.dumps(render_documents(inputs, HookConfig.from_env(env)))
    assert ".svc.corp.example" in text and "cluster.local" not in text
    ours = [c for doc in render_documents(inputs, HookConfig.from_env(env)) if doc["kind"] == "Deployment"
            for c in doc["spec"]["template"]["spec"]["containers"] if c["image"] == "ghcr.io/noctaya/noctaya:9.9.9"]
    assert ours and all(c["imagePullPolicy"] == "Always" for c in ours)


def test_helm_output_applies_server_side(helm: Path, installed: ControlPlane) -> None:
    other = "noctaya-helm"
    installed.kubectl("create", "namespace", other, check=False)
    out = run_helm(helm, "template", "noctaya", str(CHART), "--namespace", other, "--include-crds", *GENERATE).stdout
    installed.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=helm-chart-test",
                      "--force-conflicts", "-n", other, "-f", "-", stdin=out)
    assert f"noctaya-hooks.{other}.svc" in out


def test_install_upgrade_uninstall_keeps_the_hook_secret(helm: Path) -> None:
    """A real `helm install` / `upgrade` / `uninstall` on an API server of its own (the session's already
    holds the kustomize install, whose cluster-scoped objects helm would refuse to adopt)."""
    from tests.kube.apiserver import ensure_binaries
    from tests.third_party import metacontroller_crds

    crds = metacontroller_crds()
    if not crds:
        pytest.skip("Metacontroller's CRDs are not available (a copy of shared/ beside the clone provides them)")
    plane = ControlPlane(ensure_binaries())
    plane.start()
    try:
        plane.kubectl("apply", "--server-side", *[a for c in crds for a in ("-f", str(c))])
        plane.kubectl("wait", "--for=condition=Established", "--timeout=90s", "crd/compositecontrollers.metacontroller.k8s.io",
                      "crd/decoratorcontrollers.metacontroller.k8s.io")
        common = ["--kubeconfig", str(plane.kubeconfig), "--namespace", NAMESPACE]

        def secret() -> dict[str, str]:
            return json.loads(plane.kubectl("-n", NAMESPACE, "get", "secret", "noctaya-hooks", "-o", "json").stdout)["data"]

        def tls() -> dict[str, str]:
            return json.loads(plane.kubectl("-n", NAMESPACE, "get", "secret", "noctaya-hooks-tls", "-o", "json").stdout)["data"]

        refused = run_helm(helm, "install", "noctaya", str(CHART), "--create-namespace", "--wait=false", *common,
                           check=False)
        assert refused.returncode != 0 and "hooks.generateSecrets=true" in refused.stderr  # nothing to reuse yet
        run_helm(helm, "install", "noctaya", str(CHART), "--create-namespace", "--wait=false", *GENERATE, *common)
        first, first_tls = secret(), tls()
        assert set(first) == {"hook-token", "token-key"}
        metacontroller = "--as=system:serviceaccount:metacontroller:metacontroller"

        def may_write_configmaps(namespace: str) -> bool:
            out = plane.kubectl("auth", "can-i", "create", "configmaps", "-n", namespace, metacontroller, check=False)
            return out.stdout.strip() == "yes"

        plane.kubectl("create", "namespace", "models")
        assert not may_write_configmaps("models")
        # Upgraded with the defaults (generateSecrets false), like a release installed by a chart that
        # generated its Secrets unasked (0.1.0): the Secrets in the cluster are found and kept.
        run_helm(helm, "upgrade", "noctaya", str(CHART), "--set", "hooks.replicas=3", "--set",
                 "llmGateway.namespaces={models}", *common)
        # The chart's RBAC as the authorizer sees it: ConfigMap write in the enabled namespace only.
        assert may_write_configmaps("models") and not may_write_configmaps("kube-system")
        assert secret() == first  # an upgrade keeps the token Metacontroller sends and the scaler-token key
        assert tls() == first_tls  # ... and the certificate (and CA) the controllers trust
        assert json.loads(plane.kubectl("-n", NAMESPACE, "get", "deployment", "noctaya-hooks", "-o", "json").stdout)["spec"]["replicas"] == 3
        pdb = ("-n", NAMESPACE, "get", "pdb", "noctaya-hooks", "--ignore-not-found", "-o", "name")
        assert plane.kubectl(*pdb).stdout.strip() == "poddisruptionbudget.policy/noctaya-hooks"
        run_helm(helm, "upgrade", "noctaya", str(CHART), "--set", "hooks.replicas=1", *common)
        assert plane.kubectl(*pdb).stdout == ""  # one replica: no budget left to block a node drain
        assert not may_write_configmaps("models")  # the namespace left the list: its RoleBinding is gone
        run_helm(helm, "uninstall", "noctaya", *common)
        assert secret() == first and tls() == first_tls  # kept on uninstall (resource-policy: keep)
        assert plane.kubectl("-n", NAMESPACE, "get", "deployment", "noctaya-hooks", "--ignore-not-found", "-o", "name").stdout == ""
    finally:
        plane.stop()


# ----------------------------------------------------------------------------------- GitOps renders


def render_text(helm: Path, *values: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`helm template` as Argo CD runs it: no cluster to look into, no --set beyond what is given."""
    return run_helm(helm, "template", "noctaya", str(CHART), "--namespace", NAMESPACE, "--include-crds", *values,
                    check=check)


def test_a_gitops_render_is_byte_identical_and_generates_no_secret_material(helm: Path, tmp_path: Path) -> None:
    values = tmp_path / "gitops.yaml"
    values.write_text(yaml.safe_dump({"hooks": {"existingSecret": "noctaya-hooks", "generateSecrets": False,
                                                "tls": {"existingSecret": "noctaya-hooks-tls"}}}))
    first, second = (render_text(helm, "--values", str(values)).stdout for _ in range(2))
    assert first == second
    docs = by_key([d for d in yaml.safe_load_all(first) if d])
    assert not [key for key in docs if key[0] == "Secret"]
    volumes = {v["name"]: v for v in docs[("Deployment", "noctaya-hooks")]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["keys"]["secret"]["secretName"] == "noctaya-hooks"
    assert volumes["tls"]["secret"]["secretName"] == "noctaya-hooks-tls"
    # The same objects as the kustomize install's (it names those Secrets too), without the Secrets.
    assert by_key(template(helm, *EXISTING)).keys() == docs.keys()


def test_a_render_without_secret_inputs_fails_and_says_what_to_set(helm: Path) -> None:
    both = render_text(helm, check=False)
    assert both.returncode != 0 and not both.stdout.strip()
    for said in ("set hooks.existingSecret (a Secret with keys hook-token and token-key) and hooks.tls.existingSecret "
                 f"(a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt for noctaya-hooks.{NAMESPACE}.svc",
                 "examples/security/hook-server-cert-manager.yaml", "hooks.generateSecrets=true",
                 'docs/install.md, "GitOps (Argo CD, Flux)"'):
        assert said in both.stderr, both.stderr
    tls_only = render_text(helm, "--set", "hooks.existingSecret=mine", check=False)
    assert tls_only.returncode != 0 and "set hooks.tls.existingSecret (" in tls_only.stderr
    assert "hooks.existingSecret (a Secret" not in tls_only.stderr
    token_only = render_text(helm, "--set", "hooks.tls.existingSecret=mine", check=False)
    assert token_only.returncode != 0 and "set hooks.existingSecret (a Secret" in token_only.stderr
    assert "hooks.tls.existingSecret (" not in token_only.stderr


def test_the_chart_version_is_the_release(helm: Path) -> None:
    from hooks.version import RELEASE_IMAGE, __version__

    shown = yaml.safe_load(run_helm(helm, "show", "chart", str(CHART)).stdout)
    assert (shown["version"], shown["appVersion"]) == (__version__, __version__)
    docs = by_key(template(helm))
    (container,) = docs[("Deployment", "noctaya-hooks")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert container["image"] == env["NOCTAYA_IMAGE"] == RELEASE_IMAGE
    assert env["NOCTAYA_EXPECTED_VERSION"] == __version__
    controllers = [d for (kind, _), d in docs.items() if kind in ("CompositeController", "DecoratorController")]
    assert len(controllers) >= 5
    assert {d["metadata"]["annotations"]["serving.noctaya.io/version"] for d in controllers} == {__version__}
