"""Aggregate scaler: gateways of one LLMService report their demand here; the sum feeds the gRPC
ExternalScaler (SPEC §7, report protocol in docs/architecture.md).

The replicas of a shared gateway (one endpoint for the models of a model table) report each model's
demand too (``models`` in the report); each model's ScaledObject names its model in the trigger
metadata (``model``) and is answered from the sum of that model's demand over the replicas. The
aggregator has no table: a model no replica reports is inactive with metric 0. A trigger without
``model`` gets the sum of the reports' own counts, as before.

A model's demand belongs to its member: a shared gateway reports, with each model, the member's
ScaledObject when its table names it (``scaledObject``: "<namespace>/<name>", which a rename does not
change), and the aggregator sums the demand per ScaledObject too. A trigger whose ``model`` nobody
reports is answered by the asking ScaledObject if some replica reports a model for it: the hooks
rewrite a renamed member's ScaledObject at once, while the replicas report under the old name until
the kubelet brings them the new table, and a request held across the rename must still wake KEDA.

Everything is bounded: concurrent connections, concurrent reports (429 beyond), body size (413),
member count (429 for a new member beyond), per-member demand (clamped, per model too), models per
report (400 beyond ``MAX_REPORT_MODELS``), distinct models and distinct ScaledObjects reported at
once (429 beyond ``max_models`` each), tombstones of withdrawn members. State is memory only; after a restart the
gateways' 2 s heartbeats rebuild it.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from json.scanner import py_make_scanner  # type: ignore[attr-defined]
from typing import Any, NoReturn

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.jsonscan import InvalidJSON, inspect_json_body
from scaler.demand import Demand, DemandBroadcaster
from scaler.secretfiles import read_secret_file
from scaler.tls import ReloadingServerContext, ServedCertificates, TLSFiles

__all__ = ["AggregatorSettings", "MemberTable", "Report", "ReportError", "Aggregator", "parse_report", "read_token_file",
           "valid_scaled_object"]

log = logging.getLogger("noctaya.scaler.aggregator")

_MEMBER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_MAX_SEQ = 2**63 - 1
# A report is an object of scalars, and a shared gateway's ``models`` an object of such objects
# (scaler/reporter.py): anything deeper is refused before json.loads could build it, so a token
# holder can't make the parser recurse; what it allocates is bounded by the body size.
_MAX_REPORT_DEPTH = 3
MAX_REPORT_MODELS = 256  # = the model table's bound (gateway.modeltable.MAX_MODELS)
MAX_MODEL_NAME = 256  # = the model table's bound on a served name
# "<namespace>/<name>" of a member's ScaledObject: a namespace is a DNS label (63), a ScaledObject's
# name a DNS subdomain (253), both lowercase ASCII; checked whole, so nothing else is ever kept.
MAX_SCALED_OBJECT = 63 + 1 + 253
_SCALED_OBJECT_RE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?/[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?")


def valid_scaled_object(value: object) -> bool:
    """Whether ``value`` is "<namespace>/<name>" of a Kubernetes object (what a report may carry as
    a model's ``scaledObject``)."""
    return (isinstance(value, str) and len(value) <= MAX_SCALED_OBJECT
            and _SCALED_OBJECT_RE.fullmatch(value) is not None)


@dataclass(frozen=True, slots=True)
class AggregatorSettings:
    token_file: str
    previous_token_file: str | None = None  # also accepted: the token of the epoch before (a rotation)
    max_members: int = 64
    max_member_demand: int = 100  # = the gateway's maxQueue, which counts waiting and in-flight
    member_ttl: float = 10.0
    max_concurrent_reports: int = 16
    # A shared gateway's report names up to 256 models of up to 256 characters (1 KiB in UTF-8 each),
    # each with its member's ScaledObject (at most 317 ASCII characters).
    max_body_bytes: int = 384 * 1024
    max_connections: int = 256
    socket_timeout: float = 10.0  # idle keep-alive clients release their thread after this
    # Identity bound to the Pod: a member belongs to the address that first reported it, and one
    # address may hold only a few members (a gateway restarting in place briefly has two).
    max_members_per_address: int = 2
    # Slow clients: connections per source address, and the time a request may take to arrive whole
    # (headers and body; a byte every few seconds does not extend it).
    max_connections_per_address: int = 4
    request_deadline: float = 2.0
    # Distinct models reported at once over all members (a shared gateway's table has at most 256),
    # and distinct ScaledObjects named with them.
    max_models: int = 256

    def __post_init__(self) -> None:
        if not self.token_file:
            raise ValueError("the aggregator needs a token file (NOCTAYA_AGGREGATOR_TOKEN_FILE)")
        for name in ("max_members", "max_member_demand", "max_concurrent_reports", "max_body_bytes",
                     "max_connections", "max_members_per_address", "max_connections_per_address", "max_models"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.member_ttl <= 0 or self.socket_timeout <= 0 or self.request_deadline <= 0:
            raise ValueError("member_ttl, socket_timeout and request_deadline must be > 0")


class ReportError(ValueError):
    """A malformed report (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class Report:
    member: str
    seq: int
    queued: int
    in_flight: int
    lease_active: bool
    withdraw: bool
    # A shared gateway's demand per model: (name, queued, in flight, lease active), each name once.
    # None: a per-model gateway's report (no ``models`` key).
    models: tuple[tuple[str, int, int, bool], ...] | None = None
    # The member's ScaledObject of each model that names one: (name, "<namespace>/<name>").
    scaled_objects: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_json(cls, data: Any) -> Report:
        if not isinstance(data, dict):
            raise ReportError("report must be a JSON object")
        member = data.get("member")
        if not isinstance(member, str) or not _MEMBER_RE.match(member):
            raise ReportError("member must be 1-128 characters of [A-Za-z0-9._:-]")

        def count(key: str) -> int:
            value = data.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_SEQ:
                raise ReportError(f"{key} must be a non-negative integer")
            return value

        def flag(key: str) -> bool:
            value = data.get(key, False)
            if not isinstance(value, bool):
                raise ReportError(f"{key} must be a boolean")
            return value

        if "seq" not in data:
            raise ReportError("seq is required")
        models, scaled_objects = _models(data["models"]) if "models" in data else (None, ())
        return cls(member, count("seq"), count("queued"), count("inFlight"), flag("leaseActive"), flag("withdraw"),
                   models, scaled_objects)


def _models(raw: Any) -> tuple[tuple[tuple[str, int, int, bool], ...], tuple[tuple[str, str], ...]]:
    """``{"<model>": {"queued": n, "inFlight": n, "leaseActive": bool, "scaledObject": "ns/name"}, ...}``
    (a model left out has no demand; ``scaledObject`` is optional: gateways before it send none)."""
    if not isinstance(raw, dict):
        raise ReportError("models must be an object of model name -> demand")
    if len(raw) > MAX_REPORT_MODELS:
        raise ReportError(f"models names {len(raw)} models; a report carries at most {MAX_REPORT_MODELS}")
    models = []
    scaled_objects: list[tuple[str, str]] = []
    for name, demand in raw.items():
        if not name or len(name) > MAX_MODEL_NAME or not name.isprintable():
            raise ReportError(f"a model name must be 1-{MAX_MODEL_NAME} printable characters")
        if not isinstance(demand, dict):
            raise ReportError("each model's demand must be an object")
        counts = []
        for key in ("queued", "inFlight"):
            value = demand.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_SEQ:
                raise ReportError(f"models: {key} must be a non-negative integer")
            counts.append(value)
        lease = demand.get("leaseActive", False)
        if not isinstance(lease, bool):
            raise ReportError("models: leaseActive must be a boolean")
        models.append((name, counts[0], counts[1], lease))
        if "scaledObject" in demand:
            scaled_object = demand["scaledObject"]
            if not valid_scaled_object(scaled_object):
                raise ReportError(f'models: scaledObject must be "<namespace>/<name>" of a Kubernetes object '
                                  f"(at most {MAX_SCALED_OBJECT} characters)")
            scaled_objects.append((name, scaled_object))
    return tuple(models), tuple(scaled_objects)


def parse_report(body: bytes) -> Report:
    """The report in a request body; ReportError (HTTP 400) for anything else. The body is checked
    in bounded memory first (gateway.jsonscan): only a flat JSON object reaches json.loads."""
    try:
        inspect_json_body(body, max_depth=_MAX_REPORT_DEPTH)
    except InvalidJSON as exc:
        if exc.kind == "depth":
            raise ReportError("report must be a flat JSON object (no nested values)") from None
        if exc.kind == "not_object":
            raise ReportError("report must be a JSON object") from None
        raise ReportError(exc.reason) from None
    data = _ReportDecoder().decode(body.decode("utf-8"))
    if isinstance(data, dict):
        # Only ``models`` may nest (the depth scan allowed it for that key): any other nested value
        # is refused as before.
        # (A model's demand is at depth 3, so the scan above already refused anything nested in it.)
        for key, value in data.items():
            if key != "models" and isinstance(value, dict):
                raise ReportError("report must be a flat JSON object (no nested values)")
    return Report.from_json(data)


def _no_arrays(*_: object) -> NoReturn:
    raise ReportError("report must be a flat JSON object (no nested values)")


class _ReportDecoder(json.JSONDecoder):
    """json.loads without arrays: a report has none, and refusing the first ``[`` as it is met (before
    building it) keeps ``[[],[],...]`` at the depth ``models`` allows from costing ~50 bytes of list
    per 3 bytes of body. The Python scanner is the one that calls ``parse_array`` (the C one does
    not); a report is small, and its depth already checked."""

    def __init__(self) -> None:
        super().__init__()
        self.parse_array = _no_arrays
        self.scan_once = py_make_scanner(self)


@dataclass(slots=True)
class _Member:
    seq: int
    demand: Demand
    seen_at: float
    owner: str | None  # the source address that first reported this member (None: not bound)
    models: dict[str, Demand] | None = None  # a shared gateway's demand per model (clamped)
    scaled_objects: dict[str, str] | None = None  # model -> its member's ScaledObject, where reported


class MemberTable:
    """The newest report of each member; not thread-safe (the Aggregator holds a lock around it)."""

    def __init__(self, settings: AggregatorSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._members: dict[str, _Member] = {}
        # Withdrawn members keep their last seq for one TTL, so a delayed older report can't
        # resurrect them. Bounded like members.
        self._tombstones: dict[str, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self._members)

    def clamp(self, queued: int, in_flight: int) -> tuple[int, int]:
        limit = self._settings.max_member_demand
        queued = min(queued, limit)
        return queued, min(in_flight, limit - queued)

    def apply(self, report: Report, owner: str | None = None) -> str:
        """Returns 'accepted', 'stale', 'withdrawn', 'full' (new member over the cap), or 'foreign'.

        ``owner`` is the report's source address (the HTTP server always gives it): a member belongs
        to the address that first reported it, so a token holder cannot overwrite or evict another
        gateway's membership ('foreign'), and one address holds at most max_members_per_address
        members, so one Pod cannot fill the table ('full')."""
        now = self._clock()
        self.expire(now)
        current = self._members.get(report.member)
        if current is not None and owner is not None and current.owner != owner:
            return "foreign"
        tomb = self._tombstones.get(report.member)
        last_seq = current.seq if current else (tomb[0] if tomb else None)
        if last_seq is not None and report.seq <= last_seq:
            return "stale"
        if report.withdraw:
            self._members.pop(report.member, None)
            if len(self._tombstones) >= self._settings.max_members:
                self._tombstones.pop(next(iter(self._tombstones)))  # oldest first (insertion order)
            self._tombstones[report.member] = (report.seq, now)
            return "withdrawn"
        if current is None:
            if len(self._members) >= self._settings.max_members:
                return "full"
            if owner is not None and sum(
                    1 for m in self._members.values() if m.owner == owner) >= self._settings.max_members_per_address:
                return "full"
        models = scaled_objects = None
        if report.models is not None:
            models = {}
            for name, model_queued, model_in_flight, lease in report.models:
                clamped = self.clamp(model_queued, model_in_flight)
                models[name] = Demand(clamped[0], clamped[1], lease)
            others = {name for m, entry in self._members.items() if m != report.member and entry.models
                      for name in entry.models}
            if len(others | models.keys()) > self._settings.max_models:
                return "models_full"
            scaled_objects = dict(report.scaled_objects)
            others = {so for m, entry in self._members.items() if m != report.member and entry.scaled_objects
                      for so in entry.scaled_objects.values()}
            if len(others | set(scaled_objects.values())) > self._settings.max_models:
                return "models_full"
        self._tombstones.pop(report.member, None)
        queued, in_flight = self.clamp(report.queued, report.in_flight)
        self._members[report.member] = _Member(report.seq, Demand(queued, in_flight, report.lease_active), now, owner,
                                               models, scaled_objects)
        return "accepted"

    def expire(self, now: float | None = None) -> int:
        """Drop members silent for longer than the TTL; returns how many."""
        now = self._clock() if now is None else now
        ttl = self._settings.member_ttl
        silent = [m for m, entry in self._members.items() if now - entry.seen_at > ttl]
        for member in silent:
            del self._members[member]
        for member in [m for m, (_, at) in self._tombstones.items() if now - at > ttl]:
            del self._tombstones[member]
        return len(silent)

    def total(self) -> Demand:
        queued = sum(m.demand.queued for m in self._members.values())
        in_flight = sum(m.demand.in_flight for m in self._members.values())
        return Demand(queued, in_flight, any(m.demand.lease_active for m in self._members.values()))

    def model_totals(self) -> dict[str, Demand]:
        """Each reported model's demand summed over the members (at most ``max_models`` models)."""
        totals: dict[str, Demand] = {}
        for member in self._members.values():
            for name, demand in (member.models or {}).items():
                known = totals.get(name)
                totals[name] = demand if known is None else Demand(
                    known.queued + demand.queued, known.in_flight + demand.in_flight,
                    known.lease_active or demand.lease_active)
        return totals

    def scaled_object_totals(self) -> dict[str, Demand]:
        """The demand of each reported ScaledObject ("<namespace>/<name>"): the models reported with
        it, summed over the members (at most ``max_models`` ScaledObjects)."""
        totals: dict[str, Demand] = {}
        for member in self._members.values():
            for name, scaled_object in (member.scaled_objects or {}).items():
                demand = (member.models or {}).get(name)
                if demand is None:
                    continue
                known = totals.get(scaled_object)
                totals[scaled_object] = demand if known is None else Demand(
                    known.queued + demand.queued, known.in_flight + demand.in_flight,
                    known.lease_active or demand.lease_active)
        return totals


read_token_file = read_secret_file  # the report token: reread per report, so rotation needs no restart


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.reports = Counter("noctaya_aggregator_reports", "Demand reports by outcome", ["outcome"],
                               registry=registry)
        self.members = Gauge("noctaya_aggregator_members", "Gateways currently reporting", registry=registry)
        self.queued = Gauge("noctaya_aggregator_queued", "Sum of queued requests", registry=registry)
        self.in_flight = Gauge("noctaya_aggregator_in_flight", "Sum of in-flight requests", registry=registry)
        self.lease = Gauge("noctaya_aggregator_lease_active", "1 when any gateway holds a lease",
                           registry=registry)
        self.models = Gauge("noctaya_aggregator_models", "Models of shared gateways with demand reported",
                            registry=registry)
        self.expired = Counter("noctaya_aggregator_members_expired", "Members dropped after the TTL",
                               registry=registry)


class _Sources:
    """Broadcasters by key (a model name, or a ScaledObject), each kept while its key is reported,
    asked for within a TTL, or waited on; not thread-safe (the Aggregator's lock)."""

    def __init__(self, max_reported: int, ttl: float, clock: Callable[[], float]) -> None:
        self._bound = 2 * max_reported
        self._ttl = ttl
        self._clock = clock
        self._sources: dict[str, DemandBroadcaster] = {}
        self._asked: dict[str, float] = {}
        self.reported: dict[str, Demand] = {}

    def __len__(self) -> int:
        return len(self._sources)

    def publish(self, reported: dict[str, Demand]) -> None:
        previous, self.reported = self.reported, reported
        for key in previous.keys() - reported.keys():  # no longer reported by anyone: no demand
            source = self._sources.get(key)
            if source is not None:
                source.publish(Demand())
        for key, demand in reported.items():
            source = self._sources.get(key)
            if source is None:
                # Always kept: reported keys are at most max_models (MemberTable refuses more). Keys
                # made by reports alone (ScaledObjects) are pruned here, as they come and go.
                self._prune()
                source = self._sources[key] = DemandBroadcaster()
                self._asked.setdefault(key, self._clock())
            source.publish(demand)

    def _prune(self) -> None:
        """With the map full: drop the broadcasters of keys nobody reports, no stream waits on and
        no trigger asked for within a TTL. Only then: a stream holds the object it was given, so an
        entry dropped under it would never wake it again (a full map means callers beyond the
        table's models, and they are the ones to lose)."""
        if len(self._sources) < self._bound:
            return
        limit = self._clock() - self._ttl
        for key in [k for k, source in self._sources.items() if k not in self.reported
                    and source.waiter_count == 0 and self._asked.get(k, 0.0) <= limit]:
            del self._sources[key]
            self._asked.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._sources

    def follow(self, demand_of: Callable[[Any], Demand | None]) -> None:
        """Publish to every kept key what ``demand_of`` says it has now (no demand where it says
        None): for keys made by triggers only, whose demand is derived from other keys'."""
        self.reported = {}
        for key, source in self._sources.items():
            demand = demand_of(key)
            if demand is not None:
                self.reported[key] = demand
            source.publish(demand if demand is not None else Demand())

    def get(self, key: Any) -> DemandBroadcaster:
        """``key``'s broadcaster, made (idle) if need be; beyond the bound one that is not kept."""
        source = self._sources.get(key)
        if source is None:
            self._prune()
            if len(self._sources) >= self._bound:
                return DemandBroadcaster()
            source = self._sources[key] = DemandBroadcaster()
        self._asked[key] = self._clock()
        return source


class Aggregator:
    """Member table + broadcaster + the HTTP report server (``start``/``stop``)."""

    def __init__(
        self,
        settings: AggregatorSettings,
        broadcaster: DemandBroadcaster,
        *,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.broadcaster = broadcaster
        self.registry = registry or CollectorRegistry()
        self._metrics = _Metrics(self.registry)
        # notAfter of the report port's certificate and (when the caller gives the ExternalScaler
        # `certificates.listener("scaler")`) of the gRPC one: this process's expiry gauge.
        self.certificates = ServedCertificates()
        self.registry.register(self.certificates)
        self._table = MemberTable(settings, clock)
        self._clock = clock
        self._lock = threading.Lock()
        # Per model (shared gateways): the broadcaster its ScaledObject is answered from, and when it
        # was last asked for. Reported models are at most max_models; the rest exist only while a
        # trigger asks (a stream must wait on the object a later report publishes to), so the map
        # holds at most 2 * max_models, and unreported, unwatched entries are dropped.
        self._models = _Sources(settings.max_models, settings.member_ttl, clock)
        # Per member's ScaledObject ("<namespace>/<name>"), the same way: what a trigger naming a
        # model nobody reports (a renamed member's new name, before the replicas reload) gets when
        # its ScaledObject is reported. Entries are made by reports only.
        self._scaled_objects = _Sources(settings.max_models, settings.member_ttl, clock)
        # Per (model, ScaledObject) of a trigger that asked while neither was reported (an idle
        # member): it follows the model's demand, else the ScaledObject's. A stream keeps the object
        # it was given, so one opened by a renamed member's new name while the member was idle must
        # still wake when a request arrives under the old name at a replica not yet reloaded.
        self._unlisted = _Sources(settings.max_models, settings.member_ttl, clock)
        self._report_slots = threading.BoundedSemaphore(settings.max_concurrent_reports)
        self._stop = threading.Event()
        self._httpd: _BoundedHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # -- state ----------------------------------------------------------------------------------

    def _publish_locked(self) -> None:
        total = self._table.total()
        self._metrics.members.set(len(self._table))
        self._metrics.queued.set(total.queued)
        self._metrics.in_flight.set(total.in_flight)
        self._metrics.lease.set(1 if total.lease_active else 0)
        self.broadcaster.publish(total)
        reported = self._table.model_totals()
        self._metrics.models.set(len(reported))
        self._models.publish(reported)
        # From every report that carries it, under whichever name: a stream given a ScaledObject's
        # broadcaster keeps following its member after the replicas report the new name.
        self._scaled_objects.publish(self._table.scaled_object_totals())
        self._unlisted.follow(self._unlisted_demand)

    def _unlisted_demand(self, key: tuple[str, str]) -> Demand | None:
        name, scaled_object = key
        demand = self._models.reported.get(name)
        return demand if demand is not None else self._scaled_objects.reported.get(scaled_object)

    def model_source(self, name: str) -> DemandBroadcaster:
        """The demand of ``model`` (the ExternalScaler's resolver for a trigger naming a model): a
        model nobody has reported is idle (inactive, metric 0), never unknown, as the aggregator has
        no table. Beyond the map's bound an unreported model gets an idle broadcaster that is not
        kept (a stream on it stays ``false`` until KEDA reopens it)."""
        with self._lock:
            return self._models.get(name)

    def unlisted_source(self, name: str, namespace: str, scaled_object: str) -> DemandBroadcaster:
        """The answer for a trigger whose model nobody reports and whose ScaledObject no report
        names: idle now, following the model's demand once reported, else its ScaledObject's."""
        key = (name, f"{namespace}/{scaled_object}")
        with self._lock:
            source = self._unlisted.get(key)
            demand = self._unlisted_demand(key)
            source.publish(demand if demand is not None else Demand())
            return source

    def reported_model_source(self, name: str) -> DemandBroadcaster | None:
        """``name``'s demand if some member reports it now, else None (the scaler then asks
        ``scaled_object_source``, then ``model_source``)."""
        with self._lock:
            return self._models.get(name) if name in self._models.reported else None

    def scaled_object_source(self, namespace: str, name: str) -> DemandBroadcaster | None:
        """The demand of the member whose ScaledObject this is, if some member reports a model for
        it now, else None: the answer for a trigger whose model nobody reports (a renamed member,
        asked by its new name before the replicas have reloaded)."""
        key = f"{namespace}/{name}"
        with self._lock:
            return self._scaled_objects.get(key) if key in self._scaled_objects.reported else None

    @property
    def model_count(self) -> int:
        """Models held (reported, or asked for recently)."""
        with self._lock:
            return len(self._models)

    @property
    def scaled_object_count(self) -> int:
        """ScaledObjects held (reported, or asked for recently)."""
        with self._lock:
            return len(self._scaled_objects)

    def apply(self, report: Report, owner: str | None = None) -> str:
        with self._lock:
            outcome = self._table.apply(report, owner)
            self._publish_locked()
        self._metrics.reports.labels(outcome).inc()
        return outcome

    def expire(self) -> int:
        with self._lock:
            dropped = self._table.expire()
            if dropped:
                self._publish_locked()
        if dropped:
            self._metrics.expired.inc(dropped)
            log.info("expired %d silent member(s)", dropped)
        return dropped

    @property
    def member_count(self) -> int:
        with self._lock:
            return len(self._table)

    def try_begin_report(self) -> bool:
        return self._report_slots.acquire(blocking=False)

    def end_report(self) -> None:
        self._report_slots.release()

    def token_matches(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        presented = header[len("Bearer "):].strip().encode("utf-8", "replace")
        files = [self.settings.token_file, self.settings.previous_token_file]
        accepted = [t for t in (read_token_file(f) for f in files if f) if t is not None]
        # Both compared, always: the time taken does not say which one matched.
        matches = [hmac.compare_digest(presented, expected) for expected in accepted]
        return any(matches)

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    # -- serving --------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._httpd is not None, "not started"
        return self._httpd.server_address[1]

    def start(self, host: str = "0.0.0.0", port: int = 9091, tls: TLSFiles | None = None) -> None:
        """Serve reports on host:port, over TLS with ``tls``'s certificate and key when given."""
        context = None
        if tls is not None:
            context = ReloadingServerContext(tls, on_loaded=self.certificates.listener("report"))
        self._httpd = _BoundedHTTPServer((host, port), _ReportHandler, self, context)
        serve = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                 name="aggregator-http", daemon=True)
        expiry = threading.Thread(target=self._expiry_loop, name="aggregator-expiry", daemon=True)
        self._threads = [serve, expiry]
        for thread in self._threads:
            thread.start()
        log.info("aggregator listening on %s:%d", host, self.port)

    def _expiry_loop(self) -> None:
        interval = min(1.0, self.settings.member_ttl / 4)
        while not self._stop.wait(interval):
            try:
                self.expire()
            except Exception:  # keep expiring; a bug here must not freeze the demand forever
                log.exception("member expiry failed")

    def stop(self) -> None:
        self._stop.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for thread in self._threads:
            thread.join(5)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on live connections (one thread each): beyond it a
    connection gets a canned 503 and is closed, so a flood can't spawn unbounded threads."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], aggregator: Aggregator,
                 tls: ReloadingServerContext | None = None):
        self.aggregator = aggregator
        self.tls = tls
        self._connections = threading.BoundedSemaphore(aggregator.settings.max_connections)
        self._per_address: dict[str, int] = {}
        # socket -> when its current request must have fully arrived (None while it is answered)
        self._deadlines: dict[socket.socket, float | None] = {}
        self._guard = threading.Lock()
        self._closed = threading.Event()
        super().__init__(address, handler)
        threading.Thread(target=self._reap_slow_clients, name="aggregator-deadlines", daemon=True).start()

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()

    def _refuse(self, request: socket.socket) -> None:
        if self.tls is None:  # a TLS client would read plaintext as a broken handshake: just close
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
        self.shutdown_request(request)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        peer = str(client_address[0]) if isinstance(client_address, tuple) else ""
        with self._guard:
            crowded = self._per_address.get(peer, 0) >= self.aggregator.settings.max_connections_per_address
            if not crowded:
                self._per_address[peer] = self._per_address.get(peer, 0) + 1
        if crowded:
            self._refuse(request)
            return
        if not self._connections.acquire(blocking=False):
            self._forget_address(peer)
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._connections.release()
            self._forget(request, peer)
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        peer = str(client_address[0]) if isinstance(client_address, tuple) else ""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()
            self._forget(request, peer)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away (or that the deadline cut off) is not an error worth a traceback.
        log.debug("connection from %s ended with an error", client_address[0] if client_address else "?",
                  exc_info=True)

    def _forget_address(self, peer: str) -> None:
        with self._guard:
            left = self._per_address.get(peer, 0) - 1
            if left > 0:
                self._per_address[peer] = left
            else:
                self._per_address.pop(peer, None)

    def _forget(self, request: socket.socket, peer: str) -> None:
        self.forget_deadline(request)
        self._forget_address(peer)

    def forget_deadline(self, request: socket.socket) -> None:
        with self._guard:
            self._deadlines.pop(request, None)

    def expect_request(self, request: socket.socket) -> None:
        """The next request on ``request`` must arrive whole within the deadline."""
        with self._guard:
            self._deadlines[request] = time.monotonic() + self.aggregator.settings.request_deadline

    def answering(self, request: socket.socket) -> None:
        with self._guard:
            if request in self._deadlines:
                self._deadlines[request] = None

    def _reap_slow_clients(self) -> None:
        # A client dribbling bytes keeps every per-read timeout alive; a deadline on the whole
        # request does not, so slow clients cannot hold the slots real reports need.
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._guard:
                late = [sock for sock, due in self._deadlines.items() if due is not None and now > due]
                for sock in late:
                    self._deadlines[sock] = None
            for sock in late:
                try:
                    # The plain socket's shutdown, also for a TLS socket: it wakes the reading thread
                    # without touching the TLS state that thread owns.
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass


class _ReportHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _BoundedHTTPServer
    server_version = "noctaya-aggregator"
    sys_version = ""

    def setup(self) -> None:
        self.timeout = self.server.aggregator.settings.socket_timeout
        if self.server.tls is not None:
            self.request = self._tls_handshake(self.request)
        super().setup()

    def _tls_handshake(self, raw: socket.socket) -> ssl.SSLSocket:
        """The handshake runs here, in this connection's thread and under the request deadline,
        never in the accepting thread: a client that stalls mid-handshake holds only its own slot."""
        raw.settimeout(self.timeout)
        wrapped = self.server.tls.current().wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        self.server.expect_request(wrapped)
        try:
            wrapped.do_handshake()
        except (OSError, ValueError):
            self.server.forget_deadline(wrapped)
            wrapped.close()
            raise
        return wrapped

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self.server.tls is not None:
                # The server closes the plain socket it accepted, which the TLS socket took over.
                self.server.forget_deadline(self.request)
                self.request.close()

    def handle_one_request(self) -> None:
        self.server.expect_request(self.connection)  # each request, keep-alive ones too, has a deadline
        super().handle_one_request()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, code: int, body: dict[str, Any] | bytes, content_type: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, *, close: bool = False, **headers: str) -> None:
        if close:
            self.close_connection = True
            headers["Connection"] = "close"
        self._send(code, {"error": {"message": message, "code": code}}, headers=headers)

    def do_GET(self) -> None:
        self.server.answering(self.connection)
        aggregator = self.server.aggregator
        if self.path == "/healthz":
            self._send(200, {"status": "ok", "members": aggregator.member_count})
        elif self.path == "/metrics":
            self._send(200, aggregator.metrics_text(), CONTENT_TYPE_LATEST)
        else:
            self._error(404, "not found")

    def do_POST(self) -> None:
        aggregator = self.server.aggregator
        if self.path != "/v1/report":
            self._error(404, "not found", close=True)
            return
        # Headers only so far: refuse before reading a byte of body.
        if not aggregator.token_matches(self.headers.get("Authorization")):
            aggregator._metrics.reports.labels("unauthorized").inc()
            self._error(401, "invalid or missing bearer token", close=True)
            return
        if self.headers.get("Transfer-Encoding"):
            self._error(411, "Content-Length required", close=True)
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(411, "Content-Length required", close=True)
            return
        if length < 0 or length > aggregator.settings.max_body_bytes:
            aggregator._metrics.reports.labels("too_large").inc()
            self._error(413, f"report body over {aggregator.settings.max_body_bytes} bytes", close=True)
            return
        if not aggregator.try_begin_report():
            aggregator._metrics.reports.labels("busy").inc()
            self._error(429, "too many concurrent reports", close=True, **{"Retry-After": "1"})
            return
        try:
            try:
                body = self.rfile.read(length)
            except OSError:  # socket timeout of a slow sender: drop the connection quietly
                body = b""
            if len(body) != length:
                self.close_connection = True
                return
            self.server.answering(self.connection)
            try:
                report = parse_report(body)
            except (ValueError, UnicodeDecodeError) as exc:
                aggregator._metrics.reports.labels("invalid").inc()
                message = str(exc) if isinstance(exc, ReportError) else "body is not valid JSON"
                self._error(400, message)
                return
            outcome = aggregator.apply(report, owner=self.client_address[0])
        finally:
            aggregator.end_report()
        if outcome == "full":
            self._error(429, "member limit reached", **{"Retry-After": "2"})
        elif outcome == "models_full":
            self._error(429, "model limit reached", **{"Retry-After": "2"})
        elif outcome == "foreign":
            self._error(403, "member belongs to another address")
        else:
            self._send(200, {"outcome": outcome, "members": aggregator.member_count})

