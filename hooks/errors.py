"""Errors the hook layer raises; the Flask shell maps them to HTTP status codes."""

from typing import Any


class InvalidHookRequest(ValueError):
    """The request body is not a Metacontroller hook request we can read (→ HTTP 400).

    A *well-formed* request whose LLMService spec is invalid is not this error: it is answered
    with the observed children kept and an InvalidSpec condition.
    """


# What a field's pattern asks for, in words: a user (and a condition message) should never be shown a
# regular expression. Filled by the API modules next to each pattern (`explain_pattern`).
PATTERN_HELP: dict[str, str] = {}


def explain_pattern(pattern: str, help_text: str) -> str:
    """Register how to describe `pattern` to a user; returns the pattern (use it in the Field)."""
    PATTERN_HELP[pattern] = help_text
    return pattern


def _message(err: dict[str, Any]) -> str:
    if err.get("type") == "string_pattern_mismatch":
        pattern = str((err.get("ctx") or {}).get("pattern", ""))
        return f"must be {PATTERN_HELP[pattern]}" if pattern in PATTERN_HELP else \
            "does not have the form this field takes (kubectl explain describes it)"
    msg = str(err.get("msg", "invalid"))
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def describe_validation_error(exc: Any, prefix: str = "", limit: int = 3) -> str:
    """A pydantic ValidationError as one short, stable, user-facing line.

    Each problem is `path: message` with the path in wire (camelCase) form, e.g.
    `spec.scaling: scaling.min must not exceed scaling.max`. Input values are never echoed, so a
    Secret-looking value in a bad field cannot leak into a condition message, and patterns are said in
    words (PATTERN_HELP), never as the regular expression.
    """
    parts: list[str] = []
    errors = exc.errors(include_url=False, include_input=False)
    for err in errors[:limit]:
        loc = ".".join(str(p) for p in (prefix, *err.get("loc", ())) if p != "")
        msg = _message(err)
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more")
    return "; ".join(parts)
