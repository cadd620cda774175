"""The far side of ``bench.replicas``, each a process of its own pinned by the caller:

- ``python -m bench.replica_servers pods PORT SLOTS CHUNKS CHUNK_MS``: backend Pods of fixed
  capacity, one listener per Pod address on the same port (as every Pod of a Deployment listens on
  the same container port). A Pod serves at most SLOTS requests at once; the rest wait inside it in
  arrival order, as requests wait for a place in an engine's batch. A request, once it has a slot,
  answers ``text/event-stream``: CHUNKS ``data:`` events CHUNK_MS apart (the first after CHUNK_MS,
  so the service time is CHUNKS x CHUNK_MS), then ``data: [DONE]``. Every event names the Pod, so
  the client counts shares without asking the servers. ``GET /health`` answers 200 at once.
  Commands on stdin, one a line: ``start ADDRESS NAME`` (listen; prints ``started ADDRESS T`` with T
  the monotonic instant it listens, the clock every process on the machine shares), ``stop ADDRESS``
  (the listener and every connection closed, as a deleted Pod takes them; prints ``stopped``).
- ``python -m bench.replica_servers proxy PORT BACKEND_PORT``: a Service as kube-proxy makes one,
  in user space: each new connection goes to a backend drawn uniformly at random from the current
  set and stays on it for its whole life (iptables' ``statistic --mode random`` rule is matched once,
  by the connection's first packet; conntrack keeps the rest on it). With no backend the listener is
  closed, so a connection is refused, as kube-proxy's REJECT rule for a Service without endpoints
  answers. One thread per connection: a slow backend never holds up another connection's bytes.
  Command on stdin: ``backends A,B,...`` (may be empty; prints ``ok T``). Connections already
  open keep their backend.

Debian's nginx would be the other choice for the proxy, but its ``stream`` module is a separate
package (``libnginx-mod-stream``) and changing its backend set needs a reload of a master process.
"""

from __future__ import annotations

import random
import select
import socket
import struct
import sys
import threading
import time

import gevent
import gevent.fileobject
import gevent.lock
import httptools
from gevent.server import StreamServer

TERMINATOR = b"0\r\n\r\n"
HEALTH = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the peer sees the connection cut, not a clean end."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


# -- the Pods ------------------------------------------------------------------------------------------

class _Request:
    def __init__(self) -> None:
        self.url = b""
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        self.done = True


class Pod:
    """One Pod's engine (see the module doc), on the gevent loop of the pods process."""

    def __init__(self, address: str, port: int, name: str, slots: int, chunks: int, interval: float) -> None:
        self.name = name
        self.interval = interval
        self.batch = gevent.lock.BoundedSemaphore(slots)  # FIFO: waiters are woken in order
        self.connections: set[socket.socket] = set()
        self.events = [_chunk(b'data: {"pod":"%s","choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n'
                              % (name.encode(), i)) for i in range(chunks)]
        self.done = _chunk(b"data: [DONE]\n\n") + TERMINATOR
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(4096)
        listener.setblocking(False)  # gevent accepts on it cooperatively
        self.server = StreamServer(listener, self.handle)
        self.server.start()

    def handle(self, sock: socket.socket, _addr: object) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections.add(sock)
        try:
            while self.serve_one(sock):
                pass
        except (OSError, httptools.HttpParserError):
            pass
        finally:
            self.connections.discard(sock)

    def serve_one(self, sock: socket.socket) -> bool:
        request = _Request()
        parser = httptools.HttpRequestParser(request)
        while not request.done:
            data = sock.recv(65536)
            if not data:
                return False
            parser.feed_data(data)
        if request.url.startswith(b"/health"):
            sock.sendall(HEALTH)
            return True
        with self.batch:  # waiting here is the queue inside the engine
            for i, event in enumerate(self.events):
                gevent.sleep(self.interval)
                sock.sendall(STREAM_HEAD + event if i == 0 else event)
            sock.sendall(self.done)
        return True

    def stop(self) -> None:
        self.server.close()
        for sock in list(self.connections):  # a deleted Pod takes its connections with it
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def run_pods(port: int, slots: int, chunks: int, chunk_ms: float) -> None:
    pods: dict[str, Pod] = {}
    # Read in a thread of gevent's pool: the loop keeps serving while the next command is awaited.
    stdin = gevent.fileobject.FileObjectThread(sys.stdin.buffer, "rb")
    print("ready", flush=True)
    for line in stdin:
        words = line.decode().split()
        if words[:1] == ["start"]:
            pods[words[1]] = Pod(words[1], port, words[2], slots, chunks, chunk_ms / 1000)
            print(f"started {words[1]} {time.monotonic():.6f}", flush=True)
        elif words[:1] == ["stop"]:
            pod = pods.pop(words[1], None)
            if pod is not None:
                pod.stop()
            print(f"stopped {words[1]}", flush=True)


# -- the Service ---------------------------------------------------------------------------------------

class ServiceProxy:
    """See the module doc. ``set_backends`` may be called from any thread."""

    def __init__(self, port: int, backend_port: int) -> None:
        self.port = port
        self.backend_port = backend_port
        self.backends: list[str] = []
        self.listener: socket.socket | None = None
        self.lock = threading.Lock()

    def set_backends(self, backends: list[str]) -> None:
        with self.lock:
            self.backends = list(backends)
            if backends and self.listener is None:
                listener = socket.socket()
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", self.port))
                listener.listen(4096)
                self.listener = listener
                threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
            elif not backends and self.listener is not None:
                listener, self.listener = self.listener, None
                try:  # wakes the thread blocked in accept()
                    listener.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed: no endpoints
            with self.lock:
                backend = random.choice(self.backends) if self.backends else None
            if backend is None:
                _reset(client)
                continue
            threading.Thread(target=self._relay, args=(client, backend), daemon=True).start()

    def _relay(self, client: socket.socket, backend: str) -> None:
        try:
            upstream = socket.create_connection((backend, self.backend_port), timeout=5)
        except OSError:
            _reset(client)  # the Pod is gone: the connection is cut, as kube-proxy's DNAT to a dead Pod
            return
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peers = {client.fileno(): (client, upstream), upstream.fileno(): (upstream, client)}
        poller = select.poll()
        for fd in peers:
            poller.register(fd, select.POLLIN)
        try:
            while True:
                for fd, _event in poller.poll():
                    source, sink = peers[fd]
                    data = source.recv(65536)
                    if not data:
                        return
                    sink.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()


def run_proxy(port: int, backend_port: int) -> None:
    proxy = ServiceProxy(port, backend_port)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["backends"]:
            proxy.set_backends(words[1].split(",") if len(words) > 1 else [])
            print(f"ok {time.monotonic():.6f}", flush=True)


def main() -> int:
    role, args = sys.argv[1], sys.argv[2:]
    if role == "pods":
        run_pods(int(args[0]), int(args[1]), int(args[2]), float(args[3]))
    elif role == "proxy":
        run_proxy(int(args[0]), int(args[1]))
    else:
        print(f"unknown role {role!r}: pods or proxy", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
