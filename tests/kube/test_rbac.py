"""The install's RBAC as the real API server's authorizer sees it.

- What Noctaya's controllers need from Metacontroller's identity, and what they must not get, written
  here independently of the docs (a row dropped from both would still fail here).
- docs/install.md's table "What Metacontroller and the hook server may do": every cell is asked of the
  authorizer, and each identity's whole rule list (`kubectl auth can-i --list`) must be covered by the
  table's `yes` cells, so the table cannot drift from the RBAC in either direction.

The setting is the one the docs describe: `kubectl apply -k metacontroller/` (the session's install),
Metacontroller's own RBAC for its API group (tests/e2e/metacontroller-own-rbac.yaml, as in the lifecycle
suite) and one namespace enabled for LLMGateways with the shipped RoleBinding, applied the documented way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from tests.kube.apiserver import REPO_ROOT, ControlPlane
from tests.kube.manifests import METACONTROLLER_DIR

pytestmark = pytest.mark.timeout(180, func_only=True)

METACONTROLLER_SA = "system:serviceaccount:metacontroller:metacontroller"
HOOKS_SA = "system:serviceaccount:noctaya-system:noctaya-hooks"
# Bound to nothing (its namespace does not exist): what every authenticated ServiceAccount may do.
NOBODY_SA = "system:serviceaccount:noctaya-rbac-nobody:nobody"
IDENTITIES = {"Metacontroller": METACONTROLLER_SA, "hook server": HOOKS_SA}
ENABLED = "llmgw-enabled"  # a namespace enabled for LLMGateways
NOT_ENABLED = "kube-system"
# The table's scope columns: `-A` (namespace "" in an access review), `-n kube-system`, `-n <enabled>`.
SCOPES = ("", NOT_ENABLED, ENABLED)
ENABLING_FILE = METACONTROLLER_DIR / "llmgateway-namespace" / "rolebinding.yaml"
OWN_RBAC = REPO_ROOT / "tests" / "e2e" / "metacontroller-own-rbac.yaml"
INSTALL_DOC = REPO_ROOT / "docs" / "install.md"
TABLE_HEADING = "### What Metacontroller and the hook server may do"

Question = tuple[str, str, str, str]  # (user, verb, resource[.group][/subresource], namespace or "")


@pytest.fixture(scope="module")
def rbac(installed: ControlPlane) -> ControlPlane:
    installed.kubectl("apply", "--server-side", "-f", str(OWN_RBAC))
    installed.kubectl("create", "namespace", ENABLED)
    installed.kubectl("apply", "--server-side", "-n", ENABLED, "-f", str(ENABLING_FILE))
    return installed


# --- asking the authorizer --------------------------------------------------------------------------------


def access_review(user: str, verb: str, resource: str, namespace: str) -> dict[str, Any]:
    """The SubjectAccessReview `kubectl auth can-i VERB RESOURCE --as=USER [-n NS | -A]` amounts to: a
    ServiceAccount user carries the groups impersonation gives it."""
    name, _, subresource = resource.partition("/")
    plural, _, group = name.partition(".")
    # Empty attributes are left out, as the API server echoes them.
    given = {"verb": verb, "resource": plural, "group": "*" if plural == "*" else group, "subresource": subresource,
             "namespace": namespace}
    attributes = {key: value for key, value in given.items() if value}
    sa_namespace = user.split(":")[2]
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{sa_namespace}", "system:authenticated"]
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": groups, "resourceAttributes": attributes}}


def ask(kube: ControlPlane, questions: list[Question]) -> dict[Question, bool]:
    """Every question in one kubectl call (hundreds of `kubectl auth can-i` processes would take minutes)."""
    unique = sorted(set(questions))
    reviews = [access_review(*q) for q in unique]
    listing = {"apiVersion": "v1", "kind": "List", "items": reviews}
    answered = json_stream(kube.kubectl("create", "-o", "json", "-f", "-", stdin=json.dumps(listing)).stdout)
    assert [a["spec"]["resourceAttributes"] for a in answered] == [r["spec"]["resourceAttributes"] for r in reviews]
    return {q: bool(a["status"].get("allowed")) for q, a in zip(unique, answered, strict=True)}


def json_stream(text: str) -> list[dict[str, Any]]:
    """kubectl prints one JSON document per object created, one after the other."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        doc, at = decoder.raw_decode(text, at)
        out.append(doc)
    return out


