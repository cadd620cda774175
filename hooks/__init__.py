"""Noctaya's control plane: pure Metacontroller hook functions behind a thin Flask shell."""
