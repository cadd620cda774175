"""Errors the hook layer raises; the Flask shell maps them to HTTP status codes."""


class InvalidHookRequest(ValueError):
    """The request body is not a Metacontroller hook request we can read (→ HTTP 400).

    A *well-formed* request whose LLMService spec is invalid is not this error: it is answered
    with the observed children kept and an InvalidSpec condition.
    """
