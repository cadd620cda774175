"""The membership of a shared gateway: which models it fronts and each model's own settings.

``python -m gateway`` serves from this table when NOCTAYA_MODEL_TABLE_FILE names it
(gateway.workers.run_shared, gateway.shared). The table is a JSON file mounted from a ConfigMap, reread when it
changes (the kubelet swaps a ConfigMap volume's files atomically), so adding or removing a model
needs no restart, and no credentials beyond reading EndpointSlices (gateway.endpointslices)::

    {"models": [
      {"name": "qwen", "backendURL": "http://qwen-backend.models.svc:8000", "maxQueue": 100},
      {"name": "llama", "backendURL": "http://llama-backend.models.svc:8000", "coldMode": "reject"}
    ]}

An entry may name its ``member``: the LLMService it serves (hooks since 0.2.0 write it; older
tables lack it). It identifies the model across a change of served name: a reload that gives a
member a new name renames the model (its held requests and its demand follow), instead of removing
one model and adding another. It may also name the member's KEDA ScaledObject (``scaledObject``:
``<namespace>/<name>``): the scaler then answers that ScaledObject by the member even while it asks by
a served name this table does not list yet (the hooks rewrite the ScaledObject at once, the kubelet
refreshes the table up to a minute later).

Each entry sets only what belongs to one model (``MODEL_FIELDS``, and ``LIST_FIELDS``: the API key
files, ``authKeyFiles``, any of which opens the model); every other setting (ports,
connection bounds, client timeouts, the held-body budget, scaler TLS) is the Pod's and comes from
the gateway's own configuration. A model's :class:`GatewayConfig` is the Pod's with the entry's
fields replaced, validated by the same parsers as the environment.

A table that does not parse is refused whole and the last good one stays in force: a half-written or
wrong ConfigMap must never drop the models already served.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.auth import MAX_KEY_FILES
from gateway.config import ConfigError, GatewayConfig, parse_field
from scaler.secretfiles import file_stamp

log = logging.getLogger("noctaya.gateway")

__all__ = ["MODEL_FIELDS", "LIST_FIELDS", "MEMBER_FIELD", "SCALED_OBJECT_FIELD", "MAX_MODELS", "ModelTable", "ModelTableFile", "TableChange", "parse_model_table"]

# JSON key of an entry -> the GatewayConfig field it sets.
MODEL_FIELDS: dict[str, str] = {
    "backendURL": "backend_url",
    "readinessPath": "readiness_path",
    "maxQueue": "max_queue",
    "coldMode": "cold_mode",
    "activationTimeoutSeconds": "activation_timeout_seconds",
    "readyGraceSeconds": "ready_grace_seconds",
    "retryAfterSeconds": "retry_after_seconds",
    "heartbeatSeconds": "heartbeat_seconds",
    "maxBodyBytes": "max_body_bytes",
    "authKeyFile": "auth_key_file",
    "scalingTarget": "scaling_target",
    "backendAccelerators": "backend_accelerators",
}
# Fields whose value is a list, not one string or number (read by their own parser).
LIST_FIELDS: dict[str, str] = {
    "authKeyFiles": "auth_key_files",  # 1..MAX_KEY_FILES paths; a bearer key in any of them opens the model
}
# The entry's member identity (the LLMService's name): not a GatewayConfig field, so a model's
# settings compare equal across a rename.
MEMBER_FIELD = "member"
SCALED_OBJECT_FIELD = "scaledObject"  # "<namespace>/<name>" of the member's ScaledObject
MAX_MODELS = 256  # bounds per-model state, greenlets and the `model` metrics label
MAX_TABLE_BYTES = 1024 * 1024
MAX_MODEL_NAME = 256


@dataclass(frozen=True)
class TableChange:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]  # same name, other settings
    renamed: tuple[tuple[str, str], ...] = ()  # (old, new): same member, new served name


def _renames(older: ModelTable, newer: ModelTable) -> dict[str, str]:
    """Old served name -> new one, for members listed in both tables under different names (only
    names that left and arrived: a member taking a name another model still has is no rename)."""
    was = {member: name for name, member in older.members.items()}
    return {was[member]: name for name, member in newer.members.items()
            if member in was and was[member] != name and name not in older.models
            and was[member] not in newer.models}


@dataclass(frozen=True)
class ModelTable:
    """The models by served name, in the file's order (the order of ``GET /v1/models``)."""

    models: Mapping[str, GatewayConfig]
    members: Mapping[str, str] = dataclasses.field(default_factory=dict)  # served name -> member, where given
    scaled_objects: Mapping[str, str] = dataclasses.field(default_factory=dict)  # "<ns>/<name>" -> served name

    def diff(self, newer: ModelTable) -> TableChange:
        renamed = _renames(self, newer)
        return TableChange(
            added=tuple(name for name in newer.models if name not in self.models and name not in renamed.values()),
            removed=tuple(name for name in self.models if name not in newer.models and name not in renamed),
            changed=tuple(name for name, config in newer.models.items()
                          if name in self.models and self.models[name] != config),
            renamed=tuple(renamed.items()),
        )


