"""The handler of a shared gateway: one OpenAI endpoint for the models of a model table.

Routing by the body's top-level ``model`` (bounded scan, gateway.jsonscan); ``GET /v1/models``
listing the models whether cold or warm (answered here: listing wakes nothing), only those the
caller's key opens; OpenAI's 404 ``model_not_found`` ("The model `X` does not exist or you do not
have access to it.") for a model not in the table and, to a caller with a valid key (a key of some
model), for a keyed model its key does not open: the same answer, decided by the same lookup (see
:meth:`SharedGatewayApp._refusal`); 401 for a keyed or unknown model without a valid key; one
Pod-wide held-body budget; per model everything the per-model gateway has (its own
``GatewayApp``: admission and ``maxQueue``, activation lease, readiness prober, cold modes, upstream
pool); API keys per model (``authKeyFile`` or ``authKeyFiles``: a model's keys open that model
only; while every model has keys, a token that is no key of any model is refused before its body is
read); ``/metrics`` with a ``model`` label;
``/noctaya/queue`` per model; reloading (:meth:`apply`). docs/architecture.md, "Shared gateway model
table".

The connection layer (``gateway.server``) and the drain (``gateway.drain``) drive this app exactly
as a ``GatewayApp``: ``handle``, ``bad_request``, ``background``, ``close``, ``connection_refused``,
``start_draining``, ``admitted``, ``waiting``, ``abort_waiters``, ``withdraw``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from urllib.parse import unquote

import gevent

from gateway import metrics as metrics_module
from gateway.auth import KeyIndex
from gateway.config import GatewayConfig
from gateway.endpointslices import EndpointFeed
from gateway.errors import model_not_found
from gateway.filewatch import DirectoryWatch, watch_directory
from gateway.jsonscan import InvalidJSON, inspect_json_body
from gateway.metrics import GatewayMetrics, RenderedOnce
from gateway.modeltable import MAX_MODEL_NAME, ModelTable, ModelTableFile, TableChange
from gateway.multipart import InvalidMultipart, ModelFieldTooLong, is_multipart, multipart_model
from gateway.policy import MAX_JSON_DEPTH, is_json, route
from gateway.routes import AnswersHere, GatewayApp, RequestBody, answer_body_failure, answer_error, yield_to_loop
from gateway.server import (
    ClientBodyError,
    ClientConnection,
    ClientGone,
    HeldBytesExhausted,
    RequestBodyTooLarge,
)
from gateway.slices import Slice
from gateway.state.admission import HeldBytesBudget, ModelShare
from gateway.state.models import ModelDemand
from gateway.state.pod import PodState
from gateway.state.uploads import UploadBudget, UploadRefused
from gateway.timing import produces_tokens
from gateway.wire import RequestHead

__all__ = ["SharedGatewayApp", "RELOAD_SECONDS", "WATCHED_RELOAD_SECONDS"]

log = logging.getLogger("noctaya.gateway")

# How often the mounted table is checked (one stat) where its directory cannot be watched (and how
# soon retired models are looked at while they finish). The kubelet itself takes up to a minute to
# update a ConfigMap volume, so a few seconds more cost nothing.
RELOAD_SECONDS = 5.0
# With an inotify watch on the table's directory a change wakes the gateway at once; the check then
# runs only this often besides, as a bound on what a missed event (a replaced directory) could cost.
WATCHED_RELOAD_SECONDS = 60.0


def _model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "noctaya"}


_SAMPLES_PER_SLICE = 512  # formatted between two looks at the CPU time (~1 ms)
# From this many models on, /metrics is rendered at most once a second (gateway.metrics.RenderedOnce):
# ~2 ms of CPU a model, so 16 models are ~30 ms a scrape, and 256 half a second.
CACHED_METRICS_FROM_MODELS = 16


class _Families:
    """A collector of metric families already built."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self) -> list:
        return self._families


