"""The backend Pods of each Service, from the Kubernetes API: a list-then-watch of EndpointSlices
(discovery.k8s.io/v1) in the gateway's own namespace, as a kube-proxy or an ingress controller
reads them.

Why EndpointSlices and not a headless Service's DNS (docs/architecture.md, "Backend Pods"): a watch
brings a change within the API server's fan-out (tens of milliseconds; DNS answers are cached for
their TTL), it carries every Pod with an address *including those not yet Ready* (so the gateway can
probe a loading engine itself and forward the moment it answers) with the kubelet's ``ready``,
``serving`` and ``terminating`` conditions (DNS lists Ready addresses only, or every address without
conditions), and it needs one narrow credential: ``list`` and ``watch`` of EndpointSlices in the
gateway's own namespace (the rendered Role grants nothing else: no Secret, no write).

The watch runs in a thread of its own with the standard library's blocking HTTPS client, so the
gateway's event loop never waits on the API server; each change is handed to the loop by
:class:`EndpointFeed` (a libev async watcher, safe to signal from any thread), which tells each
model's subscriber the Pods of its Service. Until the first list succeeds, and whenever the watch
has failed for ``STALE_SECONDS``, a subscriber is told ``None``: the gateway then uses the Service
address, as without a source. Everything is bounded: slices kept (``MAX_SLICES``), endpoints per
slice (1,000 by the API, ``MAX_ENDPOINTS`` here), one watch event's size (``MAX_EVENT_BYTES``), the
list pages, and the back-off between attempts (1 s doubling to ``MAX_BACKOFF_SECONDS``).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.state.endpoints import PodEndpoint

__all__ = ["InClusterCredentials", "NotInCluster", "SliceWatch", "EndpointFeed", "ParsedSlice", "parse_slice",
           "service_of", "SERVICE_ACCOUNT_DIR", "STALE_SECONDS"]

log = logging.getLogger("noctaya.gateway.endpoints")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MAX_SLICES = 4096
MAX_ENDPOINTS = 1000
MAX_EVENT_BYTES = 4 * 1024 * 1024
LIST_PAGE = 500
WATCH_SECONDS = 290  # the API server ends a watch after this; the client's read timeout is longer
READ_TIMEOUT_SECONDS = 330.0
CONNECT_TIMEOUT_SECONDS = 10.0
MAX_BACKOFF_SECONDS = 30.0
STALE_SECONDS = 15.0  # a watch failing this long: subscribers fall back to the Service address
MIN_WATCH_SECONDS = 5.0  # a watch that ends sooner (not expired) waits the back-off before the next list


class NotInCluster(Exception):
    """No API server credentials here (the message says what is missing)."""


@dataclass(frozen=True)
class InClusterCredentials:
    """What the kubelet gives a Pod with a service account: the API server's address in env, a
    token (projected, rotated: reread for every connection), the cluster CA and the namespace."""

    host: str
    port: int
    token_file: Path
    ca_file: Path
    namespace: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str], account_dir: str = SERVICE_ACCOUNT_DIR) -> InClusterCredentials:
        host = environ.get("KUBERNETES_SERVICE_HOST", "")
        port = environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise NotInCluster("KUBERNETES_SERVICE_HOST is not set")
        base = Path(account_dir)
        for name in ("token", "ca.crt", "namespace"):
            if not (base / name).is_file():
                raise NotInCluster(f"{base / name} is missing (no service account token mounted)")
        namespace = (base / "namespace").read_text().strip()
        if not namespace:
            raise NotInCluster(f"{base / 'namespace'} is empty")
        try:
            port_number = int(port)
        except ValueError:
            raise NotInCluster(f"KUBERNETES_SERVICE_PORT is not a port: {port[:20]!r}") from None
        return cls(host, port_number, base / "token", base / "ca.crt", namespace)

    def token(self) -> str:
        return self.token_file.read_text().strip()


def service_of(backend_host: str, namespace: str) -> str | None:
    """The Service a backend URL's host names in ``namespace``: ``<svc>``, ``<svc>.<ns>``,
    ``<svc>.<ns>.svc`` or ``<svc>.<ns>.svc.<domain>``; None for an address or another namespace."""
    labels = backend_host.rstrip(".").split(".")
    if not labels[0] or labels[0][0].isdigit() or ":" in backend_host:
        return None
    if len(labels) == 1:
        return labels[0]
    if labels[1] != namespace or (len(labels) > 2 and labels[2] != "svc"):
        return None
    return labels[0]


@dataclass(frozen=True)
class ParsedSlice:
    service: str
    ports: tuple[tuple[str, int], ...]  # (name, port) of TCP ports
    endpoints: tuple[tuple[str, str, bool, bool, bool], ...]  # (pod name, address, ready, serving, terminating)


def _condition(conditions: Mapping[str, Any], name: str, default: bool) -> bool:
    value = conditions.get(name)
    return default if value is None else bool(value)


def _endpoint(raw: Any) -> tuple[str, str, bool, bool, bool] | None:
    if not isinstance(raw, dict):
        return None
    addresses = raw.get("addresses")
    if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
        return None
    address = addresses[0][:64]
    conditions = raw.get("conditions") if isinstance(raw.get("conditions"), dict) else {}
    ready = _condition(conditions, "ready", True)  # nil = ready (discovery.k8s.io/v1 API docs)
    serving = _condition(conditions, "serving", ready)
    terminating = _condition(conditions, "terminating", False)
    ref = raw.get("targetRef") if isinstance(raw.get("targetRef"), dict) else {}
    name = ref.get("name") if isinstance(ref.get("name"), str) and ref.get("name") else address
    return (name[:253], address, ready, serving, terminating)


def parse_slice(obj: Any) -> ParsedSlice | None:
    """An EndpointSlice object's service, TCP ports and IP endpoints (None: not a usable slice)."""
    if not isinstance(obj, dict) or obj.get("addressType") not in ("IPv4", "IPv6"):
        return None
    labels = (obj.get("metadata") or {}).get("labels") or {}
    service = labels.get(SERVICE_NAME_LABEL) if isinstance(labels, dict) else None
    if not isinstance(service, str) or not service:
        return None
    ports = []
    for port in obj.get("ports") or []:
        if isinstance(port, dict) and port.get("protocol", "TCP") == "TCP" and isinstance(port.get("port"), int):
            ports.append((str(port.get("name") or ""), port["port"]))
    endpoints = [e for e in map(_endpoint, (obj.get("endpoints") or [])[:MAX_ENDPOINTS]) if e is not None]
    return ParsedSlice(service, tuple(ports), tuple(endpoints))


