"""Controller layer: the Metacontroller hook entry points (request dict in, response dict out)."""