def _model_name(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not raw or raw != raw.strip():
        raise ConfigError(f"{where}: name must be a non-empty string without surrounding spaces")
    if len(raw) > MAX_MODEL_NAME or not raw.isprintable():
        raise ConfigError(f"{where}: name must be at most {MAX_MODEL_NAME} printable characters")
    return raw


def _key_files(raw: Any, where: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_KEY_FILES:
        raise ConfigError(f"{where}: authKeyFiles must be a list of 1 to {MAX_KEY_FILES} file paths")
    paths: list[str] = []
    for index, path in enumerate(raw):
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(f"{where}: authKeyFiles[{index}] must be a non-empty string")
        path = parse_field("auth_key_file", path)
        if path in paths:
            raise ConfigError(f"{where}: authKeyFiles[{index}] lists {path[:100]!r} twice")
        paths.append(path)
    return tuple(paths)


def _model_config(entry: Any, index: int, base: GatewayConfig) -> GatewayConfig:
    where = f"models[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be an object")
    name = _model_name(entry.get("name"), where)
    where = f"models[{index}] ({name[:40]})"
    unknown = sorted(set(entry) - set(MODEL_FIELDS) - set(LIST_FIELDS) - {"name", MEMBER_FIELD, SCALED_OBJECT_FIELD})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)[:200]}; a model sets only "
                          f"{', '.join(sorted([*MODEL_FIELDS, *LIST_FIELDS]))}")
    if "authKeyFile" in entry and "authKeyFiles" in entry:
        raise ConfigError(f"{where}: authKeyFile and authKeyFiles: set one of them, not both")
    if "backendURL" not in entry:
        raise ConfigError(f"{where}: backendURL is required")
    values: dict[str, Any] = {"served_model_name": name}
    for key, field in MODEL_FIELDS.items():
        if key not in entry:
            continue
        raw = entry[key]
        if isinstance(raw, bool) or not isinstance(raw, str | int | float):
            raise ConfigError(f"{where}: {key} must be a string or a number")
        try:
            values[field] = parse_field(field, str(raw))
        except ValueError as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from None
    if "authKeyFiles" in entry:
        values["auth_key_files"] = _key_files(entry["authKeyFiles"], where)
        values["auth_key_file"] = None  # the list is the model's whole set of keys
    config = dataclasses.replace(base, **values)
    if config.max_body_bytes > config.max_held_body_bytes:
        raise ConfigError(f"{where}: maxBodyBytes exceeds the Pod's held-body budget "
                          f"({config.max_held_body_bytes} bytes)")
    return config


def parse_model_table(data: bytes, base: GatewayConfig) -> ModelTable:
    """The table in ``data``; raises ConfigError naming the entry and field at fault."""
    if len(data) > MAX_TABLE_BYTES:
        raise ConfigError(f"the model table is larger than {MAX_TABLE_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"the model table is not JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list):
        raise ConfigError('the model table must be an object with a "models" list')
    entries = doc["models"]
    if len(entries) > MAX_MODELS:
        raise ConfigError(f"the model table lists {len(entries)} models; a gateway fronts at most {MAX_MODELS}")
    models: dict[str, GatewayConfig] = {}
    members: dict[str, str] = {}
    scaled_objects: dict[str, str] = {}
    for index, entry in enumerate(entries):
        config = _model_config(entry, index, base)
        if config.served_model_name in models:
            raise ConfigError(f"models[{index}]: {config.served_model_name[:40]!r} is listed twice")
        models[config.served_model_name] = config
        member = _member(entry, index)
        if member is not None:
            if member in members.values():
                raise ConfigError(f"models[{index}]: member {member[:60]!r} is listed twice")
            members[config.served_model_name] = member
        scaled_object = _identity(entry, SCALED_OBJECT_FIELD, index)
        if scaled_object is not None:
            if scaled_object in scaled_objects:
                raise ConfigError(f"models[{index}]: {SCALED_OBJECT_FIELD} {scaled_object[:60]!r} is listed twice")
            scaled_objects[scaled_object] = config.served_model_name
    return ModelTable(models, members, scaled_objects)


