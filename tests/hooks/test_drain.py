"""The serving container's preStop program (hooks.runtime.drain), run as the kubelet would run it:
the rendered exec command, with sh, against an engine's /metrics on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from hooks.api.runtime import InferenceRuntime
from hooks.runtime import drain

RUNTIME = Path(__file__).resolve().parents[2] / "examples" / "runtimes" / "vllm-nvidia.yaml"


class Engine:
    """An engine's /metrics: vLLM's gauges (labels with a space, a look-alike counter beside them).

    ``failures`` is a script for the next fetches, one entry each: "500" (an HTTP error), "reset"
    (the connection closed without an answer), "hang" (no answer until the fetch times out) or
    "ok" (answered); once it is used up every fetch is answered. ``fetches`` records when each one arrived."""

    def __init__(self) -> None:
        self.running = 0.0
        self.waiting = 0.0
        self.failures: list[str] = []
        self.fetches: list[float] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                engine.fetches.append(time.monotonic())
                failure = engine.failures.pop(0) if engine.failures else None
                if failure == "500":
                    self.send_error(500)
                    return
                if failure == "reset":
                    self.close_connection = True
                    return
                if failure == "hang":
                    time.sleep(3.0)  # beyond the hook's 2 s fetch timeout
                    self.close_connection = True
                    return
                body = (
                    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{model_name="my model",engine="0"}} {engine.running}\n'
                    f'vllm:num_requests_waiting{{model_name="my model",engine="0"}} {engine.waiting}\n'
                    "vllm:num_requests_running_total 42.0\n"
                    'vllm:kv_cache_usage_perc{model_name="my model"} 0.5\n'
                ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.close()


def command(port: int, drain_timeout: str = "10s", unanswered: int | None = None) -> list[str]:
    """The rendered exec command; ``unanswered`` shortens the rendered give-up window (its last
    argument) so that the tests of a dead engine take seconds, not the production ten."""
    doc = yaml.safe_load(RUNTIME.read_text())
    doc["spec"]["port"] = port
    doc["spec"]["lifecycle"] = {"drainTimeout": drain_timeout}
    hook = drain.pre_stop(InferenceRuntime.model_validate(doc))
    assert hook is not None and "exec" in hook
    argv = hook["exec"]["command"]
    assert argv[-1] == str(drain.UNANSWERED_SECONDS)
    return argv if unanswered is None else [*argv[:-1], str(unanswered)]


def run(argv: list[str], path: str | None = None) -> tuple[float, str]:
    env = {"PATH": path if path is not None else os.environ["PATH"]}
    t0 = time.monotonic()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return time.monotonic() - t0, out.stdout + out.stderr


def only(tmp_path: Path, *tools: str) -> str:
    """A PATH with just these programs (what a minimal engine image has)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        found = sys.executable if tool == "python3" else shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_with_nothing_in_flight_the_hook_returns_at_once(engine: Engine) -> None:
    took, out = run(command(engine.port))
    assert took < 2.0 and "nothing in flight" in out


def test_with_a_request_in_flight_the_hook_waits_for_it(engine: Engine) -> None:
    engine.running = 1.0
    threading.Timer(3.0, lambda: setattr(engine, "running", 0.0)).start()
    took, out = run(command(engine.port))
    assert 3.0 <= took < 5.5 and "nothing in flight" in out


def test_requests_waiting_in_the_engine_count_as_in_flight(engine: Engine) -> None:
    engine.waiting = 2.0
    threading.Timer(2.0, lambda: setattr(engine, "waiting", 0.0)).start()
    took, _ = run(command(engine.port))
    assert 2.0 <= took < 4.5


def test_a_request_that_never_ends_is_bounded_by_the_drain_timeout(engine: Engine) -> None:
    engine.running = 1.0
    took, out = run(command(engine.port, drain_timeout="3s"))
    assert 3.0 <= took < 5.5 and "still busy" in out


def test_an_engine_that_stopped_answering_has_nothing_left_to_wait_for(engine: Engine) -> None:
    port = engine.port
    engine.close()
    took, out = run(command(port, unanswered=2))
    # Retried for more than the window (the first failure's second + 2 more), then given up on.
    assert 2.0 < took < 5.0 and "engine not answering for 2s" in out and "nothing in flight" not in out


def test_the_rendered_window_is_ten_seconds_of_silence_within_the_budget() -> None:
    argv = command(8000, drain_timeout="2m")
    assert argv[6:] == ["120", "vllm:num_requests_running vllm:num_requests_waiting", "10"]


