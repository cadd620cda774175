"""Socket-free tests of the gateway's state objects, config, auth and error shapes."""

from __future__ import annotations

import json
import time

import gevent
import pytest

from gateway.auth import KeyFileAuthenticator
from gateway.config import ConfigError, load_config
from gateway.errors import ERRORS, error_body, sse_error_frame
from gateway.state.admission import AdmissionSlots, TicketState
from gateway.state.lease import ActivationLease, LeaseEnd, LeaseState
from gateway.state.readiness import BackendReadiness, ProbeResult, ReadinessProber

# -- admission ---------------------------------------------------------------------------------


def test_admission_counts_queued_and_in_flight_against_one_bound() -> None:
    changes: list[tuple[int, int]] = []
    slots = AdmissionSlots(3)
    slots._on_change = lambda: changes.append((slots.queued, slots.in_flight))
    a = slots.try_admit(in_flight=False)
    b = slots.try_admit(in_flight=True)
    c = slots.try_admit(in_flight=False)
    assert a and b and c
    assert slots.try_admit(in_flight=False) is None and slots.try_admit(in_flight=True) is None
    assert (slots.queued, slots.in_flight) == (2, 1)
    a.start()
    assert (slots.queued, slots.in_flight) == (1, 2)
    a.requeue()
    assert a.state is TicketState.QUEUED and (slots.queued, slots.in_flight) == (2, 1)
    a.release()
    a.release()  # idempotent
    assert slots.total == 2 and slots.try_admit(in_flight=False) is not None
    assert changes[0] == (1, 0) and changes[-1] == (2, 1)
    with pytest.raises(RuntimeError):
        a.start()


def test_admission_flood_never_exceeds_bound() -> None:
    slots = AdmissionSlots(100)
    tickets = [slots.try_admit(in_flight=i % 2 == 0) for i in range(1000)]
    admitted = [t for t in tickets if t is not None]
    assert len(admitted) == 100 and slots.total == 100
    for t in admitted:
        t.release()
    assert slots.total == 0 and slots.pod.try_take_slot()


# -- lease ---------------------------------------------------------------------------------------


def test_lease_starts_on_cold_admission_and_ends_after_ready_grace() -> None:
    lease = ActivationLease(activation_timeout=300, ready_grace=15)
    assert not lease.active
    assert lease.cold_admission(100.0) == 400.0
    assert lease.state is LeaseState.ACTIVATING and lease.generation == 1
    assert lease.tick(399.0) is None
    assert lease.backend_ready(160.0) == pytest.approx(60.0)
    assert lease.state is LeaseState.READY_GRACE and lease.next_timer() == 175.0
    assert lease.tick(174.9) is None and lease.active
    assert lease.tick(175.0) is LeaseEnd.COMPLETED and not lease.active


def test_lease_times_out_then_a_later_request_starts_a_new_one() -> None:
    lease = ActivationLease(activation_timeout=10, ready_grace=1)
    lease.cold_admission(0.0)
    assert lease.cold_admission(5.0) == 15.0  # extends to the newest waiter's deadline
    assert lease.tick(10.0) is None
    assert lease.tick(15.0) is LeaseEnd.TIMED_OUT and not lease.active
    assert lease.backend_ready(16.0) is None  # nothing to end: no lease
    lease.cold_admission(20.0)
    assert lease.active and lease.generation == 2 and lease.deadline == 30.0


def test_lease_cold_admission_during_ready_grace_activates_again() -> None:
    lease = ActivationLease(activation_timeout=10, ready_grace=5)
    lease.cold_admission(0.0)
    lease.backend_ready(2.0)
    assert lease.next_timer() == 7.0  # readiness lost alone does not extend the lease
    assert lease.cold_admission(4.0) == 14.0
    assert lease.state is LeaseState.ACTIVATING and lease.deadline == 14.0 and lease.generation == 1
    assert lease.backend_ready(5.0) == pytest.approx(1.0)  # measured from the re-activation
    with pytest.raises(ValueError):
        ActivationLease(0, 1)


# -- readiness -----------------------------------------------------------------------------------


