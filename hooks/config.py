"""Process-wide settings of the hook functions (image of the data-path programs, cluster domain, keys).

The hooks are pure: everything that is not in the request comes from here, and a test injects its
own `HookConfig` (fixed token key, fixed clock) to make every output reproducible.
"""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from hooks.version import RELEASE_IMAGE

# The image of this release (hooks/version.py): the gateways a hook server renders run the same
# code as the hook server itself unless NOCTAYA_IMAGE says otherwise.
DEFAULT_IMAGE = RELEASE_IMAGE
ROUTE_GRACE_SECONDS = 90

# One random key per process when no key file is configured: tokens are still unguessable, and a
# token, once written into the Secret child, is reused from the observed Secret on every later sync,
# so the key only matters for the very first render. Set NOCTAYA_TOKEN_KEY_FILE when several hook
# server replicas could race on that first render.
_PROCESS_TOKEN_KEY = secrets.token_bytes(32)


def parse_rfc3339(value: object) -> datetime | None:
    """A Kubernetes timestamp (RFC 3339, as metav1.Time writes it) as an aware datetime; None for
    anything else. A stamp without an offset is read as UTC: a hand-written status or annotation must
    not make an aware clock minus a naive stamp raise inside a hook."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def utc_now_rfc3339() -> str:
    """Current time as RFC 3339 in UTC with second precision (metav1.Time's wire format)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class HookConfig:
    """Settings the pure hook functions read; build one with `from_env()` or directly in tests."""

    image: str = field(default_factory=lambda: os.environ.get("NOCTAYA_IMAGE") or DEFAULT_IMAGE)
    image_pull_policy: str = "IfNotPresent"
    cluster_domain: str = "cluster.local"
    token_key: bytes = field(default=_PROCESS_TOKEN_KEY, repr=False)
    # Bumping it rotates every per-service scaler token on the next sync (docs/install.md).
    token_epoch: int = 0
    clock: Callable[[], str] = field(default=utc_now_rfc3339, compare=False)
    # How long a deleted member's backend outlives its route: the LLMGateway's status drops the model at
    # once, but each shared gateway Pod reads its routing ConfigMap through the kubelet's volume refresh
    # (its periodic Pod sync, a minute by default, plus jitter).
    route_grace_seconds: int = ROUTE_GRACE_SECONDS

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> HookConfig:
        """NOCTAYA_IMAGE, NOCTAYA_IMAGE_PULL_POLICY, NOCTAYA_CLUSTER_DOMAIN, NOCTAYA_TOKEN_KEY_FILE,
        NOCTAYA_TOKEN_EPOCH, NOCTAYA_ROUTE_GRACE_SECONDS."""
        env = os.environ if environ is None else environ
        key = _PROCESS_TOKEN_KEY
        key_file = env.get("NOCTAYA_TOKEN_KEY_FILE")
        if key_file:
            with open(key_file, "rb") as fh:
                key = fh.read().strip()
            if len(key) < 16:
                raise ValueError("NOCTAYA_TOKEN_KEY_FILE must hold at least 16 bytes of key material")
        policy = env.get("NOCTAYA_IMAGE_PULL_POLICY") or "IfNotPresent"
        if policy not in ("Always", "IfNotPresent", "Never"):
            raise ValueError("NOCTAYA_IMAGE_PULL_POLICY must be Always, IfNotPresent or Never")
        raw_epoch = (env.get("NOCTAYA_TOKEN_EPOCH") or "0").strip()
        if not raw_epoch.isdigit():
            raise ValueError("NOCTAYA_TOKEN_EPOCH must be a non-negative integer")
        raw_grace = (env.get("NOCTAYA_ROUTE_GRACE_SECONDS") or str(ROUTE_GRACE_SECONDS)).strip()
        if not raw_grace.isdigit() or int(raw_grace) > 3600:
            raise ValueError("NOCTAYA_ROUTE_GRACE_SECONDS must be an integer from 0 to 3600")
        return cls(
            route_grace_seconds=int(raw_grace),
            token_epoch=int(raw_epoch),
            image=env.get("NOCTAYA_IMAGE") or DEFAULT_IMAGE,
            image_pull_policy=policy,
            cluster_domain=(env.get("NOCTAYA_CLUSTER_DOMAIN") or "cluster.local").strip("."),
            token_key=key,
        )


@functools.lru_cache(maxsize=1)
def default_config() -> HookConfig:
    """The configuration used when an entry point is called without one (read once per process)."""
    return HookConfig.from_env()


def resolve(config: HookConfig | None) -> HookConfig:
    return default_config() if config is None else config
