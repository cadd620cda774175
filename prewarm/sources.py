"""The grammar of ``model.source`` and ``model.revision``: one module for every reader.

The CRD's CEL rules are generated from these expressions (``hooks.api.llmservice``), the API models
validate and parse with them, the hooks render from the parse, and the prewarm Job and the serving
Pod's marker wait name cache directories from the same parse (``prewarm.layout``). So whatever the API
server admits can be rendered and staged; there is no second expression to drift (issue #20: an
``oci://reg/../x@sha256:…`` was admitted by one, refused by another, and the sync hook failed on it
forever).

The expressions are written in the common subset of Python ``re`` and RE2 (CEL's ``matches``): no
look-around, anchored with ``^…$`` (CEL's ``matches`` searches; Python callers use ``fullmatch``).
Dependency-free, so the Job and the init container need not import the API models.

    hf://<org>/<name>, modelscope://<org>/<name>
        org and name: a letter or digit, then letters, digits, '.', '_', '-'.
    oci://<registry>[:<port>]/<repository>@sha256:<64 hex>
        registry: DNS labels (lower case) joined by '.'; repository: the OCI distribution spec's path
        components ``[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*`` joined by '/' (so never '.', '..' or a
        hidden name); a digest, never a tag.
    pvc://<claim>[/<sub/path>]
        claim: a DNS label; each sub-path segment letters, digits, '.', '_', '-', but not '.' or '..'.
    revision (hub sources only): 1-128 of letters, digits, '.', '_', '/', '-'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_HUB_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
HUB_SOURCE_RE = rf"^(hf|modelscope)://{_HUB_NAME}/{_HUB_NAME}$"

_DNS_LABEL = r"[a-z0-9]([a-z0-9-]*[a-z0-9])?"
_REGISTRY = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*(:[0-9]{{1,5}})?"
_REPO_COMPONENT = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
DIGEST_RE = r"^sha256:[a-f0-9]{64}$"
OCI_SOURCE_RE = rf"^oci://{_REGISTRY}(/{_REPO_COMPONENT})+@sha256:[a-f0-9]{{64}}$"

# A segment with at least one character that is not a dot, or three dots and more: never '.' or '..'.
_PVC_SEGMENT = r"(\.*[A-Za-z0-9_-][A-Za-z0-9._-]*|\.\.\.+)"
PVC_SOURCE_RE = rf"^pvc://{_DNS_LABEL}(/{_PVC_SEGMENT})*$"

SCHEME_RE = r"^(hf|modelscope|oci|pvc)://"
REVISION_RE = r"^[A-Za-z0-9._/-]+$"
REVISION_MAX = 128
SOURCE_MAX = 512

DEFAULT_REVISION = {"hf": "main", "modelscope": "master"}

HUB_MESSAGE = "a hub source is hf://org/name or modelscope://org/name"
OCI_MESSAGE = ("an oci:// source must pin a digest: oci://registry[:port]/repo@sha256:<64 hex digits> (tags are not "
               "allowed), registry and repository in lower case, each path segment a name (never '.' or '..')")
PVC_MESSAGE = "a pvc:// source must not contain '.' or '..' path segments: it is pvc://<claim name>[/sub/path]"


@dataclass(frozen=True)
class ModelSource:
    """A parsed ``model.source``."""

    scheme: Literal["hf", "modelscope", "oci", "pvc"]
    # hf/modelscope: "org/name"; oci: "registry[:port]/repo"; pvc: claim name
    location: str
    digest: str | None = None  # oci only: "sha256:<hex>"
    sub_path: str = ""  # pvc only: path inside the claim, no leading slash

    @property
    def is_hub(self) -> bool:
        return self.scheme in ("hf", "modelscope")


def source_error(source: str) -> str | None:
    """What is wrong with ``source`` (the message the CRD's rule for its scheme gives), or None."""
    if len(source) > SOURCE_MAX:
        return f"model.source is longer than {SOURCE_MAX} characters"
    if source.startswith(("hf://", "modelscope://")):
        return None if re.fullmatch(HUB_SOURCE_RE, source) else HUB_MESSAGE
    if source.startswith("oci://"):
        return None if re.fullmatch(OCI_SOURCE_RE, source) else OCI_MESSAGE
    if source.startswith("pvc://"):
        return None if re.fullmatch(PVC_SOURCE_RE, source) else PVC_MESSAGE
    return "model.source must start with hf://, modelscope://, oci:// or pvc://"


def parse_model_source(source: str) -> ModelSource:
    """Parse a model source URI; raises ValueError with a user-facing message."""
    error = source_error(source)
    if error is not None:
        raise ValueError(f"model.source {source!r}: {error}")
    scheme, rest = source.split("://", 1)
    if scheme == "oci":
        location, digest = rest.split("@", 1)
        return ModelSource("oci", location, digest=digest)
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        return ModelSource("pvc", claim, sub_path=sub)
    return ModelSource(scheme, rest)  # type: ignore[arg-type]


def revision_error(revision: str) -> str | None:
    if not 1 <= len(revision) <= REVISION_MAX or not re.fullmatch(REVISION_RE, revision):
        return f"revision {revision!r} must be 1-{REVISION_MAX} characters of [A-Za-z0-9._/-]"
    return None