def can_i(kube: ControlPlane, user: str, verb: str, resource: str, namespace: str) -> bool:
    """`kubectl auth can-i` itself, as docs/install.md has users run it."""
    name, _, subresource = resource.partition("/")  # TYPE/NAME would name an object
    args = [verb, name, *([f"--subresource={subresource}"] if subresource else []),
            *(["-n", namespace] if namespace else ["-A"]), f"--as={user}"]
    out = kube.kubectl("auth", "can-i", *args, check=False)
    assert out.stdout.strip() in ("yes", "no"), out.stderr
    return out.stdout.strip() == "yes"


_LIST_LINE = re.compile(r"^(?P<resource>\S+)\s+\[(?P<urls>[^\]]*)\]\s+\[(?P<names>[^\]]*)\]\s+\[(?P<verbs>[^\]]*)\]$")


def rules(kube: ControlPlane, user: str, namespace: str) -> set[tuple[str, str]]:
    """(resource, verb) of every resource rule `kubectl auth can-i --list` shows in this namespace (the
    cluster-wide rules plus that namespace's). Non-resource URLs (discovery) are left out."""
    out = kube.kubectl("auth", "can-i", "--list", "-n", namespace, f"--as={user}").stdout
    found: set[tuple[str, str]] = set()
    for line in out.splitlines()[1:]:
        if not line.strip() or line.strip().startswith("["):
            continue
        match = _LIST_LINE.match(line.strip())
        assert match, f"unexpected `kubectl auth can-i --list` line: {line!r}"
        assert not match["names"], f"a rule limited to named objects is not in the table's terms: {line!r}"
        found |= {(match["resource"], verb) for verb in match["verbs"].split()}
    return found


# --- what Noctaya's controllers need, and must not get ------------------------------------------------------


METACONTROLLER_NEEDS = [
    ("watch", "llmservices.serving.noctaya.io", ""),
    ("update", "llmservices.serving.noctaya.io", ""),
    ("update", "llmservices.serving.noctaya.io/status", ""),
    ("update", "inferenceruntimes.serving.noctaya.io/status", ""),
    ("list", "inferenceruntimes.serving.noctaya.io", ""),
    ("watch", "llmgateways.serving.noctaya.io", ""),
    ("update", "llmgateways.serving.noctaya.io", ""),
    ("update", "llmgateways.serving.noctaya.io/status", ""),
    ("update", "llmgateways.serving.noctaya.io/finalizers", ""),
    ("watch", "acceleratorpools.serving.noctaya.io", ""),
    ("update", "acceleratorpools.serving.noctaya.io/status", ""),
    *[
        (verb, resource, "")
        for resource in ("deployments.apps", "services", "secrets", "poddisruptionbudgets.policy",
                         "persistentvolumeclaims", "jobs.batch", "scaledobjects.keda.sh")
        for verb in ("create", "update", "patch", "delete", "watch")
    ],
    # The LLMGateway's routing table: Metacontroller's child informer lists and watches every namespace;
    # it writes only where a namespace is enabled.
    ("list", "configmaps", ""),
    ("watch", "configmaps", ""),
    *[(verb, "configmaps", ENABLED) for verb in ("create", "update", "patch", "delete")],
    # Whether a namespace is enabled (the LLMGateway's related RoleBinding), through an all-namespaces informer.
    ("list", "rolebindings.rbac.authorization.k8s.io", ""),
    ("watch", "rolebindings.rbac.authorization.k8s.io", ""),
    ("watch", "pods", ""),
    ("watch", "nodes", ""),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("watch", "namespaces", ""),
    ("create", "events", ""),
]