def _member(entry: dict[str, Any], index: int) -> str | None:
    return _identity(entry, MEMBER_FIELD, index)


def _identity(entry: dict[str, Any], key: str, index: int) -> str | None:
    if key not in entry:
        return None  # a table rendered by hooks before 0.2.0
    value = entry[key]
    if not isinstance(value, str) or not value or len(value) > MAX_MODEL_NAME or not value.isprintable():
        raise ConfigError(f"models[{index}]: {key} must be a non-empty string of at most "
                          f"{MAX_MODEL_NAME} printable characters")
    return value


# Beside the table, optional: per model balancing over its backend Pods (gateway.backends), written by
# the hooks only when a member sets one. A file of its own, not fields of the table: gateways of the
# release before refuse a table entry with a field they do not know, and ignore this file.
BALANCING_FILE = "balancing.json"
BALANCING_FIELDS: dict[str, str] = {"prefixAffinity": "prefix_affinity", "coldBatchPerPod": "pod_batch"}
MAX_BALANCING_BYTES = 256 * 1024


def apply_balancing(table: ModelTable, data: bytes) -> tuple[ModelTable, str | None]:
    """The table with ``balancing.json``'s settings applied to the models it names; and what was
    wrong with it, if anything (then nothing of it is applied: these are hints, never a reason to
    refuse the table). Models it names that the table lacks, and fields it does not know, are
    ignored (a newer release may write more)."""
    try:
        doc = json.loads(data) if len(data) <= MAX_BALANCING_BYTES else None
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
        return table, f'{BALANCING_FILE} is not an object with a "models" object (or too large): ignored'
    models = dict(table.models)
    for name, settings in doc["models"].items():
        if name not in models or not isinstance(settings, dict):
            continue
        values = {}
        for key, field in BALANCING_FIELDS.items():
            if key in settings:
                raw = settings[key]
                try:
                    values[field] = parse_field(field, str(raw).lower() if isinstance(raw, bool) else str(raw))
                except ValueError as exc:
                    return table, f"{BALANCING_FILE}: {name[:40]!r}.{key}: {exc}: ignored"
        models[name] = dataclasses.replace(models[name], **values)
    return dataclasses.replace(table, models=models), None


class ModelTableFile:
    """The mounted table, reread when its file changes. :meth:`poll` is cheap (one ``stat``) when
    nothing changed; a table that does not parse leaves the last good one in force and is reported
    once (``error``) until the file changes again."""

    def __init__(self, path: str | os.PathLike[str], base: GatewayConfig) -> None:
        self.path = os.fspath(path)
        self.base = base
        self.table: ModelTable | None = None
        self.error: str | None = None
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        self.balancing_error: str | None = None  # what was wrong with balancing.json (logged once)

    def poll(self) -> ModelTable | None:
        """A new table when the file (or the balancing file beside it) changed and parses, else None."""
        balancing = os.path.join(os.path.dirname(self.path), BALANCING_FILE)
        try:
            stamp = file_stamp(self.path) + (file_stamp(balancing) if os.path.exists(balancing) else ())
        except OSError as exc:
            self._refused(None, f"{self.path}: {exc.strerror or exc}")
            return None
        if stamp == self._stamp:
            return None
        try:
            with open(self.path, "rb") as fh:
                data = fh.read(MAX_TABLE_BYTES + 1)
            table = parse_model_table(data, self.base)
            table = self._with_balancing(table, balancing)
        except OSError as exc:
            self._refused(stamp, f"{self.path}: {exc.strerror or exc}")
            return None
        except ConfigError as exc:
            self._refused(stamp, str(exc))
            return None
        self._stamp, self.error, self.table = stamp, None, table
        return table

    def _with_balancing(self, table: ModelTable, path: str) -> ModelTable:
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_BALANCING_BYTES + 1)
        except FileNotFoundError:
            return table
        table, problem = apply_balancing(table, data)
        if problem is not None and problem != self.balancing_error:
            log.warning("balancing settings ignored", extra={"error": problem})
        self.balancing_error = problem
        return table

    def _refused(self, stamp: tuple[tuple[int, int, int], ...] | None, error: str) -> None:
        self._stamp = stamp
        self.error = error
