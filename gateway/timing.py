"""Per-request timing: time to first token, as the client saw it.

Kept apart from the relay (which only reports "a first byte of the backend's answer left") and from
the request policy (which decides what is answered), so what counts is decided in one place:

- only requests that produce tokens are timed: completions, chat completions and responses
  (``POST``); a model listing or a gateway-generated error has no first token;
- only a successful answer (status < 400) counts;
- each request is timed from its own arrival (the first byte of its head, as the connection parsed
  it), so a pipelined or keep-alive request never inherits an older start.
"""

from __future__ import annotations

__all__ = ["RequestTiming", "produces_tokens", "TOKEN_PATHS"]

TOKEN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_TOKEN_PATHS = TOKEN_PATHS | {p + "/" for p in TOKEN_PATHS}


def produces_tokens(method: bytes, path: str) -> bool:
    """Whether an answer to this request starts with a first token."""
    return method == b"POST" and path in _TOKEN_PATHS


class RequestTiming:
    """One request's arrival and whether it waited for the backend (cold); :meth:`first_byte`
    returns the time to first token once, or None when this request is not timed."""

    __slots__ = ("arrived", "timed", "cold")

    def __init__(self, arrived: float = 0.0, timed: bool = False) -> None:
        self.start(arrived, timed)

    def start(self, arrived: float, timed: bool) -> None:
        """A new request on the connection (one object per connection: no allocation per request)."""
        self.arrived = arrived
        self.timed = timed
        self.cold = False

    def first_byte(self, now: float, status: int) -> float | None:
        if not self.timed or status >= 400:
            return None
        self.timed = False  # once per request
        return now - self.arrived
