"""A Pod's process that asks the API server who it is, with the in-cluster credentials LocalPods
mounts (tests/e2e/pods.py): ``python -m tests.e2e.whoami`` prints the username of its token (a
SelfSubjectReview, which every authenticated user may create) or ``no credentials``, then waits to
be stopped, as a server would. The suite runs it as the container of a Deployment it writes itself
(tests/e2e/test_local_pods_credentials.py)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import requests


def main() -> int:
    account_dir = os.environ.get("NOCTAYA_SERVICE_ACCOUNT_DIR")
    if not account_dir:
        print("no credentials", flush=True)
    else:
        base = Path(account_dir)
        url = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
        resp = requests.post(f"{url}/apis/authentication.k8s.io/v1/selfsubjectreviews",
                             json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
                             headers={"Authorization": f"Bearer {(base / 'token').read_text().strip()}"},
                             verify=str(base / "ca.crt"), timeout=10)
        resp.raise_for_status()
        user = resp.json()["status"]["userInfo"]["username"]
        print(f"user {user} namespace {(base / 'namespace').read_text()}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    sys.exit(main())