def test_readiness_hysteresis_while_warm_and_refused_is_immediate() -> None:
    r = BackendReadiness(warm_failure_threshold=3)
    assert r.record(ProbeResult.NOT_READY, 0) is False and not r.ready
    assert r.record(ProbeResult.READY, 1) is True and r.ready
    assert r.record(ProbeResult.NOT_READY, 2) is False and r.ready
    assert r.record(ProbeResult.NOT_READY, 3) is False and r.ready
    assert r.record(ProbeResult.NOT_READY, 4) is True and not r.ready
    r.record(ProbeResult.READY, 5)
    assert r.record(ProbeResult.REFUSED, 6) is True and not r.ready and r.changed_at == 6


def test_prober_probes_only_while_wanted() -> None:
    wanted = {"v": False}
    results = iter([ProbeResult.REFUSED, ProbeResult.NOT_READY, ProbeResult.READY])
    state = BackendReadiness()
    seen: list[ProbeResult] = []

    def report(result: ProbeResult) -> None:
        seen.append(result)
        state.record(result, 0)

    prober = ReadinessProber(lambda: next(results), report, lambda: wanted["v"], lambda: state.ready,
                             interval_cold=0.1, interval_warm=1.0)
    assert prober.step() is None and prober.probes_sent == 0  # idle: no traffic at all
    wanted["v"] = True
    assert prober.step() == 0.1 and prober.step() == 0.1
    assert prober.step() == 1.0  # ready: slower warm cadence
    assert seen == [ProbeResult.REFUSED, ProbeResult.NOT_READY, ProbeResult.READY]
    prober.stop()
    assert prober.step() is None
    with pytest.raises(ValueError):
        ReadinessProber(lambda: ProbeResult.READY, report, lambda: True, lambda: True,
                        interval_cold=0.5, interval_warm=1.0)


# -- config --------------------------------------------------------------------------------------

BASE = {"NOCTAYA_BACKEND_URL": "http://b.models.svc:8000", "NOCTAYA_SERVED_MODEL_NAME": "qwen"}


def test_config_defaults_match_the_contract() -> None:
    c = load_config([], BASE)
    assert (c.listen_port, c.readiness_path, c.max_queue, c.cold_mode) == (8080, "/health", 100, "keepalive")
    assert (c.activation_timeout_seconds, c.ready_grace_seconds, c.heartbeat_seconds) == (300, 15, 10)
    assert (c.queue_full_retry_after_seconds, c.retry_after_seconds, c.drain_grace_seconds) == (5, 10, 30)
    assert c.max_body_bytes == 8 * 1024 * 1024 and c.auth_key_file is None
    assert (c.scaler_mode, c.scaler_port, c.scaling_target, c.metric_name) == ("local", 9090, 10, "noctaya-demand")
    assert c.backend_host == "b.models.svc" and c.backend_port == 8000 and c.probe_interval_seconds <= 0.2


def test_flags_override_env() -> None:
    c = load_config(["--max-queue", "7", "--cold-mode", "reject"], {**BASE, "NOCTAYA_MAX_QUEUE": "3"})
    assert c.max_queue == 7 and c.cold_mode == "reject"


