"""Files from mounted Secrets, in one place for the gateway, the scaler and the hook server: reading
a token or key (reread on every use, so a rotated Secret needs no restart) and saying which Secret is
missing, for the hooks to read back from the Pod's status.

The hooks never read Secrets (Metacontroller would send their data on every sync). The gateway and
aggregator mount theirs as *optional* volumes, so the Pod starts even when a Secret does not exist;
the program then checks that the files it was told to read are there and, if one is not, exits with
a termination message naming the Secret, in the words the kubelet uses for an env reference
(`Secret "name" not found`). The kubelet copies that message into the container's status, where the
hooks find it (``hooks.controller.status.pod_secrets_missing``) and report ``SecretNotFound``.

Only names cross: the rendered env names the Secret (``NOCTAYA_AUTH_SECRET``,
``NOCTAYA_SCALER_TLS_SECRET``), never its data.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

MAX_SECRET_FILE_BYTES = 4096  # a token or key, not a document: bounds every per-request read
TERMINATION_LOG_ENV = "NOCTAYA_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
EXIT_SECRET_MISSING = 3

# (env naming the Secret, env naming the files it must provide)
SECRET_FILES = (
    ("NOCTAYA_AUTH_SECRET", ("NOCTAYA_AUTH_KEY_FILE",)),
    ("NOCTAYA_CREDENTIALS_SECRET", ("NOCTAYA_REGISTRY_CONFIG_FILE",)),  # oci:// staging's registry login
    # The aggregate scaler and a single gateway serve with the certificate; gateways that report to
    # an aggregator verify it with the CA alone.
    ("NOCTAYA_SCALER_TLS_SECRET", ("NOCTAYA_SCALER_TLS_CERT_FILE", "NOCTAYA_SCALER_TLS_KEY_FILE",
                                   "NOCTAYA_SCALER_TLS_CA_FILE", "NOCTAYA_AGGREGATOR_CA_FILE")),
)


def read_secret_file(path: str | os.PathLike[str]) -> bytes | None:
    """The value (surrounding whitespace stripped), or None when the file is missing, unreadable,
    empty or larger than MAX_SECRET_FILE_BYTES. Never logs the value."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError:
        return None
    value = data.strip()
    if not value or len(data) > MAX_SECRET_FILE_BYTES:
        return None
    return value


def file_stamp(*paths: str | os.PathLike[str]) -> tuple[tuple[int, int, int], ...]:
    """Cheap change detector for mounted files: (inode, size, mtime_ns) of each. A Secret volume
    update swaps the kubelet's ``..data`` symlink, which changes the inode even when size and mtime
    happen to match. Raises OSError when a file is missing."""
    stats = [os.stat(p) for p in paths]
    return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in stats)


def missing_secret_message(environ: Mapping[str, str]) -> str | None:
    """The termination message for the first named Secret whose files are not all there, or None."""
    for secret_env, file_envs in SECRET_FILES:
        secret = environ.get(secret_env, "").strip()
        if not secret:
            continue
        absent = [environ[f] for f in file_envs if environ.get(f) and not os.path.isfile(environ[f])]
        if absent:
            return f'Secret "{secret}" not found, or it lacks a key: {", ".join(absent)} missing'
    return None


def exit_if_a_secret_is_missing(program: str, environ: Mapping[str, str] | None = None) -> None:
    """Exit (status 3) with a termination message when a named Secret's files are absent."""
    environ = os.environ if environ is None else environ
    message = missing_secret_message(environ)
    if message is None:
        return
    print(f"{program}: {message}", file=sys.stderr, flush=True)
    write_termination_message(message, environ)
    raise SystemExit(EXIT_SECRET_MISSING)


def write_termination_message(message: str, environ: Mapping[str, str] | None = None) -> None:
    """Leave ``message`` where the kubelet copies it into the container's status (and
    ``kubectl describe pod`` shows it). Never a secret's value: names and reasons only."""
    environ = os.environ if environ is None else environ
    try:
        with open(environ.get(TERMINATION_LOG_ENV, DEFAULT_TERMINATION_LOG), "w") as log:
            log.write(message)
    except OSError:
        pass  # not in a Pod: stderr says it
