"""Gateway side of the report protocol: push this gateway's complete demand to the aggregator.

One background loop (a greenlet in the gevent-patched gateway, an OS thread elsewhere) waits on
the DemandBroadcaster and POSTs on every change and every ``interval`` seconds, one request at a
time with a short timeout. It never holds a queue: a burst of transitions collapses into the
latest state. ``publish()`` in the gateway therefore never waits for the network.

Over ``https://`` the aggregator's certificate is verified against ``ca_file`` (the scaler TLS
Secret's ``ca.crt``); the bearer token then never crosses the network in the clear.

Sends are rate-limited to one per ``min_gap`` seconds, except when the active flag flips: the
first cold request must reach KEDA at once, a change of count can wait 50 ms.

A shared gateway's reporter also sends each model's demand (``models``: the models with any demand;
a model left out has none, so a report is still the member's complete state). Its broadcaster then
carries the sum over the models and changes whenever any model's demand does; the per-model
answers are the aggregator's (per ScaledObject trigger metadata ``model``). Each model's object also
names its member's ScaledObject (``scaledObject``: "<namespace>/<name>") when the table does, so the
aggregator can answer a renamed member's ScaledObject before this replica has the new table.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit, urlunsplit

import requests

from scaler.aggregator import MAX_REPORT_MODELS, read_token_file, valid_scaled_object
from scaler.demand import Demand, DemandBroadcaster

__all__ = ["DemandReporter"]

log = logging.getLogger("noctaya.scaler.reporter")


def _without_userinfo(url: str) -> str:
    """The URL for logs: credentials in a user:password@ part must not reach them."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class DemandReporter:
    def __init__(
        self,
        url: str,
        token_file: str,
        broadcaster: DemandBroadcaster,
        member_id: str | None = None,
        interval: float = 2.0,
        timeout: float = 1.0,
        *,
        min_gap: float = 0.05,
        retry_delay: float = 0.25,
        previous_token_file: str | None = None,
        ca_file: str | None = None,
        on_pushed: Callable[[float], None] | None = None,
        models: Callable[[], Mapping[str, Demand]] | None = None,
        on_model_pushed: Callable[[str, float], None] | None = None,
        scaled_objects: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        if ca_file and not url.lower().startswith("https://"):
            # A CA with a plaintext URL means the operator expected TLS: refuse rather than send the
            # token in the clear.
            raise ValueError("a CA file was given for the aggregator but its URL is not https://")
        if interval <= 0 or timeout <= 0 or min_gap < 0 or retry_delay <= 0:
            raise ValueError("interval, timeout and retry_delay must be > 0, min_gap >= 0")
        self.url = url
        self._on_pushed = on_pushed  # called with the time an active demand was first accepted
        # A shared gateway: each model's current demand, and who learns when a model's active
        # demand was first accepted (its activations are timed from that).
        self._models = models
        self._on_model_pushed = on_model_pushed
        # A shared gateway: model -> "<namespace>/<name>" of its member's ScaledObject (the table's).
        self._scaled_objects = scaled_objects
        self.last_models: dict[str, Demand] = {}
        self._log_url = _without_userinfo(url)
        self.token_file = token_file
        # During a token rotation the aggregator may still know only the previous token (the kubelet
        # updates each Pod's mounted Secret on its own schedule): a refused current token is retried
        # with the previous one, once.
        self.previous_token_file = previous_token_file
        self.broadcaster = broadcaster
        self.member_id = member_id or uuid.uuid4().hex
        self.interval = interval
        self.timeout = timeout
        self.min_gap = min_gap
        self.retry_delay = retry_delay
        self._seq = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._session = requests.Session()
        # In-cluster only: never send the report (and its token) through a pod's HTTP(S)_PROXY.
        self._session.trust_env = False
        if ca_file:
            # Read at each new connection (urllib3 builds a context per connection), so a renewed CA
            # in the mounted Secret is used from the next reconnect on.
            self._session.verify = ca_file
        self._post_lock = threading.Lock()  # the session and seq belong to one sender at a time
        self._last_error_log = -1e18
        self.sent = 0
        self.failures = 0
        self.last_sent: Demand | None = None

    # -- one POST -------------------------------------------------------------------------------

    def _post(self, demand: Demand, *, withdraw: bool = False) -> bool:
        with self._post_lock:
            return self._post_locked(demand, withdraw)

    def _post_locked(self, demand: Demand, withdraw: bool) -> bool:
        token = read_token_file(self.token_file)
        if token is None:
            self._log_failure("aggregator token file is missing, empty or oversized")
            return False
        self._seq += 1
        body: dict[str, object] = {
            "member": self.member_id, "seq": self._seq, "queued": demand.queued,
            "inFlight": demand.in_flight, "leaseActive": demand.lease_active, "withdraw": withdraw,
        }
        models = self._model_demands(withdraw)
        if models is not None:
            body["models"] = {name: {"queued": d.queued, "inFlight": d.in_flight, "leaseActive": d.lease_active}
                              for name, d in models.items()}
            for name, scaled_object in self._scaled_objects_of(models).items():
                body["models"][name]["scaledObject"] = scaled_object
        # What requests' json= sends (the same bytes for a per-model gateway), but UTF-8 as it is: a
        # model name of non-ASCII characters costs its bytes, not 6 per character.
        data = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
        previous = read_token_file(self.previous_token_file) if self.previous_token_file else None
        tokens = [token] + ([previous] if previous is not None and previous != token else [])
        try:
            for attempt in tokens:
                response = self._session.post(
                    self.url, data=data, timeout=self.timeout,
                    headers={"Authorization": "Bearer " + attempt.decode("utf-8", "replace"),
                             "Content-Type": "application/json"},
                )
                if response.status_code != 401:
                    break
        except requests.RequestException as exc:
            # The exception text can carry the URL but never the headers; log only its type.
            self._log_failure(f"report failed: {type(exc).__name__}")
            return False
        if response.status_code != 200:
            self._log_failure(f"report refused: HTTP {response.status_code}")
            return False
        self.sent += 1
        if models is not None:
            self._models_accepted(models)
        return True

    def _model_demands(self, withdraw: bool) -> dict[str, Demand] | None:
        """The models with demand (at most MAX_REPORT_MODELS, the aggregator's bound: a table holds
        no more, though models a reload removed may still finish requests for a while)."""
        if self._models is None:
            return None
        if withdraw:
            return {}
        busy = {name: d for name, d in self._models().items() if d != Demand()}
        if len(busy) > MAX_REPORT_MODELS:
            self._log_failure(f"{len(busy)} models with demand; reporting the first {MAX_REPORT_MODELS}")
            busy = dict(list(busy.items())[:MAX_REPORT_MODELS])
        return busy

    def _scaled_objects_of(self, models: Mapping[str, Demand]) -> dict[str, str]:
        """The ScaledObjects of the reported models that the table names one for. One the aggregator
        would refuse (not "<namespace>/<name>") is left out rather than cost the whole report."""
        if self._scaled_objects is None or not models:
            return {}
        try:
            known = self._scaled_objects()
        except Exception:  # the demand matters more than this hint: report without it
            log.exception("scaled_objects failed")
            return {}
        return {name: so for name in models if valid_scaled_object(so := known.get(name))}

    def _models_accepted(self, models: dict[str, Demand]) -> None:
        now = time.monotonic()
        if self._on_model_pushed is not None:
            for name, demand in models.items():
                previous = self.last_models.get(name)
                if demand.active and not (previous is not None and previous.active):
                    try:
                        self._on_model_pushed(name, now)
                    except Exception:  # an observer's bug must not stop the reports
                        log.exception("on_model_pushed failed")
        self.last_models = models

    def _log_failure(self, message: str) -> None:
        self.failures += 1
        now = time.monotonic()
        if now - self._last_error_log >= 10.0:  # one line per 10 s, a dead aggregator is one fact
            self._last_error_log = now
            log.warning("%s (url=%s, failures so far=%d)", message, self._log_url, self.failures)

    # -- loop -----------------------------------------------------------------------------------

    def start(self) -> DemandReporter:
        if self._thread is not None:
            raise RuntimeError("already started")
        self._thread = threading.Thread(target=self._run, name="demand-reporter", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        seen_version = -1
        next_heartbeat = 0.0  # send at once on start
        not_before = 0.0
        pending = True
        failures_in_a_row = 0
        while not self._stopping:
            now = time.monotonic()
            due = next_heartbeat if not pending else max(not_before, now)
            try:
                version, demand = self.broadcaster.wait_for_change(seen_version, max(0.0, due - now))
            except Exception as exc:  # a broken source: keep the loop, try again shortly
                self._log_failure(f"demand source failed: {type(exc).__name__}")
                self._sleep(self.retry_delay)
                continue
            if self._stopping:
                break
            if version != seen_version:
                seen_version = version
                pending = True
            now = time.monotonic()
            flag_flipped = self.last_sent is None or demand.active != self.last_sent.active
            if pending and (now >= not_before or flag_flipped) or now >= next_heartbeat:
                ok = self._post(demand)
                now = time.monotonic()
                if ok:
                    if demand.active and not (self.last_sent is not None and self.last_sent.active) and self._on_pushed:
                        self._on_pushed(now)
                    self.last_sent, pending = demand, False
                    next_heartbeat = now + self.interval
                    not_before = now + self.min_gap
                    failures_in_a_row = 0
                else:
                    # Retry soon (an activation edge matters), backing off to the heartbeat interval
                    # so a refusing or dead aggregator isn't hammered by every gateway.
                    failures_in_a_row += 1
                    pending = True
                    not_before = now + min(self.interval, self.retry_delay * 2 ** min(failures_in_a_row - 1, 16))
                    next_heartbeat = now + self.interval

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))

    def stop(self, withdraw: bool = True) -> None:
        """Stop the loop and withdraw this member (one bounded POST), so the aggregator drops our
        demand now rather than after its TTL."""
        self._stopping = True
        self.broadcaster.interrupt_waiters()
        if self._thread is not None:
            self._thread.join(self.timeout + 2.0)
        if withdraw:
            self._post(Demand(), withdraw=True)
        self._session.close()
