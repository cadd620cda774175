"""The per-service token Secret that gateways present to the aggregate scaler.

Hooks are pure, so randomness must not churn objects: the first render derives the token as
HMAC-SHA256(token key, parent uid [+ epoch]) — deterministic for one parent, unguessable without the
key — and every later sync reuses the token from the observed Secret, so a different hook replica's
key never changes a token already in use.

Rotation: the Secret records the token epoch it was made in (an annotation). When the hook server's
NOCTAYA_TOKEN_EPOCH is raised, the next sync derives a new token for the new epoch and keeps the old
one as `previous-token`. The aggregate scaler accepts either and a gateway whose current token is
refused retries with its previous one, so whichever Pod's mounted Secret the kubelet updates first,
no report is lost.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

from hooks.config import HookConfig
from hooks.resources import gateway, labels, names
from hooks.resources.context import RenderContext

EPOCH_ANNOTATION = "serving.noctaya.io/token-epoch"


def derive_token(key: bytes, parent_uid: str, epoch: int = 0) -> str:
    seed = parent_uid if epoch == 0 else f"{parent_uid}/epoch-{epoch}"  # epoch 0: tokens made before epochs
    return hmac.new(key, seed.encode(), hashlib.sha256).hexdigest()


def _observed_epoch(observed: dict[str, Any]) -> int:
    raw = str(((observed.get("metadata") or {}).get("annotations") or {}).get(EPOCH_ANNOTATION, "0"))
    return int(raw) if raw.isdigit() else -1


def _observed_token(observed: dict[str, Any] | None, key: str = gateway.TOKEN_KEY) -> str | None:
    """A base64 token of the observed Secret, if it holds a usable one under ``key``."""
    if not observed:
        return None
    value = (observed.get("data") or {}).get(key)
    if not isinstance(value, str) or not value:
        return None
    try:
        decoded = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return value if len(decoded) >= 16 else None


def token_secret(ctx: RenderContext, observed: dict[str, Any] | None) -> dict[str, Any]:
    return token_secret_object(ctx.config, ctx.uid or f"{ctx.namespace}/{ctx.name}",
                               lambda annotations: ctx.metadata(names.scaler_token(ctx.name), labels.AUTH, annotations),
                               observed)


def token_secret_object(config: HookConfig, seed: str, metadata: Callable[[dict[str, str]], dict[str, Any]],
                        observed: dict[str, Any] | None) -> dict[str, Any]:
    """The token Secret of any owner: `seed` (its uid) derives a first token, `metadata(annotations)`
    names and labels the Secret; an observed token of the current epoch is kept."""
    epoch = config.token_epoch
    current = _observed_token(observed)
    previous = _observed_token(observed, gateway.PREVIOUS_TOKEN_KEY)
    if current is None or observed is None or _observed_epoch(observed) != epoch:
        fresh = base64.b64encode(derive_token(config.token_key, seed, epoch).encode()).decode()
        previous = current if current is not None and current != fresh else previous
        current = fresh
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata({EPOCH_ANNOTATION: str(epoch)}),
        "type": "Opaque",
        # `data` (base64), not `stringData`: the API server returns `data`, so the applied and the
        # observed object agree and the 3-way merge has nothing to change. `previous-token` is always
        # present (the token itself before any rotation): the Pods mount it as a file.
        "data": {gateway.TOKEN_KEY: current, gateway.PREVIOUS_TOKEN_KEY: previous or current},
    }
