"""`make e2e`: the lifecycle suite as two pytest runs side by side.

The upgrade tests (tests/e2e/test_upgrade.py) build clusters of their own and never touch the
session's, and the suite mostly waits on its clusters (under half of 2 cores in use), so they run in a
second pytest beside the rest, followed there by the pool-edge tests on that pytest's own session
cluster: about 12 minutes of the suite's 47 on 2 cores come off the wall clock, no check dropped. Each run has its own private loopback range (NOCTAYA_E2E_LOOPBACK), so each
session's final "nothing left listening" check sees only its own. The side run's output is kept in a
file and printed whole after the main run's, so neither interleaves with the other.

`python -m tests.e2e.run [pytest arguments]` with arguments runs one pytest with them (e.g. `-k pool`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# Run beside the rest, in a pytest of their own: the upgrade tests (clusters of their own), then the
# pool-edge tests (the second pytest's session cluster: ~5 min off the main run's wall clock, which
# had reached the 40-minute budget with issue 41's tests).
BESIDE = ["tests/e2e/test_upgrade.py", "tests/e2e/test_pool_edges.py"]
BESIDE_LOOPBACK = "127.78"
BESIDE_WAIT_SECONDS = 60 * 60  # its tests have 900 s (upgrade) and 300 s timeouts each; more means it hung
NO_TESTS = 5  # pytest's exit code when it collected nothing


def pytest(args: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "pytest", "-s", *args], cwd=REPO_ROOT, env=env, **kwargs)


def verdict(name: str, code: int) -> int:
    if code == NO_TESTS:
        print(f"make e2e: {name} collected no tests; failing", file=sys.stderr)
        return 1
    return code


def main(argv: list[str]) -> int:
    env = {**os.environ, "NOCTAYA_E2E": "1"}
    if argv:
        return verdict("pytest", pytest(argv, env).wait())
    with tempfile.TemporaryDirectory(prefix="noctaya-e2e-") as tmp:
        log_path = Path(tmp) / "beside.log"
        with log_path.open("wb") as log:
            beside = pytest(["--durations=5", *BESIDE], {**env, "NOCTAYA_E2E_LOOPBACK": BESIDE_LOOPBACK},
                            stdout=log, stderr=subprocess.STDOUT)
            try:
                main_code = pytest(["--durations=15", "tests/e2e", *(f"--ignore={p}" for p in BESIDE)], env).wait()
                try:
                    beside_code = beside.wait(BESIDE_WAIT_SECONDS)
                except subprocess.TimeoutExpired:
                    beside.kill()
                    beside.wait()
                    print(f"make e2e: {' '.join(BESIDE)} still running after {BESIDE_WAIT_SECONDS} s; killed",
                          file=sys.stderr)
                    beside_code = 1
            finally:
                if beside.poll() is None:  # interrupted: leave nothing running
                    beside.terminate()
                    beside.wait(60)
        print(f"\n===== {' '.join(BESIDE)} (run beside the rest, loopback {BESIDE_LOOPBACK}.0.0/16) =====", flush=True)
        sys.stdout.write(log_path.read_text(errors="replace"))
        sys.stdout.flush()
    codes = [verdict("tests/e2e", main_code), verdict(" ".join(BESIDE), beside_code)]
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
