"""The per-service token Secret that gateways present to the aggregate scaler.

Hooks are pure, so randomness must not churn objects: the first render derives the token as
HMAC-SHA256(token key, parent uid) — deterministic for one parent, unguessable without the key —
and every later sync reuses the token from the observed Secret, so rotating the key (or a
different hook replica's key) never changes a token already in use.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from typing import Any

from hooks.resources import gateway, labels, names
from hooks.resources.context import RenderContext


def derive_token(key: bytes, parent_uid: str) -> str:
    return hmac.new(key, parent_uid.encode(), hashlib.sha256).hexdigest()


def _observed_token(observed: dict[str, Any] | None) -> str | None:
    """The base64 token of the observed Secret, if it holds a usable one."""
    if not observed:
        return None
    value = (observed.get("data") or {}).get(gateway.TOKEN_KEY)
    if not isinstance(value, str) or not value:
        return None
    try:
        decoded = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return value if len(decoded) >= 16 else None


def token_secret(ctx: RenderContext, observed: dict[str, Any] | None) -> dict[str, Any]:
    encoded = _observed_token(observed)
    if encoded is None:
        seed = ctx.uid or f"{ctx.namespace}/{ctx.name}"
        encoded = base64.b64encode(derive_token(ctx.config.token_key, seed).encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": ctx.metadata(names.scaler_token(ctx.name), labels.AUTH),
        "type": "Opaque",
        # `data` (base64), not `stringData`: the API server returns `data`, so the applied and the
        # observed object agree and the 3-way merge has nothing to change.
        "data": {gateway.TOKEN_KEY: encoded},
    }