METACONTROLLER_MUST_NOT = [
    *[(verb, "configmaps", scope) for verb in ("create", "update", "patch", "delete") for scope in ("", NOT_ENABLED)],
    ("get", "triggerauthentications.keda.sh", ""),  # no customize hook relates them
    *[(verb, "pods", ENABLED) for verb in ("create", "update", "patch", "delete")],
    *[(verb, "nodes", "") for verb in ("create", "update", "patch", "delete")],
    ("create", "rolebindings.rbac.authorization.k8s.io", ENABLED),  # it cannot widen its own grants
    ("create", "clusterroles.rbac.authorization.k8s.io", ""),
    ("bind", "clusterroles.rbac.authorization.k8s.io", ""),
    ("get", "serviceaccounts", ""),
    ("create", "acceleratorpools.serving.noctaya.io", ""),
]


def test_metacontroller_may_do_what_noctayas_controllers_need(rbac: ControlPlane) -> None:
    answers = ask(rbac, [(METACONTROLLER_SA, *q) for q in METACONTROLLER_NEEDS])
    assert [q for q, allowed in answers.items() if not allowed] == []


def test_metacontroller_may_not_do_what_they_do_not_need(rbac: ControlPlane) -> None:
    answers = ask(rbac, [(METACONTROLLER_SA, *q) for q in METACONTROLLER_MUST_NOT])
    assert [q for q, allowed in answers.items() if allowed] == []


# --- docs/install.md's table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    identity: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    cells: tuple[bool, ...]  # one per SCOPES

    def questions(self, scope_index: int) -> list[Question]:
        user = IDENTITIES[self.identity]
        return [(user, v, r, SCOPES[scope_index]) for r in self.resources for v in self.verbs]

    def markdown(self, cells: tuple[bool, ...] | None = None) -> str:
        answers = " | ".join("yes" if c else "no" for c in (self.cells if cells is None else cells))
        return (f"| {self.identity} | {', '.join(f'`{r}`' for r in self.resources)} | "
                f"{', '.join(self.verbs) if self.verbs != ('*',) else '`*`'} | {answers} |")


def table_rows() -> list[Row]:
    text = INSTALL_DOC.read_text()
    section = text[text.index(TABLE_HEADING) + len(TABLE_HEADING):]
    section = section[:section.index("\n#")]
    rows = []
    for line in section.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) != 3 + len(SCOPES) or cols[0] not in IDENTITIES:
            continue
        assert all(c in ("yes", "no") for c in cols[3:]), line
        rows.append(Row(cols[0], tuple(re.findall(r"`([^`]+)`", cols[1])),
                        tuple(v.strip().strip("`") for v in cols[2].split(",")), tuple(c == "yes" for c in cols[3:])))
    return rows


def test_the_docs_table_is_what_the_authorizer_answers(rbac: ControlPlane) -> None:
    rows = table_rows()
    assert {r.identity for r in rows} == set(IDENTITIES) and len(rows) > 10, "the table was not found"
    answers = ask(rbac, [q for row in rows for i in range(len(SCOPES)) for q in row.questions(i)])
    wrong = []
    for row in rows:
        cells = []
        for i in range(len(SCOPES)):
            said = {answers[q] for q in row.questions(i)}
            if len(said) > 1:  # one cell must hold for every resource and verb of its row
                mixed = [f"{q[1]} {q[2]}: {'yes' if answers[q] else 'no'}" for q in row.questions(i)]
                wrong.append(f"split this row, scope {SCOPES[i] or '-A'} is mixed: {mixed}")
            cells.append(said == {True})
        if tuple(cells) != row.cells:
            wrong.append(f"docs:   {row.markdown()}\nactual: {row.markdown(tuple(cells))}")
    assert wrong == [], "docs/install.md's RBAC table differs from the API server:\n" + "\n".join(wrong)


