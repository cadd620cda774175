"""A small OpenAI-style streaming backend that holds thousands of concurrent streams (gevent), for
the gateway's scale test and streaming benchmark: ``python -m bench.sse_backend PORT [CHUNKS
[INTERVAL_MS]]``.

``GET /health`` answers 200; ``POST /v1/chat/completions`` answers ``text/event-stream`` with CHUNKS
``data:`` events INTERVAL_MS apart, then ``data: [DONE]`` (chunked encoding, keep-alive). It prints
``ready`` once listening. Only what a test needs: not a general HTTP server.
"""

from __future__ import annotations

import socket
import sys

import gevent
import httptools
from gevent.server import StreamServer

CHUNK = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


class _Request:
    def __init__(self) -> None:
        self.url = b""
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        self.done = True


def serve(chunks: int, interval: float):
    def handle(sock: socket.socket, _addr: object) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                request = _Request()
                parser = httptools.HttpRequestParser(request)
                while not request.done:
                    data = sock.recv(65536)
                    if not data:
                        return
                    parser.feed_data(data)
                if request.url.startswith(b"/health"):
                    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
                                 b'{"status":"ok"}')
                    continue
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for _ in range(chunks):
                    if interval:
                        gevent.sleep(interval)
                    sock.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                done = b"data: [DONE]\n\n"
                sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        except (OSError, httptools.HttpParserError):
            return

    return handle


def main() -> int:
    port = int(sys.argv[1])
    chunks = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    interval = float(sys.argv[3]) / 1000 if len(sys.argv) > 3 else 0.0
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(8192)
    listener.setblocking(False)  # gevent accepts on it cooperatively
    server = StreamServer(listener, serve(chunks, interval))
    server.start()
    print("ready", flush=True)
    gevent.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