def test_one_failed_fetch_is_retried_not_taken_for_a_dead_engine(engine: Engine) -> None:
    """An engine that flaps: errors, a dropped connection and a timed-out fetch, then it answers
    busy, then idle. The hook waits through all of it and stops on the answer showing 0."""
    engine.running = 1.0
    engine.failures = ["500", "reset", "hang"]  # ~4 s without an answer (the hang times out at 2 s)
    threading.Timer(6.0, lambda: setattr(engine, "running", 0.0)).start()
    took, out = run(command(engine.port, drain_timeout="20s", unanswered=5))
    assert 6.0 <= took < 9.0, out
    assert "metrics fetch failed" in out and "answering again" in out and "nothing in flight" in out
    assert "not answering" not in out and len(engine.fetches) >= 5


def test_an_answer_restarts_the_silence_window(engine: Engine) -> None:
    """Failures that never last the window in a row do not end the wait: the budget does."""
    engine.running = 1.0
    engine.failures = ["500", "500", "ok"] * 3  # 4 of the first 5 s unanswered, never 2 s in a row
    took, out = run(command(engine.port, drain_timeout="5s", unanswered=2))
    assert 5.0 <= took < 8.0 and "after 5s; stopping" in out and "not answering for" not in out


def test_a_dead_engine_is_still_bounded_by_the_budget(engine: Engine) -> None:
    port = engine.port
    engine.close()
    took, out = run(command(port, drain_timeout="3s", unanswered=30))
    assert 3.0 <= took < 6.0 and "engine not answering after 3s" in out


def test_a_zero_after_failures_ends_the_wait_at_once(engine: Engine) -> None:
    engine.failures = ["reset", "500"]
    took, out = run(command(engine.port, unanswered=10))
    assert 2.0 <= took < 4.0 and "nothing in flight" in out and len(engine.fetches) == 3


@pytest.mark.parametrize("client", ["curl", "wget", "python3"])
def test_each_http_client_fails_a_fetch_once_and_quickly(engine: Engine, tmp_path: Path, client: str) -> None:
    """An HTTP error and a dropped connection are one failed fetch each, whatever the client (GNU
    wget would retry a dropped connection for minutes on its own); a 500's body is not metrics."""
    if client != "python3" and shutil.which(client) is None:
        pytest.skip(f"{client} not installed here")
    path = only(tmp_path, "sh", "date", "awk", "sleep", client)
    engine.running = 1.0
    engine.failures = ["500", "reset"]
    threading.Timer(3.0, lambda: setattr(engine, "running", 0.0)).start()
    took, out = run(command(engine.port, unanswered=5), path)
    assert 3.0 <= took < 5.5 and "metrics fetch failed" in out and "nothing in flight" in out


@pytest.mark.parametrize("client", ["curl", "wget", "python3"])
def test_each_http_client_an_engine_image_may_have(engine: Engine, tmp_path: Path, client: str) -> None:
    if client != "python3" and shutil.which(client) is None:
        pytest.skip(f"{client} not installed here")
    path = only(tmp_path, "sh", "date", "awk", "sleep", client)
    engine.running = 1.0
    threading.Timer(1.5, lambda: setattr(engine, "running", 0.0)).start()
    took, out = run(command(engine.port), path)
    assert 1.5 <= took < 4.5 and "nothing in flight" in out


def test_an_image_without_any_http_client_sleeps_the_whole_timeout(engine: Engine, tmp_path: Path) -> None:
    took, out = run(command(engine.port, drain_timeout="2s"), only(tmp_path, "sh", "date", "awk", "sleep"))
    assert 2.0 <= took < 4.0 and "no curl, wget or python3" in out


def test_runtimes_without_gauges_or_asking_for_sleep_keep_the_sleep_action() -> None:
    doc = yaml.safe_load(RUNTIME.read_text())
    doc["spec"]["lifecycle"] = {"drainTimeout": "30s", "drainWait": "Sleep"}
    assert drain.pre_stop(InferenceRuntime.model_validate(doc)) == {"sleep": {"seconds": 30}}
    doc["spec"]["lifecycle"] = {"drainTimeout": "30s"}
    del doc["spec"]["metrics"]
    assert drain.pre_stop(InferenceRuntime.model_validate(doc)) == {"sleep": {"seconds": 30}}
    doc["spec"]["lifecycle"] = {"drainTimeout": "0s"}
    assert drain.pre_stop(InferenceRuntime.model_validate(doc)) is None


# Digests of every released drain program (hooks.runtime.drain.PROGRAMS). The program is in every
# backend's Pod template: a released one edited in place would change the template of every model on
# the next release. Add a new version instead, and its digest here once it is released.
RELEASED_PROGRAMS = {2: "57179fbe816951126865d4def7873972a6229845c024901b371f4097485eaee0"}


def test_released_drain_programs_are_never_edited() -> None:
    import hashlib

    for version, want in RELEASED_PROGRAMS.items():
        assert hashlib.sha256(drain.PROGRAMS[version].encode()).hexdigest() == want, (
            f"drain program v{version} was edited: restore it and add version {max(drain.PROGRAMS) + 1} instead")
    assert drain.CURRENT == max(drain.PROGRAMS) and drain.WAIT_FOR_IDLE == drain.PROGRAMS[drain.CURRENT]
