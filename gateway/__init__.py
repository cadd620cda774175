"""Noctaya's OpenAI-compatible gateway: bounded cold admission, activation lease, streaming proxy.

Kept import-free: ``python -m gateway`` monkey-patches the process before anything else loads.
"""
