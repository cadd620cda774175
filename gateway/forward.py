"""Moving the backend's answer to the client: framing, piece by piece, as it arrives.

No policy lives here (what to answer is gateway.policy / gateway.routes) and no timing (the caller
passes ``on_first_byte``, called once when the first byte of the backend's body has been written to
the client). Two shapes:

- :meth:`ClientRelay.relay`: the backend's own status and headers, its body re-framed for the
  client's connection (chunked for HTTP/1.1 when the length is unknown, close-delimited for 1.0);
- :meth:`ClientRelay.into_committed_stream`: a cold streamed request already answered
  ``200 text/event-stream`` (heartbeats): the backend's SSE body continues that stream, and a
  backend refusal becomes one SSE ``event: error`` frame.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

from gateway.errors import ERRORS, backend_failure, sse_error_frame
from gateway.metrics import GatewayMetrics
from gateway.relay import UpstreamConnection, UpstreamFailed, read_more
from gateway.server import ClientConnection, ClientGone
from gateway.wire import LAST_CHUNK, ResponseHead, chunk, response_head

__all__ = ["ClientRelay"]

log = logging.getLogger("noctaya.gateway")

BACKEND_ERROR_BYTES = 64 * 1024  # a refusal's JSON read to pass its message on (bounded)
FirstByte = Callable[[ClientConnection, int], None]  # called with the client and the backend's status


def _chunks(pieces: list[bytes]) -> bytes:
    return b"".join([chunk(p) for p in pieces if p])


class ClientRelay:
    def __init__(self, metrics: GatewayMetrics, clock: Callable[[], float]) -> None:
        self.metrics = metrics
        self.clock = clock

    def _done_with(self, upstream: UpstreamConnection, response: ResponseHead) -> None:
        """Back to its pool a connection whose answer was read to its end; close any other."""
        if upstream.parser.complete and response.keep_alive and upstream.home is not None:
            upstream.home.release(upstream)
        else:
            upstream.close()

    # -- the backend's own answer ----------------------------------------------------------------
    def relay(self, conn: ClientConnection, method: bytes, upstream: UpstreamConnection,
              response: ResponseHead, on_first_byte: FirstByte) -> bool:
        """Write the backend's answer to the client as it arrives; returns whether the client
        connection may continue."""
        status = response.status
        self.metrics.count_response(status)
        no_body = method == b"HEAD" or status in (204, 304)
        length = response.content_length
        chunked = length is None and not no_body and conn.version == "1.1"
        close = (length is None and not chunked and not no_body) or not conn.message_done or conn.gone
        headers = response.end_to_end_headers()
        if length is not None:
            headers.append((b"Content-Length", b"%d" % length))
        elif chunked:
            headers.append((b"Transfer-Encoding", b"chunked"))
        if response.request_id is None:
            headers.append((b"X-Request-Id", conn.request_id))
        headers.extend(conn.connection_headers(close))
        out = response_head(status, headers, response.reason or None)
        if no_body:
            upstream.close()  # llhttp cannot be told a HEAD answer has no body: never reuse it
            conn.send(out)
            return not close
        try:
            self._pump(conn, upstream, response, out, chunked, on_first_byte)
        except UpstreamFailed as exc:
            upstream.close()  # mid-body: never pooled (a read failure has closed it already; EOF has not)
            return self._failed_mid_body(conn, response, exc, chunked, close)
        except ClientGone:
            upstream.close()
            return False
        self._done_with(upstream, response)
        return not close

    def _pump(self, conn: ClientConnection, upstream: UpstreamConnection, response: ResponseHead, out: bytes,
              chunked: bool, on_first_byte: FirstByte) -> None:
        """Body pieces out as they come in (the head goes with the first of them)."""
        parser = upstream.parser
        first = True
        while True:
            pieces = parser.take_body()
            if pieces:
                out += _chunks(pieces) if chunked else b"".join(pieces)
            if parser.complete and chunked:
                out += LAST_CHUNK
            if out:
                conn.send(out)
                out = b""
                if first and pieces:
                    first = False
                    on_first_byte(conn, response.status)
            if parser.complete:
                return
            if not read_more(upstream, self.clock):
                if response.content_length is None and not response.chunked:
                    if chunked:  # close-delimited body: EOF is its end, which the client must see
                        conn.send(LAST_CHUNK)
                    return
                raise UpstreamFailed("backend closed mid-body")

    def _failed_mid_body(self, conn: ClientConnection, response: ResponseHead, exc: UpstreamFailed,
                         chunked: bool, close: bool) -> bool:
        if conn.gone:
            return False
        log.warning("backend failed mid-response", extra={"detail": str(exc)})
        if response.is_sse and chunked:
            conn.send(chunk(sse_error_frame(ERRORS[backend_failure(exc.reason)])) + LAST_CHUNK)
            return not close
        conn.gone = True  # committed non-SSE body: an abrupt close is the only honest signal
        return False

    # -- inside a stream already committed --------------------------------------------------------
    def into_committed_stream(self, conn: ClientConnection, upstream: UpstreamConnection,
                              response: ResponseHead, on_first_byte: FirstByte) -> Iterator[bytes]:
        """The backend's answer inside an SSE stream already committed with 200."""
        try:
            if response.status == 200:
                yield from self._stream_body(conn, upstream, response, on_first_byte)
            else:
                yield self._refusal_frame(upstream)
                upstream.close()
        finally:
            conn.upstream = None

    def _stream_body(self, conn: ClientConnection, upstream: UpstreamConnection, response: ResponseHead,
                     on_first_byte: FirstByte) -> Iterator[bytes]:
        parser = upstream.parser
        first = True
        try:
            while True:
                pieces = parser.take_body()
                if pieces and first:
                    first = False
                    on_first_byte(conn, response.status)  # just before the caller writes them
                yield from pieces
                if parser.complete:
                    break
                if not read_more(upstream, self.clock):
                    if response.content_length is None and not response.chunked:
                        break  # close-delimited body: EOF is its end
                    upstream.close()
                    raise UpstreamFailed("backend closed mid-body")
        except UpstreamFailed as exc:
            yield sse_error_frame(ERRORS[backend_failure(exc.reason)])
            return
        except BaseException:  # the client left (the generator is closed) or a bug: never pool it
            upstream.close()
            raise
        self._done_with(upstream, response)

    def _refusal_frame(self, upstream: UpstreamConnection) -> bytes:
        """The backend refused the request (e.g. 400 for a bad parameter) after 200 went out: pass
        its error on as an SSE error event (bounded read; its JSON is small and ours to parse)."""
        parser = upstream.parser
        raw = b""
        error = None
        try:
            while len(raw) < BACKEND_ERROR_BYTES:
                raw += b"".join(parser.take_body())
                if parser.complete or not read_more(upstream, self.clock):
                    break
            doc = json.loads(raw[:BACKEND_ERROR_BYTES])
            error = doc.get("error") if isinstance(doc, dict) else None
        except (UpstreamFailed, ValueError, UnicodeDecodeError, RecursionError):
            pass
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return b"event: error\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"
        return sse_error_frame(ERRORS["backend_failure"])
