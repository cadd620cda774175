"""Noctaya's release version: the one place it is written by hand.

Every other copy (pyproject.toml, the chart's `version` and `appVersion`, the image tag in
metacontroller/hook-server.yaml and in the Dockerfile's build line, the `serving.noctaya.io/version`
annotation on every controller manifest, the generated chart templates) is written from this one by
`tools/release.py` and checked against it by tests/test_release.py. The default image the hooks
render (hooks.config.DEFAULT_IMAGE) is derived from it. Versions are MAJOR.MINOR.PATCH, digits only:
the one form that is at once a SemVer chart version, a PEP 440 version and an image tag.
"""

from __future__ import annotations

__version__ = "0.2.0"

IMAGE_REPOSITORY = "ghcr.io/noctaya/noctaya"
RELEASE_IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