class SharedGatewayApp(AnswersHere):
    """Construct inside the hub thread that will serve it (like ``GatewayApp``)."""

    def __init__(self, config: GatewayConfig, table: ModelTable, *, table_file: ModelTableFile | None = None,
                 demand: ModelDemand | None = None, reload_seconds: float = RELOAD_SECONDS,
                 clock: Callable[[], float] = time.monotonic, pod: PodState | None = None,
                 feed: EndpointFeed | None = None, namespace: str = "") -> None:
        self.feed = feed  # every model's backend Pods, one watch for the namespace (gateway.backends)
        self.namespace = namespace
        self.demand = demand  # each model's demand for the scaler (None: not published, tests)
        self.table_file = table_file
        self.reload_seconds = reload_seconds
        self._reported: str | None = None
        self.config = config
        self.clock = clock
        self.draining = False
        # Pod-level answers (unknown model, bad requests, refusals) and ``pod``'s scaler certificate.
        self.metrics = GatewayMetrics(pod)
        self.budget = HeldBytesBudget(config.max_held_body_bytes)
        # Bodies still arriving, before their model is known: per client address, never the held budget.
        self.uploads = UploadBudget(config.upload_bytes, config.upload_bytes_per_address)
        self._shares: dict[str, ModelShare] = {}  # each model's bounded share of ``budget``
        # Per model: its own slots, lease, prober and pool. Held bytes count against the Pod's budget.
        self.table = table
        self.apps: dict[str, GatewayApp] = {name: self._new_app(model) for name, model in table.models.items()}
        if demand is not None:
            demand.set_scaled_objects(dict(table.scaled_objects))
        self._listing = self._list()
        self._index = self._key_index()
        self._open = self._open_models()
        self._retry_429 = [(b"Retry-After", b"%d" % config.queue_full_retry_after_seconds)]
        # Apps of models removed or changed by a new table: they finish what they admitted, then close.
        self._retiring: list[GatewayApp] = []
        self._tasks: dict[int, list[gevent.Greenlet]] = {}  # id(app) -> its background greenlets
        self._rendered = RenderedOnce(self.render_metrics, worth_caching=lambda: len(self.apps) >= CACHED_METRICS_FROM_MODELS)
        self._serving = False

    def _new_app(self, model: GatewayConfig) -> GatewayApp:
        name = model.served_model_name
        pod = self.demand.pod_for(name, model.max_queue) if self.demand else PodState(1, model.max_queue, None)
        return GatewayApp(model, pod=pod, clock=self.clock, feed=self.feed, namespace=self.namespace)

    def _close(self, app: GatewayApp) -> None:
        for greenlet in self._tasks.pop(id(app), []):
            greenlet.kill(block=False)
        app.close()
        if self.demand is not None:
            name = app.config.served_model_name
            self.demand.release(name, app.pod, listed=self.apps.get(name) not in (None, app))

    def _list(self) -> bytes:
        return json.dumps({"object": "list", "data": [_model_object(n) for n in self.apps]}).encode()

    def _key_index(self) -> KeyIndex | None:
        """Every keyed model's key files, each mapped to the models it opens: which models a token
        opens is one lookup (None: no model has keys)."""
        owners: dict[str, list[str]] = {}
        for name, app in self.apps.items():
            if app.auth is not None:
                for path in app.config.key_files:
                    owners.setdefault(path, []).append(name)
        return KeyIndex(owners) if owners else None

    def _open_models(self) -> frozenset[str]:
        return frozenset(name for name, app in self.apps.items() if app.auth is None)

    @property
    def _keys(self) -> KeyIndex | None:
        """The key check before the body names its model: none while some model takes requests
        without a key (any caller may be one of its); else the token must be a key of some model
        (which model's, is checked once the body names it)."""
        return self._index if self._all_keyed else None

    @property
    def _all_keyed(self) -> bool:
        return bool(self.apps) and all(app.auth is not None for app in self.apps.values())

    def _opens(self, authorization: bytes | None) -> frozenset[str]:
        """The keyed models the caller's bearer token opens (as of the index's last reread)."""
        return frozenset() if self._index is None else self._index.opens(authorization)

    def _visible(self, authorization: bytes | None) -> list[str]:
        """The models this caller may see: those without keys, and those its bearer key opens (one
        lookup in the key index, whatever the number of models and files)."""
        opened = self._opens(authorization)
        return [name for name, app in self.apps.items() if app.auth is None or name in opened]

    def _refusal(self, model: str, authorization: bytes | None) -> str | None:
        """Why the caller may not use ``model`` (None: it may). A model not in the table and a keyed
        model the caller's key does not open take the same steps, whatever the table holds: one dict
        lookup for the model's app, one set lookup in what the key opens (the key index: no file is
        read for either), so neither the answer nor its time tells which models exist. A token that
        opens some model is a valid key: the answer is 404 ``model_not_found``, as OpenAI's; a token
        that opens nothing (or none) is 401, for an unknown model as for a keyed one. Only a model
        the index says the key opens has its own files reread (a key revoked since the index's last
        reread: 401)."""
        opened = self._opens(authorization)
        if model in self._open:  # a model without keys: any caller
            return None
        if model in opened:
            auth = self.apps[model].auth  # the index is built from the table's apps
            return None if auth is not None and auth.check(authorization) else "unauthorized"
        if opened or self._index is None:  # a valid key, or a table without keys
            return "model_not_found"
        return "unauthorized"

    # -- membership ----------------------------------------------------------------------------------
    def apply(self, table: ModelTable) -> TableChange:
        """Serve ``table`` from the next request on (call in the hub thread). An added model starts
        cold; a removed one is answered as an unknown model from now on; a changed one gets a new app.
        The old apps of removed and changed models finish every request they admitted (held cold
        requests included) and close once they have none; other models are not touched. A renamed
        one (same member, new name) keeps its app, so its held requests, lease and demand carry on
        under the new name."""
        change = self.table.diff(table)
        for old, new in change.renamed:
            self._rename(old, new, table.models[new])
        for name in (*change.removed, *change.changed):
            self._retiring.append(self.apps.pop(name))
        for name in (*change.added, *change.changed):
            app = self.apps[name] = self._new_app(table.models[name])
            if self._serving:
                self._start(app)
        # Keep the table's order (the listing's).
        self.apps = {name: self.apps[name] for name in table.models}
        self.table = table
        if self.demand is not None:
            self.demand.set_scaled_objects(dict(table.scaled_objects))
        self._listing = self._list()
        self._index = self._key_index()
        self._open = self._open_models()
        # Shares of models no longer served go (their reservations keep what they hold): the dict stays
        # bounded by the table however many names came and went.
        self._shares = {name: share for name, share in self._shares.items() if name in table.models}
        self.reap()
        return change

    def _rename(self, old: str, new: str, config: GatewayConfig) -> None:
        """Move ``old``'s app to ``new``. Its demand moves first: KEDA's ScaledObject for the member
        asks by the new name once the hooks rewrote it, and the requests held under the old name are
        what wakes the backend. Other settings changed too: a new app, the old one retiring (its
        held requests still count for the member)."""
        app = self.apps.pop(old)
        if self.demand is not None:
            self.demand.rename(old, new)
        if dataclasses.replace(app.config, served_model_name=new) == config:
            app.rename(new)
            self.apps[new] = app
            return
        self._retiring.append(app)
        app = self.apps[new] = self._new_app(config)
        if self._serving:
            self._start(app)

    def reap(self) -> None:
        """Close retired apps that have nothing admitted any more."""
        still = []
        for app in self._retiring:
            if app.admitted:
                still.append(app)
                continue
            self._close(app)
        self._retiring = still

    def _start(self, app: GatewayApp) -> None:
        self._tasks[id(app)] = [gevent.spawn(task) for task in app.background()]

    # -- lifecycle (see the module docstring) ------------------------------------------------------
    def background(self) -> list[Callable[[], None]]:
        return [self._run]

    def _run(self) -> None:
        """Every model's background tasks, and (with a table file) its reloads."""
        self._serving = True
        for app in self.apps.values():
            self._start(app)
        if self.table_file is None:
            return
        watch = watch_directory(os.path.dirname(os.path.abspath(self.table_file.path)))
        try:
            while True:
                self._wait_for_table(watch)
                self._reload()
        finally:
            if watch is not None:
                watch.close()

    def _wait_for_table(self, watch: DirectoryWatch | None) -> None:
        if watch is None:
            gevent.sleep(self.reload_seconds)
        else:  # retired models are looked at again soon: they close once their requests are done
            watch.wait(self.reload_seconds if self._retiring else max(self.reload_seconds, WATCHED_RELOAD_SECONDS))

    def _reload(self) -> None:
        assert self.table_file is not None
        table = self.table_file.poll()
        if table is not None:
            change = self.apply(table)
            log.info("model table reloaded", extra={"added": list(change.added), "removed": list(change.removed),
                                                    "changed": list(change.changed),
                                                    "renamed": [f"{old} -> {new}" for old, new in change.renamed]})
        elif self.table_file.error is not None and self.table_file.error != self._reported:
            log.error("model table refused; the last good one stays", extra={"error": self.table_file.error})
        self._reported = self.table_file.error
        self.reap()

    def close(self) -> None:
        for app in [*self.apps.values(), *self._retiring]:
            self._close(app)

    def announce_shutdown(self) -> None:
        super().announce_shutdown()
        for app in self.apps.values():
            app.announce_shutdown()

    def start_draining(self) -> None:
        super().start_draining()
        for app in self.apps.values():
            app.start_draining()

    @property
    def admitted(self) -> int:
        return sum(app.admitted for app in self.apps.values())

    @property
    def waiting(self) -> int:
        return sum(app.waiting for app in self.apps.values())

    def abort_waiters(self) -> None:
        for app in self.apps.values():
            app.abort_waiters()

    def withdraw(self) -> None:
        for app in self.apps.values():
            app.withdraw()

    def queue_json(self) -> bytes:
        """``/noctaya/queue``: each model's admission, lease and readiness (as a per-model gateway
        shows its own), and the Pod-wide held-body budget."""
        # A snapshot of the apps: the admin port's thread reads them while the loop may apply a new table.
        models = ",".join(f"{json.dumps(name)}:{app.queue_json().decode()}" for name, app in list(self.apps.items()))
        return (f'{{"heldBytes":{self.budget.held_bytes},"heldBytesLimit":{self.budget.max_bytes},'
                f'"draining":{json.dumps(self.draining)},"models":{{{models}}}}}').encode()

    def render_metrics(self) -> bytes:
        """Every model's gateway metrics with a ``model`` label (bounded by the table's 256), and the
        answers given before a model was known (unknown model, bad requests, refusals) as
        ``model=""``."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import Metric

        families: dict[str, Metric] = {}
        work = Slice()  # 256 models' families are ~0.5 s of CPU: the loop gets its turns in between
        for model, registry in [("", self.metrics.registry), *((n, a.metrics.registry) for n, a in list(self.apps.items()))]:
            work.check()
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(sample._replace(labels={"model": model, **sample.labels})
                                      for sample in family.samples)
        # Text a slice at a time (the 256-model exposition is ~4 MB): a family's samples in runs, each
        # run's HELP and TYPE lines kept for the first only, so each family appears once.
        out = []
        for family in families.values():
            samples = family.samples
            for start in range(0, max(1, len(samples)), _SAMPLES_PER_SLICE):
                run = Metric(family.name, family.documentation, family.type, family.unit)
                run.samples = samples[start:start + _SAMPLES_PER_SLICE]
                registry = CollectorRegistry(auto_describe=False)
                registry.register(_Families([run]))
                text = generate_latest(registry)
                out.append(text if start == 0 else text.split(b"\n", 2)[2])
                work.check()
        return b"".join(out)

    # -- requests ------------------------------------------------------------------------------------
    def handle(self, conn: ClientConnection, head: RequestHead) -> bool:
        if self.unready or self.draining:
            conn.keep_alive = False
        decision = route(head, head.path, admin=conn.admin, draining=self.draining, auth=self._keys,
                         max_body=self.config.max_body_bytes)
        try:
            if decision.kind == "error":
                return answer_error(conn, self.metrics, decision.error, close=decision.close)
            if decision.kind == "health":
                return self._health(conn, head)
            if decision.kind == "metrics":
                return self._ok(conn, self._rendered.get(), metrics_module.CONTENT_TYPE_LATEST.encode())
            if decision.kind == "models":
                return self._models(conn, head)
            if decision.kind == "forward":
                return self._forward(conn, head)
            return self._ok(conn, self.queue_json())  # /noctaya/queue
        except ClientGone:
            return False

    def _models(self, conn: ClientConnection, head: RequestHead) -> bool:
        """From the table, whether each model is cold or warm: listing never wakes a model. Only the
        models the caller may use are shown; one it may not is not found, exactly like an unknown
        one, so the listing never shows a key the other models (a request naming one is refused
        with 401, as a wrong key is). A key that opens nothing while every model is keyed is refused,
        as its request for any model would be."""
        path = head.path
        model_id = unquote(path[len("/v1/models/"):]) if len(path) > len("/v1/models/") else ""
        if not any(app.auth is not None for app in self.apps.values()):  # nothing keyed: no file read
            visible = list(self.apps)
        else:
            visible = self._visible(head.authorization)
            if not visible and self._all_keyed:
                return answer_error(conn, self.metrics, "unauthorized")
        if not model_id:
            if len(visible) == len(self.apps):
                return self._ok(conn, self._listing)
            return self._ok(conn, json.dumps({"object": "list", "data": [_model_object(n) for n in visible]}).encode())
        if model_id in visible:
            return self._ok(conn, json.dumps(_model_object(model_id)).encode())
        return answer_error(conn, self.metrics, "model_not_found", error=model_not_found(model_id))

    def _forward(self, conn: ClientConnection, head: RequestHead) -> bool:
        """Read the whole body against the upload bounds, find its model, hand it to that model's app
        with a reservation from that model's share of the Pod's held budget."""
        conn.timing.start(head.arrived, produces_tokens(head.method, head.path))
        upload = self.uploads.reservation(conn.peer)
        reservation = None
        try:
            data = b""
            if head.has_body:
                conn.continue_100(head)
                data = conn.read_body(self.config.max_body_bytes, upload)
            if is_multipart(head.content_type):  # audio uploads: routed by their form's model field
                # A name is at most MAX_MODEL_NAME characters, each at most 4 bytes of UTF-8.
                model = multipart_model(head.content_type or b"", data, MAX_MODEL_NAME * 4)
            else:
                model = self._model_of(head, data)
            if model is None:
                return answer_error(conn, self.metrics, "invalid_json")
            refusal = self._refusal(model, head.authorization)
            if refusal is not None:  # unknown, or not this key's: the same answer
                return answer_error(conn, self.metrics, refusal, error=model_not_found(model)
                                    if refusal == "model_not_found" else None)
            app = self.apps[model]
            if len(data) > app.config.max_body_bytes:
                return answer_error(conn, self.metrics, "too_large")
            reservation = self._share(model).reservation()
            return app.dispatch(conn, head, RequestBody(data, reservation, upload))
        except (ClientBodyError, RequestBodyTooLarge, HeldBytesExhausted, UploadRefused) as exc:
            return answer_body_failure(conn, self.metrics, exc, self._retry_429)
        except InvalidMultipart:
            return answer_error(conn, self.metrics, "invalid_multipart")
        except ModelFieldTooLong:
            return answer_error(conn, self.metrics, "model_too_long")
        finally:
            upload.release()
            if reservation is not None:
                reservation.release()

    def _share(self, model: str) -> ModelShare:
        """``model``'s share of the held budget: one cold model cannot hold all of it."""
        share = self._shares.get(model)
        if share is None:
            share = self._shares[model] = ModelShare(self.budget, self.config.held_bytes_per_model)
        return share

    @staticmethod
    def _model_of(head: RequestHead, data: bytes) -> str | None:
        """The top-level ``model`` of a JSON body; "" when the body has none (no such model exists,
        so it is answered ``model_not_found``); None when the body is not acceptable JSON."""
        if not data or not is_json(head.content_type, data):
            return ""
        try:
            facts = inspect_json_body(data, max_depth=MAX_JSON_DEPTH, pause=yield_to_loop)
        except InvalidJSON:
            return None
        return facts.model or ""