@pytest.mark.parametrize("identity", sorted(IDENTITIES))
def test_the_table_says_yes_to_everything_the_identity_may_do(rbac: ControlPlane, identity: str) -> None:
    """`kubectl auth can-i --list`, beyond what a ServiceAccount bound to nothing may do, is covered by
    `yes` cells: a grant added to the RBAC but not to the docs fails here."""
    yes = {(r, v, i) for row in table_rows() if row.identity == identity
           for i, cell in enumerate(row.cells) if cell for r in row.resources for v in row.verbs}
    user = IDENTITIES[identity]
    missing = []
    # noctaya-system is not enabled either (and a grant to the hook server would most likely be made there).
    for i, namespace in ((1, NOT_ENABLED), (2, ENABLED), (1, "noctaya-system")):
        for resource, verb in sorted(rules(rbac, user, namespace) - rules(rbac, NOBODY_SA, namespace)):
            if (resource, verb, i) not in yes:
                missing.append(f"{verb} {resource} in {namespace}")
    assert missing == [], f"{identity} may do what docs/install.md's table does not say: {missing}"


def test_the_hook_server_may_do_nothing_a_serviceaccount_bound_to_nothing_may_not(rbac: ControlPlane) -> None:
    for namespace in (NOT_ENABLED, ENABLED, "noctaya-system"):
        assert rules(rbac, HOOKS_SA, namespace) == rules(rbac, NOBODY_SA, namespace), namespace


def test_kubectl_auth_can_i_answers_like_the_access_reviews(rbac: ControlPlane) -> None:
    """The table says what `kubectl auth can-i` answers; the batch of access reviews stands in for it.
    Both ways on the cells that tell the LLMGateway's grant apart, and on a denied one of each identity."""
    sample = [
        *[(METACONTROLLER_SA, verb, "configmaps", scope) for verb in ("create", "watch") for scope in SCOPES],
        (METACONTROLLER_SA, "update", "llmgateways.serving.noctaya.io/status", ""),
        (METACONTROLLER_SA, "get", "triggerauthentications.keda.sh", ""),
        (HOOKS_SA, "get", "secrets", ""),
    ]
    answers = ask(rbac, sample)
    assert {q: can_i(rbac, *q) for q in sample} == answers
    assert answers[(METACONTROLLER_SA, "create", "configmaps", ENABLED)] is True
    assert answers[(METACONTROLLER_SA, "create", "configmaps", NOT_ENABLED)] is False


def test_whoever_may_write_configmaps_in_a_namespace_may_enable_it_and_no_other(rbac: ControlPlane) -> None:
    """docs/install.md: a namespace's admin can apply the RoleBinding in their own namespace, not in
    another. RBAC's escalation check decides it: binding a role needs its permissions in that namespace.
    (The aggregated `admin` role is empty on this bare API server, so a Role with what matters stands in.)"""
    admin = "ns-admin@example.com"
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "test-configmaps-and-rolebindings"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "update", "patch", "delete"]},
                      {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["rolebindings"],
                       "verbs": ["get", "create", "patch"]}]}
    only_bindings = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                     "metadata": {"name": "test-rolebindings-only"},
                     "rules": [role["rules"][1]]}
    rbac.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                        "items": [role, only_bindings]}))
    for namespace, granted in (("team-own", role), ("team-other", only_bindings)):
        rbac.kubectl("create", "namespace", namespace)
        rbac.kubectl("-n", namespace, "create", "rolebinding", "admin", f"--clusterrole={granted['metadata']['name']}",
                     f"--user={admin}")
    apply = ("apply", "--server-side", "-f", str(ENABLING_FILE), f"--as={admin}")
    assert rbac.kubectl("-n", "team-own", *apply, check=False).returncode == 0
    refused = rbac.kubectl("-n", "team-other", *apply, check=False)
    assert refused.returncode != 0 and "attempting to grant RBAC permissions not currently held" in refused.stderr, \
        refused.stderr
    assert ask(rbac, [(METACONTROLLER_SA, "create", "configmaps", ns) for ns in ("team-own", "team-other")]) == {
        (METACONTROLLER_SA, "create", "configmaps", "team-own"): True,
        (METACONTROLLER_SA, "create", "configmaps", "team-other"): False}
