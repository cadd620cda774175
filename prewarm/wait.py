"""The serving Pod's init container: start the engine only once the pinned revision's marker exists.

A prewarmed cache is filled by a Job; a serving Pod that starts earlier (a cold request during the
download, a node that lost its local cache) would otherwise load half-written weights or download
them itself. This waits, saying what for, and exits 0 once the marker names the right source and
revision; after ``timeout`` it exits 1 with that reason, and the kubelet retries it with backoff.

The rendered ``wait-for-weights`` init container no longer runs this: it is the same check as a POSIX
``sh`` loop in the engine's own image (``hooks.resources.prewarm.WAIT_SCRIPT``), so a Noctaya upgrade
leaves serving Pods alone. ``python -m prewarm wait`` stays for running the check by hand (e.g.
``kubectl debug`` with Noctaya's image on a node) and for Pods rendered by earlier versions.
"""

from __future__ import annotations

import logging
import os
import time

from prewarm.layout import ModelDir

log = logging.getLogger("noctaya.prewarm")

JOB_ENV = "NOCTAYA_PREWARM_JOB"


def wait_for_marker(model: ModelDir, timeout: float, interval: float = 2.0, say_every: float = 60.0,
                    clock=time.monotonic, sleep=time.sleep) -> bool:  # noqa: ANN001 - injectable for tests
    """True once the marker is there (at once if it already is), False after ``timeout``."""
    start = clock()
    if model.read_marker() is not None:
        log.info("%s@%s is in the cache; starting the engine", model.source, model.revision)
        return True
    job = os.environ.get(JOB_ENV, "").strip()
    writer = f"the prewarm Job {job}" if job else "the prewarm Job"
    log.info("waiting for %s@%s: %s writes %s once every file is verified (kubectl logs -f job/%s shows its progress)",
             model.source, model.revision, writer, model.marker, job or "<name>")
    last_said = start
    while True:
        sleep(interval)
        now = clock()
        if model.read_marker() is not None:
            log.info("%s@%s is in the cache after %.0f s; starting the engine", model.source, model.revision, now - start)
            return True
        if now - start >= timeout:
            return False
        if now - last_said >= say_every:
            last_said = now
            log.info("still waiting for %s@%s (%.0f s so far)", model.source, model.revision, now - start)
