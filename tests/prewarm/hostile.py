"""A HOSTILE stand-in hub on 127.0.0.1: the stand-in hub (``demo.hub.FakeHub``, the same protocols
and listings) except that chosen files are served with more bytes than listed, endlessly, or as a
trickle. The listing still declares each file's true size, as a hub that lies in its bodies would."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

from demo.hub import FakeHub

PIECE = 64 * 1024
ENDLESS = -1
SAFETY_CAP = 300 << 20  # an endless body still ends here (272 MB was the report), so a broken client cannot fill the disk


@dataclass(frozen=True)
class Hostile:
    extra: int = 0  # bytes sent after the listed content; ENDLESS: until the client hangs up
    announce: int | None = None  # Content-Length to announce; None: a close-delimited body (no length)
    rate: float | None = None  # bytes per second: a trickle
    piece: int = PIECE  # bytes per write


@dataclass
class HostileHub(FakeHub):
    hostile: dict[str, Hostile] = field(default_factory=dict)  # path -> how it is served
    sent: dict[str, int] = field(default_factory=dict)  # path -> bytes the last GET got onto the socket

    def _send_file(self, h: BaseHTTPRequestHandler, data: bytes, filename: str, commit: str, etag: str,
                   head: bool) -> None:
        how = self.hostile.get(filename)
        if how is None or head:
            return super()._send_file(h, data, filename, commit, etag, head)
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{etag}"')
        if how.announce is not None:
            h.send_header("Content-Length", str(how.announce))
        else:
            h.send_header("Connection", "close")  # the body ends when the connection does
        h.end_headers()
        h.close_connection = True
        self.sent[filename] = 0
        try:
            self._body(h, data, filename, how)
        except OSError:
            pass  # the client hung up: what a bounded client does
        return None

    def _body(self, h: BaseHTTPRequestHandler, data: bytes, filename: str, how: Hostile) -> None:
        total = len(data) + how.extra if how.extra != ENDLESS else SAFETY_CAP
        done = 0
        while done < total:
            n = min(how.piece, total - done)
            piece = data[done:done + n]
            piece += b"\0" * (n - len(piece))  # past the listed content: filler
            h.wfile.write(piece)
            h.wfile.flush()
            done += len(piece)
            self.sent[filename] = done
            if how.rate:
                time.sleep(len(piece) / how.rate)


class MaxSize:
    """The largest size a file reached on disk while a download ran, polled every millisecond."""

    def __init__(self, *paths: object) -> None:
        self.paths = paths
        self.max = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MaxSize:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        import os

        while not self._stop.wait(0.001):
            for path in self.paths:
                try:
                    self.max = max(self.max, os.stat(path).st_size)  # type: ignore[arg-type]
                except OSError:
                    pass