def pick_port(ports: tuple[tuple[str, int], ...], port_name: str) -> int | None:
    """The slice's port for the backend: the one named ``port_name``, else its only TCP port."""
    for name, number in ports:
        if name == port_name:
            return number
    return ports[0][1] if len(ports) == 1 else None


def endpoints_of(slices: list[ParsedSlice], port_name: str) -> tuple[PodEndpoint, ...]:
    """One Service's Pods over its slices (a Pod listed twice while it moves between slices: once)."""
    found: dict[str, PodEndpoint] = {}
    for parsed in slices:
        port = pick_port(parsed.ports, port_name)
        if port is None:
            continue
        for name, address, ready, serving, terminating in parsed.endpoints:
            found[name] = PodEndpoint(name, address, port, ready, serving, terminating)
    return tuple(sorted(found.values(), key=lambda e: e.name))


class _Failed(Exception):
    """One attempt failed; ``kind`` is what the log says once per kind."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class _Expired(Exception):
    """410 Gone: the watch's resourceVersion is too old: list again."""


class SliceWatch:
    """List-then-watch of the namespace's EndpointSlices (optionally one Service's) in a thread.
    ``on_change(snapshot)`` is called from that thread with every slice by name (or None when the
    source has been failing for ``STALE_SECONDS``)."""

    def __init__(self, credentials: InClusterCredentials, on_change: Callable[[dict[str, ParsedSlice] | None], None],
                 *, label_selector: str = "", stale_seconds: float = STALE_SECONDS) -> None:
        self.credentials = credentials
        self.on_change = on_change
        self.label_selector = label_selector
        self.stale_seconds = stale_seconds
        self.slices: dict[str, ParsedSlice] = {}
        self.synced = False
        self.lists = 0  # successful lists (a relist after an expired watch counts)
        self.failures = 0
        self._stop = threading.Event()
        self._conn: http.client.HTTPSConnection | None = None
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        self._logged: set[str] = set()
        self._failing_since: float | None = None

    def start(self) -> SliceWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                version = self._list()
                backoff = 1.0
                self._failing_since = None
                watched = time.monotonic()
                self._watch(version)
                if time.monotonic() - watched < MIN_WATCH_SECONDS:  # a proxy or server cutting every watch
                    raise _Failed("watch_ended_early", "the API server ended the watch at once")
            except _Expired:
                continue  # list again at once
            except _Failed as exc:
                self._failed(exc)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                self._failed(_Failed("connection", type(exc).__name__))
            finally:
                self._close()
            if self._stop.wait(backoff * random.uniform(0.8, 1.2)):
                return
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _failed(self, exc: _Failed) -> None:
        self.failures += 1
        if exc.kind not in self._logged:  # once per kind: a missing Role must not flood the log
            self._logged.add(exc.kind)
            log.warning("endpoint source failing; using the backend Service address meanwhile",
                        extra={"reason": str(exc)[:200]})
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if self.synced and now - self._failing_since >= self.stale_seconds:
            self.synced = False
            self.on_change(None)

    # -- HTTP -------------------------------------------------------------------------------------
    def _path(self, **params: str) -> str:
        query = {"labelSelector": self.label_selector, **params} if self.label_selector else params
        base = f"/apis/discovery.k8s.io/v1/namespaces/{urllib.parse.quote(self.credentials.namespace)}/endpointslices"
        return base + ("?" + urllib.parse.urlencode(query) if query else "")

    def _request(self, path: str) -> http.client.HTTPResponse:
        creds = self.credentials
        context = ssl.create_default_context(cafile=str(creds.ca_file))
        conn = http.client.HTTPSConnection(creds.host, creds.port, context=context, timeout=CONNECT_TIMEOUT_SECONDS)
        self._conn = conn
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, option):
                conn.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        conn.sock.settimeout(READ_TIMEOUT_SECONDS)
        conn.request("GET", path, headers={"Authorization": f"Bearer {creds.token()}", "Accept": "application/json",
                                           "User-Agent": "noctaya-gateway"})
        response = conn.getresponse()
        if response.status == 410:
            raise _Expired()
        if response.status != 200:
            kind = {401: "unauthorized", 403: "forbidden", 404: "not_found"}.get(response.status, "http_error")
            raise _Failed(kind, f"HTTP {response.status}")
        return response

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _list(self) -> str:
        slices: dict[str, ParsedSlice] = {}
        token = ""
        while True:
            params = {"limit": str(LIST_PAGE), **({"continue": token} if token else {})}
            body = self._request(self._path(**params)).read(MAX_EVENT_BYTES * 4 + 1)
            self._close()
            if len(body) > MAX_EVENT_BYTES * 4:
                raise _Failed("too_large", "list page over its bound")
            page = json.loads(body)
            for item in page.get("items") or []:
                self._keep(slices, item)
            meta = page.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                break
        self.slices = slices
        self.synced = True
        self.lists += 1
        self.on_change(dict(slices))
        return str(meta.get("resourceVersion") or "")

    def _keep(self, slices: dict[str, ParsedSlice], obj: Any) -> bool:
        name = ((obj or {}).get("metadata") or {}).get("name") if isinstance(obj, dict) else None
        parsed = parse_slice(obj)
        if not isinstance(name, str) or parsed is None:
            return False
        if name not in slices and len(slices) >= MAX_SLICES:
            if "max_slices" not in self._logged:
                self._logged.add("max_slices")
                log.warning("more EndpointSlices than the gateway keeps; the rest are ignored",
                            extra={"limit": MAX_SLICES})
            return False
        slices[name] = parsed
        return True

    def _watch(self, version: str) -> None:
        response = self._request(self._path(watch="1", resourceVersion=version, allowWatchBookmarks="true",
                                            timeoutSeconds=str(WATCH_SECONDS)))
        while not self._stop.is_set():
            line = response.readline(MAX_EVENT_BYTES + 1)
            if not line:
                return  # the server ended the watch (its timeout): watch again from a fresh list
            if len(line) > MAX_EVENT_BYTES:
                raise _Failed("too_large", "watch event over its bound")
            if self._apply(json.loads(line)):
                self.on_change(dict(self.slices))

    def _apply(self, event: Any) -> bool:
        """One watch event; True when the slices changed."""
        kind = event.get("type") if isinstance(event, dict) else None
        obj = event.get("object") if isinstance(event, dict) else None
        if kind == "ERROR":
            if isinstance(obj, dict) and obj.get("code") == 410:
                raise _Expired()
            raise _Failed("watch_error", str((obj or {}).get("reason", ""))[:100] if isinstance(obj, dict) else "")
        if kind in ("ADDED", "MODIFIED"):
            return self._keep(self.slices, obj)
        if kind == "DELETED":
            name = ((obj or {}).get("metadata") or {}).get("name") if isinstance(obj, dict) else None
            return self.slices.pop(name, None) is not None if isinstance(name, str) else False
        return False  # BOOKMARK, or anything newer


