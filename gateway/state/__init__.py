"""Explicit, socket-free state of one gateway: admission slots, in-flight count, activation lease,
backend readiness. Every object takes an injectable clock so tests drive time by hand."""
