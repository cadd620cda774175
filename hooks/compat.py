"""Whether this hook server may answer a controller: its release version against the manifests'.

Every controller manifest of a release carries ``serving.noctaya.io/version: "<release>"``
(metacontroller/*-controller.yaml and the chart's copies), and Metacontroller sends the controller
object with every hook call (``request["controller"]``). A hook server *older* than that annotation
runs a stale image (a node that cached a reused tag, a mirror not yet updated, an ``image.tag``
pinned to an older release): it may lack the routes, fields and children the newer manifests expect,
and whatever 200 it gave would be applied, Metacontroller deleting every child a sync answer omits.
So such a call is answered 503 ``version_skew`` (:func:`check_controller`): Metacontroller retries
with backoff and changes nothing meanwhile.

Served normally: a controller without the annotation (manifests of 0.1.0, which had none) and one of
the same or an older release, since during an upgrade a newer hook server rolls out while the older
controllers are still applied. An annotation that is not ``MAJOR.MINOR.PATCH`` is refused (400
``bad_request``) rather than guessed: serving it would switch the check off for a manifest that may
well be newer (a future release's format), and the fix, reapplying the release's manifests, is quick.

The hook server's own Deployment carries the same version in ``NOCTAYA_EXPECTED_VERSION``;
:func:`expected_version_problem` lets ``python -m hooks serve`` refuse to start on an older image, so
a stale image fails its rollout visibly while the previous ReplicaSet keeps serving.
"""

from __future__ import annotations

import json
import logging
import platform
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hooks.version import __version__

logger = logging.getLogger("noctaya.hooks")

VERSION_ANNOTATION = "serving.noctaya.io/version"
EXPECTED_VERSION_ENV = "NOCTAYA_EXPECTED_VERSION"
VERSION_SKEW = "version_skew"
# An annotation is the user's text: quoted in messages only this far.
MAX_QUOTED = 64
# No leading zeros, as in SemVer: "01.2.0" is not a release this project makes.
_VERSION = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")

Version = tuple[int, int, int]


def parse_version(text: str) -> Version:
    """``"0.12.3"`` -> ``(0, 12, 3)``; anything else raises ValueError."""
    match = _VERSION.fullmatch(text)
    if match is None:
        raise ValueError(f"{_quote(text)} is not a MAJOR.MINOR.PATCH version")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def _quote(text: str) -> str:
    return json.dumps(text if len(text) <= MAX_QUOTED else text[:MAX_QUOTED] + "...")


@dataclass(frozen=True)
class ControllerRefusal:
    """A hook call this server must not answer: the HTTP status, the error type (also the metric's
    ``kind``) and the message, which names the controller and both versions."""

    controller: str
    wanted: str
    status: int
    kind: str
    message: str


def _controller_name(controller: Mapping[str, Any]) -> str:
    metadata = controller.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    kind = controller.get("kind")
    # Metacontroller sends the object from its informer cache, which may lack apiVersion/kind.
    prefix = kind if isinstance(kind, str) and kind else "controller"
    return f"{prefix} {name}" if isinstance(name, str) and name else prefix


def _wanted_version(controller: Mapping[str, Any]) -> Any:
    metadata = controller.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    return annotations.get(VERSION_ANNOTATION) if isinstance(annotations, Mapping) else None


def check_controller(hook_request: Mapping[str, Any], running: str = __version__) -> ControllerRefusal | None:
    """None when this hook server (release ``running``) may answer the call's controller, else why not."""
    controller = hook_request.get("controller")
    if not isinstance(controller, Mapping):
        return None  # not a Metacontroller call shape; the hook itself judges the request
    wanted = _wanted_version(controller)
    if wanted is None:
        return None
    name = _controller_name(controller)
    text = wanted if isinstance(wanted, str) else json.dumps(wanted)
    try:
        newer = parse_version(text) > parse_version(running)
    except ValueError as exc:
        message = (f"{name} carries {VERSION_ANNOTATION} {exc}; this hook server runs Noctaya {running} and "
                   "does not guess which release the manifest belongs to. Reapply the controller manifests of the "
                   "release you run (kubectl apply --server-side -k metacontroller/, or helm upgrade), which set it.")
        return ControllerRefusal(name, text, 400, "bad_request", message)
    if not newer:
        return None
    message = (f"{name} is from Noctaya {wanted} ({VERSION_ANNOTATION}) but this hook server runs {running}: its "
               f"image is stale. Pull the {wanted} image for the noctaya-hooks Deployment (a node may hold an older "
               f"image under the tag; a mirror may lag); until then this controller's hook calls are refused and "
               f"nothing is changed.")
    return ControllerRefusal(name, text, 503, VERSION_SKEW, message)


class RefusalLog:
    """Logs a refusal once per (controller, annotation) and process, not on every retried call."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def report(self, refusal: ControllerRefusal) -> bool:
        """Log ``refusal`` unless this process already did; True when it logged."""
        key = (refusal.controller, refusal.wanted)
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        logger.warning("refusing hook calls of %s: %s", refusal.controller, refusal.message)
        return True


def expected_version_problem(environ: Mapping[str, str], running: str = __version__) -> str | None:
    """Why ``serve`` must not start: the image is older than the manifests' ``NOCTAYA_EXPECTED_VERSION``
    (a newer image serves older manifests, as the per-call check does); None when it may start."""
    raw = environ.get(EXPECTED_VERSION_ENV, "")
    if not raw:
        return None
    try:
        expected = parse_version(raw)
    except ValueError as exc:
        return f"{EXPECTED_VERSION_ENV}: {exc}"
    if parse_version(running) >= expected:
        return None
    return (f"this image runs Noctaya {running} but the noctaya-hooks Deployment is from {raw} "
            f"({EXPECTED_VERSION_ENV}): the image is stale. Pull the {raw} image (a node may hold an older image "
            f"under the tag; a mirror may lag); the previous hook server Pods keep serving meanwhile.")


def version_info(config: Any = None) -> dict[str, str]:
    """What ``GET /version`` answers: the release, the Python running it and, when the server has a
    HookConfig, the image it renders gateways with (NOCTAYA_IMAGE). Nothing secret."""
    info = {"version": __version__, "python": platform.python_version()}
    image = getattr(config, "image", None)
    if isinstance(image, str):
        info["image"] = image
    return info
