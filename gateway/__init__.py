"""Noctaya's OpenAI-compatible gateway: bounded cold admission, activation lease, streaming proxy.

Kept import-free: ``python -m gateway`` starts a supervisor that forks the worker processes.
"""