@pytest.mark.parametrize("env, fragment", [
    ({"NOCTAYA_BACKEND_URL": "http://x"}, "NOCTAYA_SERVED_MODEL_NAME"),
    ({**BASE, "NOCTAYA_MAX_QUEUE": "0"}, "NOCTAYA_MAX_QUEUE"),
    ({**BASE, "NOCTAYA_COLD_MODE": "wait"}, "NOCTAYA_COLD_MODE"),
    ({**BASE, "NOCTAYA_BACKEND_URL": "ftp://x"}, "NOCTAYA_BACKEND_URL"),
    ({**BASE, "NOCTAYA_ACTIVATION_TIMEOUT_SECONDS": "-1"}, "ACTIVATION_TIMEOUT"),
    ({**BASE, "NOCTAYA_PROBE_INTERVAL_SECONDS": "1"}, "PROBE_INTERVAL"),
    ({**BASE, "NOCTAYA_SCALER_MODE": "report"}, "AGGREGATOR_URL"),
    ({**BASE, "NOCTAYA_SCALER_TLS_CERT_FILE": "/c"}, "TLS"),
    ({**BASE, "NOCTAYA_SCALER_MODE": "report", "NOCTAYA_AGGREGATOR_URL": "http://a:9091/v1/report",
      "NOCTAYA_AGGREGATOR_TOKEN_FILE": "/t", "NOCTAYA_AGGREGATOR_CA_FILE": "/ca"}, "AGGREGATOR_CA_FILE"),
])
def test_invalid_config_names_the_variable(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config([], env)


# -- auth ----------------------------------------------------------------------------------------


def test_key_file_is_reread_and_compared_exactly(tmp_path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    auth = KeyFileAuthenticator(str(key))
    assert auth.check("Bearer s3cret") and auth.check("bearer s3cret")
    assert not auth.check("Bearer s3cre") and not auth.check("Basic s3cret") and not auth.check(None)
    key.write_text("rotated")
    assert not auth.check("Bearer s3cret") and auth.check("Bearer rotated")
    key.unlink()
    assert not auth.check("Bearer rotated")  # fails closed
    key.write_text("")
    assert not auth.check("Bearer ")


def test_any_of_several_key_files_opens_and_a_broken_one_opens_nothing(tmp_path, caplog) -> None:
    files = [tmp_path / f"key{i}" for i in range(16)]
    for i, path in enumerate(files):
        path.write_text(f"team-{i}\n")
    auth = KeyFileAuthenticator([str(p) for p in files])
    assert all(auth.check(f"Bearer team-{i}") for i in range(16))
    assert not auth.check("Bearer team-16") and not auth.check("Bearer ") and not auth.check("team-0")
    files[3].unlink()
    files[4].write_text("")
    files[5].write_text("x" * 5000)  # over the 4096-byte bound
    assert not any(auth.check(f"Bearer team-{i}") for i in (3, 4, 5))  # each fails closed on its own
    assert auth.check("Bearer team-6")  # the others still open
    assert "team-" not in caplog.text  # paths only, never a key
    files[3].write_text("rotated")
    assert auth.check("Bearer rotated") and not auth.check("Bearer team-3")
    with pytest.raises(ValueError):
        KeyFileAuthenticator([str(p) for p in files] + [str(tmp_path / "17th")])
    with pytest.raises(ValueError):
        KeyFileAuthenticator([])


# -- error shapes --------------------------------------------------------------------------------


def test_error_bodies_are_openai_shaped() -> None:
    for name, err in ERRORS.items():
        doc = json.loads(error_body(err))["error"]
        assert set(doc) == {"message", "type", "param", "code"}, name
    frame = sse_error_frame(ERRORS["activation_timeout"])
    assert frame.startswith(b"event: error\ndata: ") and frame.endswith(b"\n\n")
    assert json.loads(frame.split(b"data: ", 1)[1])["error"]["type"] == "activation_timeout"


def test_prober_hurry_shortens_a_warm_wait_only_when_backend_went_cold() -> None:
    ready = {"v": True}
    probes: list[float] = []

    def probe() -> ProbeResult:
        probes.append(time.monotonic())
        return ProbeResult.READY if ready["v"] else ProbeResult.REFUSED

    prober = ReadinessProber(probe, lambda r: None, lambda: True, lambda: ready["v"],
                             interval_cold=0.05, interval_warm=30.0)
    g = gevent.spawn(prober.run)
    try:
        deadline = time.monotonic() + 10
        while not probes and time.monotonic() < deadline:
            gevent.sleep(0.01)
        prober.kick()  # warm traffic: the running prober is not even woken
        prober.hurry()  # still ready: the 30 s warm wait is not cut short
        gevent.sleep(0.2)
        assert len(probes) == 1
        ready["v"] = False  # the forwarder found the backend gone
        prober.hurry()
        while len(probes) < 3 and time.monotonic() < deadline:
            gevent.sleep(0.01)
        assert len(probes) >= 3  # back on the cold cadence, not after 30 s
    finally:
        prober.stop()
        g.kill()


def test_held_body_bytes_are_bounded_and_returned() -> None:
    slots = AdmissionSlots(10, max_held_bytes=1000)
    a, b, c = (slots.reservation() for _ in range(3))
    assert a.take(600) and not b.take(500) and b.bytes == 0
    assert b.take(400) and slots.held_bytes == 1000  # at the budget exactly
    assert not c.take(1) and not c.cover(1)
    a.release()
    assert slots.held_bytes == 400 and c.cover(600) and c.cover(300) and c.bytes == 600
    for r in (a, b, c):
        r.release()
        r.release()  # idempotent
    assert slots.held_bytes == 0 and slots.pod.held_bytes == 0
    assert slots.total == 0  # a reservation is no slot