Subscriber = Callable[[tuple[PodEndpoint, ...] | None], None]


class EndpointFeed:
    """In the gateway's loop: the Pods of each subscribed Service, delivered when they change.
    Construct in the hub thread; ``post`` may be called from any thread (the watch's)."""

    def __init__(self, port_name: str = "http") -> None:
        import gevent

        self.port_name = port_name
        self._subscribers: dict[str, list[Subscriber]] = {}
        self._latest: dict[str, ParsedSlice] | None = None
        self._delivered: dict[str, tuple[PodEndpoint, ...] | None] = {}
        self._lock = threading.Lock()
        self._async = gevent.get_hub().loop.async_()
        self._async.start(self._deliver)
        self.watch: SliceWatch | None = None

    def post(self, slices: dict[str, ParsedSlice] | None) -> None:
        with self._lock:
            self._latest = slices
        self._async.send()

    def subscribe(self, service: str, subscriber: Subscriber) -> None:
        """``subscriber`` is told the Service's Pods now (None: unknown yet) and on every change."""
        self._subscribers.setdefault(service, []).append(subscriber)
        with self._lock:
            latest = self._latest
        pods = None if latest is None else endpoints_of([s for s in latest.values() if s.service == service],
                                                         self.port_name)
        self._delivered[service] = pods
        subscriber(pods)

    def unsubscribe(self, service: str, subscriber: Subscriber) -> None:
        listeners = self._subscribers.get(service, [])
        if subscriber in listeners:
            listeners.remove(subscriber)
        if not listeners:
            self._subscribers.pop(service, None)

    def _deliver(self) -> None:  # in the hub
        with self._lock:
            latest = self._latest
        by_service: dict[str, list[ParsedSlice]] = {}
        for parsed in (latest or {}).values():
            by_service.setdefault(parsed.service, []).append(parsed)
        for service, listeners in list(self._subscribers.items()):
            pods = None if latest is None else endpoints_of(by_service.get(service, []), self.port_name)
            if service in self._delivered and self._delivered[service] == pods:
                continue
            self._delivered[service] = pods
            for subscriber in list(listeners):
                subscriber(pods)

    def start_watch(self, credentials: InClusterCredentials, label_selector: str = "") -> None:
        self.watch = SliceWatch(credentials, self.post, label_selector=label_selector).start()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self._async.stop()
        self._async.close()


def default_account_dir(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get("NOCTAYA_SERVICE_ACCOUNT_DIR") or SERVICE_ACCOUNT_DIR
