"""A stand-in for the one corner of the Kubernetes API the gateway reads: list and watch of
EndpointSlices in a namespace, over HTTPS with a bearer token (for the failure modes a real API
server does not produce on demand: an expired watch, a refusal, a cut connection, an oversized
event). The real kube-apiserver is met in tests/kube/test_gateway_endpoints.py."""

from __future__ import annotations

import json
import queue
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.gateway.fakebackend import send_json
from tests.pki import make_ca, make_leaf

TOKEN = "fake-token"


def slice_object(name: str, service: str, pods: list[tuple[str, str, bool]], port: int = 8000,
                 terminating: tuple[str, ...] = ()) -> dict[str, Any]:
    """An EndpointSlice of ``service`` with ``pods`` as (name, address, ready)."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": "ns", "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "targetRef": {"kind": "Pod", "name": pod},
                       "conditions": {"ready": ready, "serving": ready, "terminating": pod in terminating}}
                      for pod, address, ready in pods],
    }


class FakeKube:
    def __init__(self, workdir: Path) -> None:
        make_ca(workdir, "kube-ca")
        cert, key = make_leaf(workdir, "kube-api", "kube-ca")
        self.ca_file = workdir / "kube-ca.crt"
        self.account = workdir / "account"
        self.account.mkdir()
        (self.account / "token").write_text(TOKEN)
        (self.account / "ca.crt").write_bytes(self.ca_file.read_bytes())
        (self.account / "namespace").write_text("ns")
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 1
        self.events: queue.Queue[bytes | None] = queue.Queue()  # the open watch's (a new watch gets a new one)
        self._events_lock = threading.Lock()
        self.status = 200  # what every request is answered (403: a Role missing)
        self.lists = 0
        self.watches = 0
        self.selectors: list[str] = []
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        server.kube = self  # type: ignore[attr-defined]
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def environ(self) -> dict[str, str]:
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.server.server_port)}

    def put(self, obj: dict[str, Any], kind: str = "MODIFIED") -> None:
        """A slice created or changed: stored, and sent to an open watch."""
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        kind = "ADDED" if obj["metadata"]["name"] not in self.slices and kind == "MODIFIED" else kind
        self.slices[obj["metadata"]["name"]] = obj
        self.send({"type": kind, "object": obj})

    def delete(self, name: str) -> None:
        obj = self.slices.pop(name)
        self.send({"type": "DELETED", "object": obj})

    def send(self, event: dict[str, Any] | bytes) -> None:
        with self._events_lock:
            self.events.put(event if isinstance(event, bytes) else json.dumps(event).encode() + b"\n")

    def new_watch(self) -> queue.Queue[bytes | None]:
        """The events of a watch starting now (one the client gave up on ends; what was sent before
        the watch began stays for it, as a watch from a resourceVersion replays it)."""
        with self._events_lock:
            self.watches += 1
            events = self.events
            fresh: queue.Queue[bytes | None] = queue.Queue()
            while not events.empty():
                item = events.get_nowait()
                if item is not None:
                    fresh.put(item)
            events.put(None)
            self.events = fresh
            return fresh

    def end_watch(self) -> None:
        self.events.put(None)

    def stop(self) -> None:
        self.end_watch()
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:
        kube: FakeKube = self.server.kube  # type: ignore[attr-defined]
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        kube.selectors.append(query.get("labelSelector", ""))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}" or kube.status != 200:
            self._json(401 if kube.status == 200 else kube.status, {"kind": "Status", "code": kube.status})
            return
        if parts.path != "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices":
            self._json(404, {"kind": "Status", "code": 404})
            return
        if query.get("watch"):
            self._watch(kube)
            return
        kube.lists += 1
        items = sorted(kube.slices.values(), key=lambda s: s["metadata"]["name"])
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 500)
        page = items[start:start + limit]
        more = str(start + limit) if start + limit < len(items) else ""
        self._json(200, {"kind": "EndpointSliceList", "items": page,
                         "metadata": {"resourceVersion": str(kube.version), "continue": more}})

    def _json(self, code: int, doc: Any) -> None:
        send_json(self, code, doc)

    def _watch(self, kube: FakeKube) -> None:
        events = kube.new_watch()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            event = events.get()
            if event is None:
                break
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            except OSError:
                return
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True
