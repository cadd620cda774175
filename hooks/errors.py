"""Errors the hook layer raises; the Flask shell maps them to HTTP status codes."""

from typing import Any


class InvalidHookRequest(ValueError):
    """The request body is not a Metacontroller hook request we can read (→ HTTP 400).

    A *well-formed* request whose LLMService spec is invalid is not this error: it is answered
    with the observed children kept and an InvalidSpec condition.
    """


def describe_validation_error(exc: Any, prefix: str = "", limit: int = 3) -> str:
    """A pydantic ValidationError as one short, stable, user-facing line.

    Each problem is `path: message` with the path in wire (camelCase) form, e.g.
    `spec.scaling: scaling.min must not exceed scaling.max`. Input values are never echoed, so a
    Secret-looking value in a bad field cannot leak into a condition message.
    """
    parts: list[str] = []
    errors = exc.errors(include_url=False, include_input=False)
    for err in errors[:limit]:
        loc = ".".join(str(p) for p in (prefix, *err.get("loc", ())) if p != "")
        msg = str(err.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more")
    return "; ".join(parts)
