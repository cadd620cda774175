"""The install's RBAC as the real API server's authorizer sees it.

- What Noctaya's controllers need from Metacontroller's identity, and what they must not get, written
  here independently of the docs (a row dropped from both would still fail here).
- docs/install.md's table "What Metacontroller and the hook server may do": every cell is asked of the
  authorizer, and each identity's whole rule list (`kubectl auth can-i --list`) must be covered by the
  table's `yes` cells, so the table cannot drift from the RBAC in either direction.
- A gateway's own identity: an LLMService's and an LLMGateway's children as the hooks render them,
  created as Metacontroller (so RBAC's escalation check judges its RoleBindings), then what each
  gateway's ServiceAccount may do, against a list of its own and docs/install.md's table "What a
  gateway may do".

The setting is the one the docs describe: `kubectl apply -k metacontroller/` (the session's install),
Metacontroller's own RBAC for its API group (tests/e2e/metacontroller-own-rbac.yaml, as in the lifecycle
suite) and one namespace enabled for LLMGateways with the shipped RoleBinding, applied the documented way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

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

Question = tuple[str, str, str, str]  # (user, verb, resource[.group][/subresource][[name]], namespace or "")
_RESOURCE = re.compile(r"^(?P<type>[^/\[]+)(?:/(?P<subresource>[^\[]+))?(?:\[(?P<name>[^\]]+)\])?$")


@pytest.fixture(scope="module")
def rbac(installed: ControlPlane) -> ControlPlane:
    installed.kubectl("apply", "--server-side", "-f", str(OWN_RBAC))
    installed.kubectl("create", "namespace", ENABLED)
    installed.kubectl("apply", "--server-side", "-n", ENABLED, "-f", str(ENABLING_FILE))
    return installed


# --- asking the authorizer --------------------------------------------------------------------------------


def split_resource(resource: str) -> tuple[str, str, str, str]:
    """`plural[.group][/subresource][[name]]` → (plural, group, subresource, name)."""
    match = _RESOURCE.match(resource)
    assert match, f"not a resource of the table's terms: {resource!r}"
    plural, _, group = match["type"].partition(".")
    return plural, group, match["subresource"] or "", match["name"] or ""


def access_review(user: str, verb: str, resource: str, namespace: str) -> dict[str, Any]:
    """The SubjectAccessReview `kubectl auth can-i VERB RESOURCE[/NAME] --as=USER [-n NS | -A]` amounts
    to: a ServiceAccount user carries the groups impersonation gives it."""
    plural, group, subresource, object_name = split_resource(resource)
    # Empty attributes are left out, as the API server echoes them.
    given = {"verb": verb, "resource": plural, "group": "*" if plural == "*" else group, "subresource": subresource,
             "name": object_name, "namespace": namespace}
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
    plural, group, subresource, object_name = split_resource(resource)
    kind = f"{plural}.{group}" if group else plural
    args = [verb, f"{kind}/{object_name}" if object_name else kind, *([f"--subresource={subresource}"] if subresource else []),
            *(["-n", namespace] if namespace else ["-A"]), f"--as={user}"]
    out = kube.kubectl("auth", "can-i", *args, check=False)
    assert out.stdout.strip() in ("yes", "no"), out.stderr
    return out.stdout.strip() == "yes"


_LIST_LINE = re.compile(r"^(?P<resource>\S+)\s+\[(?P<urls>[^\]]*)\]\s+\[(?P<names>[^\]]*)\]\s+\[(?P<verbs>[^\]]*)\]$")


def rules(kube: ControlPlane, user: str, namespace: str) -> set[tuple[str, str]]:
    """(resource, verb) of every resource rule `kubectl auth can-i --list` shows in this namespace (the
    cluster-wide rules plus that namespace's). Non-resource URLs (discovery) are left out; a rule limited
    to named objects is `resource[name]` for each name, as the tables write it."""
    out = kube.kubectl("auth", "can-i", "--list", "-n", namespace, f"--as={user}").stdout
    found: set[tuple[str, str]] = set()
    for line in out.splitlines()[1:]:
        if not line.strip() or line.strip().startswith("["):
            continue
        match = _LIST_LINE.match(line.strip())
        assert match, f"unexpected `kubectl auth can-i --list` line: {line!r}"
        names = match["names"].split()
        resources = [f"{match['resource']}[{name}]" for name in names] if names else [match["resource"]]
        found |= {(resource, verb) for resource in resources for verb in match["verbs"].split()}
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
                         "persistentvolumeclaims", "jobs.batch", "scaledobjects.keda.sh",
                         # Each gateway's identity, in whatever namespace its LLMService or LLMGateway lives.
                         "serviceaccounts", "rolebindings.rbac.authorization.k8s.io")
        for verb in ("create", "update", "patch", "delete", "watch")
    ],
    # Granting a gateway its role: RBAC's escalation check asks for `bind` of exactly this ClusterRole.
    *[("bind", "clusterroles.rbac.authorization.k8s.io[noctaya-gateway-endpoints]", scope) for scope in SCOPES],
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
    ("create", "clusterroles.rbac.authorization.k8s.io", ""),
    ("bind", "clusterroles.rbac.authorization.k8s.io", ""),
    # It may bind the gateways' role and no other (a RoleBinding it writes cannot widen anyone's grants).
    *[(verb, f"clusterroles.rbac.authorization.k8s.io[{role}]", scope) for verb in ("bind", "escalate")
      for role in ("cluster-admin", "admin", "noctaya-metacontroller", "noctaya-metacontroller-llmgateway")
      for scope in SCOPES],
    ("escalate", "clusterroles.rbac.authorization.k8s.io[noctaya-gateway-endpoints]", ""),
    ("update", "clusterroles.rbac.authorization.k8s.io[noctaya-gateway-endpoints]", ""),
    # It needs no EndpointSlice itself: that is why it binds the role rather than holding it.
    *[(verb, "endpointslices.discovery.k8s.io", "") for verb in ("get", "list", "watch")],
    ("create", "serviceaccounts/token", ""),
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

    def questions(self, scope_index: int, user: str | None = None, scopes: tuple[str, ...] = SCOPES) -> list[Question]:
        user = IDENTITIES[self.identity] if user is None else user
        return [(user, v, r, scopes[scope_index]) for r in self.resources for v in self.verbs]

    def markdown(self, cells: tuple[bool, ...] | None = None) -> str:
        answers = " | ".join("yes" if c else "no" for c in (self.cells if cells is None else cells))
        return (f"| {self.identity} | {', '.join(f'`{r}`' for r in self.resources)} | "
                f"{', '.join(self.verbs) if self.verbs != ('*',) else '`*`'} | {answers} |")


def table_rows(heading: str = TABLE_HEADING, identities: Collection[str] = tuple(IDENTITIES)) -> list[Row]:
    """The rows of the docs/install.md table under `heading` (three scope columns each)."""
    text = INSTALL_DOC.read_text()
    section = text[text.index(heading) + len(heading):]
    section = section[:section.index("\n#")]
    rows = []
    for line in section.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) != 3 + len(SCOPES) or cols[0] not in identities:
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


# --- a gateway's own identity --------------------------------------------------------------------------------

GATEWAY_HEADING = "### What a gateway may do"
GATEWAY_NS = "gw-identity"  # where the rendered LLMService and LLMGateway live
OTHER_NS = "gw-other"
GATEWAY_SCOPES = (GATEWAY_NS, OTHER_NS, "")  # the gateway table's columns: its namespace, another, -A
GATEWAYS = {"qwen-gateway": f"system:serviceaccount:{GATEWAY_NS}:qwen-gateway",  # the LLMService's own
            "front-llmgw": f"system:serviceaccount:{GATEWAY_NS}:front-llmgw"}  # the LLMGateway's
SLICES = "endpointslices.discovery.k8s.io"

GATEWAY_MAY = [(verb, SLICES, GATEWAY_NS) for verb in ("get", "list", "watch")]
GATEWAY_MUST_NOT = [
    *[(verb, SLICES, scope) for verb in ("get", "list", "watch") for scope in (OTHER_NS, "default", "")],
    *[(verb, SLICES, GATEWAY_NS) for verb in ("create", "update", "patch", "delete", "deletecollection")],
    ("get", "secrets", GATEWAY_NS), ("list", "secrets", GATEWAY_NS), ("get", "pods", GATEWAY_NS),
    ("list", "configmaps", GATEWAY_NS), ("list", "endpoints", GATEWAY_NS), ("get", "services", GATEWAY_NS),
    ("create", "serviceaccounts/token", GATEWAY_NS), ("create", "rolebindings.rbac.authorization.k8s.io", GATEWAY_NS),
]


def rendered_children() -> list[dict[str, Any]]:
    """An LLMService's and an LLMGateway's children in GATEWAY_NS, from the real sync hooks called the
    way Metacontroller calls them with this release's controller manifests."""
    from hooks.controller import llmgateway, sync
    from tests.hooks import helpers as h

    def controller(name: str) -> dict[str, Any]:
        return yaml.safe_load((METACONTROLLER_DIR / f"{name}-controller.yaml").read_text())

    service = h.llmservice()
    service["metadata"]["namespace"] = GATEWAY_NS
    request = {**h.sync_request(service), "controller": controller("llmservice")}
    children = sync.sync(request, h.config())["children"]
    member = h.llmservice("llama", endpoint={"gateway": "front"})
    member["metadata"]["namespace"] = GATEWAY_NS
    gateway = {"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMGateway",
               "metadata": {"name": "front", "namespace": GATEWAY_NS, "uid": "gw-uid", "generation": 1}, "spec": {}}
    shared = llmgateway.sync({
        "controller": controller("llmgateway"), "parent": gateway, "children": {}, "finalizing": False,
        "related": {llmgateway.LLMSERVICE: {f"{GATEWAY_NS}/llama": member},
                    "InferenceRuntime.serving.noctaya.io/v1alpha1": {"vllm-nvidia": h.runtime()}},
    }, h.config())["children"]
    return [*children, *shared]


@pytest.fixture(scope="module")
def gateways(rbac: ControlPlane) -> ControlPlane:
    """The rendered children created as Metacontroller creates them (with its identity: the RoleBindings
    pass RBAC's escalation check only through its `bind` of noctaya-gateway-endpoints)."""
    for namespace in (GATEWAY_NS, OTHER_NS):
        rbac.kubectl("create", "namespace", namespace)
    # The LLMGateway's routing ConfigMap needs its namespace enabled, as docs/install.md says.
    rbac.kubectl("apply", "--server-side", "-n", GATEWAY_NS, "-f", str(ENABLING_FILE))
    children = rendered_children()
    assert {(c["kind"], c["metadata"]["name"]) for c in children} >= {
        (kind, name) for kind in ("ServiceAccount", "RoleBinding") for name in GATEWAYS}
    listing = {"apiVersion": "v1", "kind": "List", "items": children}
    out = rbac.kubectl("create", "-f", "-", f"--as={METACONTROLLER_SA}", stdin=json.dumps(listing), check=False)
    assert out.returncode == 0, out.stderr
    return rbac


def binding(name: str, role: str) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": GATEWAY_NS}]}


def test_metacontroller_may_bind_the_gateways_role_and_no_other(gateways: ControlPlane) -> None:
    as_metacontroller = ("create", "-f", "-", f"--as={METACONTROLLER_SA}")
    granted = gateways.kubectl("-n", OTHER_NS, *as_metacontroller,
                               stdin=json.dumps(binding("endpoints", "noctaya-gateway-endpoints")), check=False)
    assert granted.returncode == 0, granted.stderr
    # (Not `admin`: on this bare API server nothing aggregates into it, so binding it grants nothing.)
    for namespace, role in ((GATEWAY_NS, "cluster-admin"),
                            # Enabling a namespace for LLMGateways is the namespace admin's to do, not its own.
                            (NOT_ENABLED, "noctaya-metacontroller-llmgateway"),
                            (OTHER_NS, "noctaya-metacontroller-llmgateway")):
        refused = gateways.kubectl("-n", namespace, *as_metacontroller, stdin=json.dumps(binding("widen", role)),
                                   check=False)
        assert refused.returncode != 0, (namespace, role)
        assert "attempting to grant RBAC permissions not currently held" in refused.stderr, refused.stderr


def test_a_gateway_may_read_the_endpointslices_of_its_namespace_and_nothing_else(gateways: ControlPlane) -> None:
    for user in GATEWAYS.values():
        answers = ask(gateways, [(user, *q) for q in GATEWAY_MAY + GATEWAY_MUST_NOT])
        assert [q for q in GATEWAY_MAY if not answers[(user, *q)]] == [], user
        assert [q for q in GATEWAY_MUST_NOT if answers[(user, *q)]] == [], user
        # kubectl auth can-i itself agrees on the two that matter.
        assert can_i(gateways, user, "list", SLICES, GATEWAY_NS) is True
        assert can_i(gateways, user, "list", SLICES, OTHER_NS) is False
        # Nothing more than the three verbs: whatever --list shows beyond what anybody may do.
        assert rules(gateways, user, GATEWAY_NS) - rules(gateways, NOBODY_SA, GATEWAY_NS) == {
            (SLICES, "get"), (SLICES, "list"), (SLICES, "watch")}
        assert rules(gateways, user, OTHER_NS) == rules(gateways, NOBODY_SA, OTHER_NS)


def test_the_gateway_table_is_what_the_authorizer_answers(gateways: ControlPlane) -> None:
    rows = table_rows(GATEWAY_HEADING, ("gateway",))
    assert len(rows) >= 4, "the gateway table was not found"
    questions = [q for user in GATEWAYS.values() for row in rows for i in range(len(GATEWAY_SCOPES))
                 for q in row.questions(i, user, GATEWAY_SCOPES)]
    answers = ask(gateways, questions)
    wrong = []
    for user in GATEWAYS.values():
        for row in rows:
            cells = tuple({answers[q] for q in row.questions(i, user, GATEWAY_SCOPES)} == {True}
                          for i in range(len(GATEWAY_SCOPES)))
            mixed = [i for i in range(len(GATEWAY_SCOPES))
                     if len({answers[q] for q in row.questions(i, user, GATEWAY_SCOPES)}) > 1]
            if cells != row.cells or mixed:
                wrong.append(f"{user}:\ndocs:   {row.markdown()}\nactual: {row.markdown(cells)} (mixed: {mixed})")
    assert wrong == [], "docs/install.md's gateway table differs from the API server:\n" + "\n".join(wrong)
    yes = {(r, v) for row in rows if row.cells[0] for r in row.resources for v in row.verbs}
    for user in GATEWAYS.values():
        extra = rules(gateways, user, GATEWAY_NS) - rules(gateways, NOBODY_SA, GATEWAY_NS) - yes
        assert extra == set(), f"{user} may do what docs/install.md's gateway table does not say: {extra}"
