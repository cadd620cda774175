"""The backend's live phase and the last cold start, from Pod timestamps (hooks.controller.coldstart),
alone and through the sync hook with its status fed back the way Metacontroller does."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as hs

from hooks.controller import coldstart as cs
from hooks.controller.coldstart import Phase
from hooks.controller.sync import sync
from tests.hooks import helpers as h

T0 = datetime(2026, 3, 1, 8, 0, 0, tzinfo=UTC)


def at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def waking_pod(name: str = "m-backend-1", *, created: float = 0, scheduled: float | None = None,
               wait: tuple[float, float | None] | None = None, initialized: float | None = None,
               started: float | None = None, ready: float | None = None, unready_at: float | None = None,
               deleting: bool = False) -> dict[str, Any]:
    """A backend Pod as the kubelet reports it after the given moments (seconds after T0)."""
    conds: list[dict[str, Any]] = []
    if scheduled is not None:
        conds.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": at(scheduled)})
        conds.append({"type": "Initialized", "status": "True" if initialized is not None else "False",
                      "lastTransitionTime": at(initialized if initialized is not None else scheduled)})
        if ready is not None:
            conds.append({"type": "Ready", "status": "True", "lastTransitionTime": at(ready)})
        else:
            conds.append({"type": "Ready", "status": "False", "reason": "ContainersNotReady",
                          "lastTransitionTime": at(unready_at if unready_at is not None else scheduled)})
    else:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": at(created)})
    status: dict[str, Any] = {"phase": "Running" if started is not None else "Pending", "conditions": conds}
    if wait is not None:
        begin, end = wait
        state = {"terminated": {"exitCode": 0, "startedAt": at(begin), "finishedAt": at(end)}} if end is not None \
            else {"running": {"startedAt": at(begin)}}
        status["initContainerStatuses"] = [{"name": "wait-for-weights", "ready": end is not None, "restartCount": 0, "state": state}]
    if scheduled is not None:
        engine_state = {"running": {"startedAt": at(started)}} if started is not None else {"waiting": {"reason": "ContainerCreating"}}
        status["containerStatuses"] = [{"name": "engine", "ready": ready is not None, "restartCount": 0,
                                        "started": ready is not None, "state": engine_state}]
    meta: dict[str, Any] = {"name": name, "namespace": h.NAMESPACE, "creationTimestamp": at(created),
                            "labels": {"serving.noctaya.io/llmservice": "qwen", "serving.noctaya.io/component": "backend"}}
    if deleting:
        meta["deletionTimestamp"] = at(created + 1000)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


# A cold start with a prewarm wait: created 0, bound 12, weights wait 13..43, initialized 44,
# engine started 71 (serving image pulled), Ready 154.
STEPS = [
    (Phase.SCHEDULING, 0, {}),
    (Phase.INITIALIZING, 12, {"scheduled": 12, "wait": (13, None)}),
    (Phase.PULLING_IMAGE, 44, {"scheduled": 12, "wait": (13, 43), "initialized": 44}),
    (Phase.LOADING_MODEL, 71, {"scheduled": 12, "wait": (13, 43), "initialized": 44, "started": 71}),
    (Phase.READY, 154, {"scheduled": 12, "wait": (13, 43), "initialized": 44, "started": 71, "ready": 154}),
]
BREAKDOWN = {"scheduling": "12s", "initialization": "2s", "weightsWait": "30s", "imagePull": "27s", "modelLoad": "83s",
             "total": "154s"}


def test_each_step_of_a_start_has_its_phase_and_the_pods_own_time() -> None:
    for phase, since, facts in STEPS:
        got = cs.pod_phase(waking_pod(**facts))
        assert (got.phase, got.since) == (phase, at(since))


def test_the_breakdown_of_a_start_adds_up_to_its_total() -> None:
    record = cs.cold_start(waking_pod(**STEPS[-1][2]))
    assert record == {"pod": "m-backend-1", "startedAt": at(0), "readyAt": at(154), **BREAKDOWN}
    assert cs.cold_start(waking_pod(**STEPS[-2][2])) is None  # not Ready yet: nothing to record


def test_a_pod_that_lost_readiness_is_not_loading_and_a_restarted_engine_is() -> None:
    served = waking_pod(scheduled=1, initialized=2, started=3, unready_at=500)
    assert cs.pod_phase(served).phase == Phase.NOT_READY
    restarted = waking_pod(scheduled=1, initialized=2, started=600, unready_at=500)
    assert (cs.pod_phase(restarted).phase, cs.pod_phase(restarted).since) == (Phase.LOADING_MODEL, at(600))
    crashed = waking_pod(scheduled=1, initialized=2)
    crashed["status"]["containerStatuses"][0].update(
        restartCount=2, state={"waiting": {"reason": "CrashLoopBackOff"}}, lastState={"terminated": {"finishedAt": at(90)}})
    assert (cs.pod_phase(crashed).phase, cs.pod_phase(crashed).since) == (Phase.LOADING_MODEL, at(90))


def test_the_service_shows_the_most_advanced_pod_or_the_first_ready_one() -> None:
    assert cs.service_phase(None, []) is None
    assert cs.service_phase(0, []).phase == Phase.SCALED_TO_ZERO
    assert cs.service_phase(1, []).phase == Phase.SCHEDULING
    a = waking_pod("a", scheduled=5)
    b = waking_pod("b", scheduled=3, initialized=4, started=9)
    assert (cs.service_phase(2, [a, b]).phase, cs.service_phase(2, [a, b]).pod) == (Phase.LOADING_MODEL, "b")
    r1 = waking_pod("r1", scheduled=1, initialized=1, started=2, ready=40)
    r2 = waking_pod("r2", scheduled=1, initialized=1, started=2, ready=30)
    assert cs.service_phase(2, [a, r1, r2]).pod == "r2"
    gone = waking_pod("gone", scheduled=1, initialized=1, started=2, ready=3, deleting=True)
    assert cs.service_phase(0, [gone]).phase == Phase.SCALED_TO_ZERO  # draining Pods serve no new work


def _clock(value: str) -> Any:
    calls: list[str] = []

    def clock() -> str:
        calls.append(value)
        return value
    clock.calls = calls  # type: ignore[attr-defined]
    return clock


def test_a_phase_with_no_pod_time_keeps_the_first_time_it_was_seen() -> None:
    first = cs.timeline(0, [], None, _clock(at(1000)))
    assert first == {"phase": "ScaledToZero", "phaseSince": at(1000)}
    later = _clock(at(2000))
    assert cs.timeline(0, [], first, later) == first and later.calls == []  # the clock is not even read


def walk(steps: list[list[dict[str, Any]]], desired: int = 1, status: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = []
    for pods in steps:
        status = cs.timeline(desired, pods, status, _clock(at(9999)))
        out.append(status)
    return out


def test_waking_to_ready_is_recorded_once_and_scale_out_or_recovery_never_rewrite_it() -> None:
    statuses = walk([[waking_pod(**facts)] for _phase, _since, facts in STEPS])
    assert [(s["phase"], s["phaseSince"]) for s in statuses] == [(str(p), at(t)) for p, t, _ in STEPS]
    assert all("lastColdStart" not in s for s in statuses[:-1])
    record = statuses[-1]["lastColdStart"]
    assert record["total"] == "154s" and record["pod"] == "m-backend-1"
    ready = waking_pod(**STEPS[-1][2])
    second = waking_pod("m-backend-2", created=500, scheduled=501, initialized=502, started=503, ready=510)
    flicker = waking_pod(scheduled=12, initialized=44, started=71, unready_at=900)
    after = walk([[ready, waking_pod("m-backend-2", created=500)], [ready, second], [second], [flicker, second],
                  [flicker], [waking_pod(scheduled=12, initialized=44, started=71, ready=950)]], status=statuses[-1])
    assert [s["phase"] for s in after] == ["Ready", "Ready", "Ready", "Ready", "NotReady", "Ready"]
    assert all(s["lastColdStart"] == record for s in after)  # scale-out, scale-in and a readiness blip: no new start


def test_a_coalesced_sync_that_never_saw_the_middle_still_records_the_whole_start() -> None:
    # Metacontroller may sync only twice: before the Pod exists and once it is Ready.
    statuses = walk([[], [waking_pod(**STEPS[-1][2])]], desired=1)
    assert statuses[0]["phase"] == "Scheduling"
    assert statuses[1]["lastColdStart"] == {"pod": "m-backend-1", "startedAt": at(0), "readyAt": at(154), **BREAKDOWN}


def test_the_next_cold_start_replaces_the_record() -> None:
    first = walk([[], [waking_pod(**STEPS[-1][2])]], desired=1)[-1]
    idle = cs.timeline(0, [], first, _clock(at(5000)))
    assert idle["phase"] == "ScaledToZero" and idle["lastColdStart"] == first["lastColdStart"]
    again = walk([[waking_pod("m-backend-9", created=6000, scheduled=6001, initialized=6002, started=6003, ready=6020)]],
                 status=idle)[-1]
    assert again["lastColdStart"]["pod"] == "m-backend-9" and again["lastColdStart"]["total"] == "20s"


moments = hs.lists(hs.integers(min_value=0, max_value=600), min_size=6, max_size=6).map(sorted)


@settings(max_examples=200, deadline=None)
@given(moments)
def test_any_start_records_durations_that_add_up_and_resync_byte_identical(t: list[int]) -> None:
    created, scheduled, wait_start, wait_end, started, ready = t
    initialized = wait_end
    pod = waking_pod(created=created, scheduled=scheduled, wait=(wait_start, wait_end), initialized=initialized,
                     started=started, ready=ready)
    status = walk([[waking_pod(created=created)], [pod]])[-1]
    record = status["lastColdStart"]
    parts = [int(record[k][:-1]) for k in ("scheduling", "initialization", "weightsWait", "imagePull", "modelLoad")]
    assert sum(parts) == int(record["total"][:-1]) == ready - created
    assert int(record["weightsWait"][:-1]) == wait_end - wait_start
    again = cs.timeline(1, [pod], status, _clock(at(99999)))
    assert json.dumps(again, sort_keys=True) == json.dumps(status, sort_keys=True)


def _request(parent: dict[str, Any], pods: list[dict[str, Any]], replicas: int) -> dict[str, Any]:
    answer = sync(h.sync_request(parent), h.config())
    children = [h.as_observed(c, i, replicas=replicas) if c["kind"] == "Deployment" else h.as_observed(c, i)
                for i, c in enumerate(answer["children"])]
    return h.sync_request(parent, children=children, pods=pods)


def test_the_sync_hook_reports_the_start_and_a_resync_leaves_the_status_byte_identical() -> None:
    parent = h.llmservice()
    seen = []
    for _phase, _since, facts in [(None, None, {}), *STEPS]:
        pods = [waking_pod("qwen-backend-1", **facts)] if facts or seen else []
        answer = sync(_request(parent, pods, replicas=1), h.config(h.LATER_TIME))
        parent = {**parent, "status": answer["status"]}
        seen.append((answer["status"]["phase"], answer["status"]["phaseSince"]))
    assert [p for p, _ in seen] == ["Scheduling", "Scheduling", "Initializing", "PullingImage", "LoadingModel", "Ready"]
    assert parent["status"]["lastColdStart"] == {"pod": "qwen-backend-1", "startedAt": at(0), "readyAt": at(154), **BREAKDOWN}
    resync = sync(_request(parent, [waking_pod("qwen-backend-1", **STEPS[-1][2])], replicas=1), h.config("2027-01-01T00:00:00Z"))
    assert json.dumps(resync["status"], sort_keys=True) == json.dumps(parent["status"], sort_keys=True)


def _crash(pod: dict[str, Any], *, ran: tuple[float, float], restarted: float | None, restarts: int = 1) -> dict[str, Any]:
    """The engine's run `ran` ended (the Pod lost readiness then, if it had it); restarted at `restarted`."""
    engine = pod["status"]["containerStatuses"][0]
    engine.update(restartCount=restarts, ready=False, started=restarted is not None,
                  lastState={"terminated": {"exitCode": 137, "reason": "Error", "startedAt": at(ran[0]), "finishedAt": at(ran[1])}},
                  state={"running": {"startedAt": at(restarted)}} if restarted is not None
                  else {"waiting": {"reason": "CrashLoopBackOff"}})
    for cond in pod["status"]["conditions"]:
        if cond["type"] == "Ready" and cond["status"] == "True":
            cond.update(status="False", lastTransitionTime=at(ran[1]))
    return pod


def test_the_issue_a_late_joiner_that_crashes_and_restarts_keeps_the_record() -> None:
    # #20 item 5: the replica that joined by scale-out is the only one left; its engine crashes.
    statuses = walk([[], [waking_pod(**STEPS[-1][2])]])
    record = statuses[-1]["lastColdStart"]
    joiner = dict(created=500, scheduled=501, initialized=502, started=503, ready=510)
    after = walk([[waking_pod(**STEPS[-1][2]), waking_pod("m-backend-2", **joiner)], [waking_pod("m-backend-2", **joiner)],
                  [_crash(waking_pod("m-backend-2", **joiner), ran=(503, 1400), restarted=None)],
                  [_crash(waking_pod("m-backend-2", **joiner), ran=(503, 1400), restarted=1410)],
                  [waking_pod("m-backend-2", **{**joiner, "ready": 1463})]], status=statuses[-1])
    assert [s["phase"] for s in after] == ["Ready", "Ready", "NotReady", "NotReady", "Ready"]
    assert [s["phaseSince"] for s in after[2:4]] == [at(1400), at(1400)]  # since it stopped serving
    assert all(s["lastColdStart"] == record for s in after)  # not `imagePull 908s, total 963s`


def test_leftovers_that_are_over_neither_serve_nor_wake() -> None:
    evicted = waking_pod(scheduled=1, initialized=2, started=3, unready_at=900)
    evicted["status"].update(phase="Failed", reason="Evicted", message="The node was low on resource: memory.")
    done = waking_pod("m-backend-2", scheduled=1, initialized=2, started=3, ready=40)
    done["status"]["phase"] = "Succeeded"
    shut_down = waking_pod("m-backend-3", scheduled=1, initialized=2)
    shut_down["status"].update(phase="Failed", reason="Terminated")
    for leftovers in ([evicted], [done], [shut_down], [evicted, done, shut_down]):
        assert cs.service_phase(0, leftovers).phase == Phase.SCALED_TO_ZERO  # not PullingImage for days
        assert cs.service_phase(1, leftovers).phase == Phase.SCHEDULING  # the replacement is not created yet
        assert cs.service_phase(1, leftovers, warm=True).phase == Phase.NOT_READY
    idle = cs.timeline(0, [], None, _clock(at(5000)))
    assert cs.timeline(0, [evicted, done], idle, _clock(at(9000))) == idle


def test_a_warm_backend_that_lost_its_replicas_is_not_ready_until_one_is_again_and_that_is_no_cold_start() -> None:
    first = walk([[], [waking_pod(**STEPS[-1][2])]])[-1]
    evicted = waking_pod(**STEPS[-1][2])
    evicted["status"].update(phase="Failed", reason="Evicted")
    replacement = dict(created=3000, scheduled=3010, initialized=3020, started=3030)
    after = walk([[evicted], [evicted, waking_pod("m-backend-2", created=3000)],
                  [evicted, waking_pod("m-backend-2", **replacement)],
                  [evicted, waking_pod("m-backend-2", **replacement, ready=3100)]], status=first)
    assert [s["phase"] for s in after] == ["NotReady"] * 3 + ["Ready"]
    assert {s["phaseSince"] for s in after[:3]} == {at(9999)}  # no Pod says when: first seen, then kept
    assert all(s["lastColdStart"] == first["lastColdStart"] for s in after)
    # At zero it is cold again: the next start is one.
    idle = walk([[evicted]], desired=0, status=after[-1])[-1]
    assert idle["phase"] == "ScaledToZero"
    woke = walk([[evicted, waking_pod("m-backend-3", created=9000, scheduled=9001, initialized=9002, started=9003,
                                      ready=9030)]], status=idle)[-1]
    assert woke["lastColdStart"]["pod"] == "m-backend-3" and woke["lastColdStart"]["total"] == "30s"


def test_an_engine_that_crashed_while_loading_counts_its_pull_until_its_first_run() -> None:
    # Initialized 44, first run 71..120 (OOM-killed while loading), restarted 125, Ready 200.
    pod = _crash(waking_pod(scheduled=12, wait=(13, 43), initialized=44), ran=(71, 120), restarted=125)
    assert cs.pod_phase(pod).phase == Phase.LOADING_MODEL
    for cond in pod["status"]["conditions"]:
        if cond["type"] == "Ready":
            cond.update(status="True", lastTransitionTime=at(200))
    statuses = walk([[waking_pod(**STEPS[0][2])], [pod]])
    assert statuses[-1]["lastColdStart"] == {"pod": "m-backend-1", "startedAt": at(0), "readyAt": at(200), **BREAKDOWN,
                                             "modelLoad": "129s", "total": "200s"}


def test_a_pod_that_served_before_the_hooks_saw_it_ready_is_not_taken_for_a_cold_start() -> None:
    idle = cs.timeline(0, [], None, _clock(at(1)))
    blipped = waking_pod(created=10, scheduled=11, initialized=12, started=13, unready_at=100)
    statuses = walk([[blipped], [waking_pod(created=10, scheduled=11, initialized=12, started=13, ready=130)]], status=idle)
    assert [s["phase"] for s in statuses] == ["NotReady", "Ready"] and all("lastColdStart" not in s for s in statuses)


def _windows_parent() -> dict[str, Any]:
    return h.llmservice(scaling={"min": 0, "max": 2, "schedules": [
        {"start": "0 8 * * *", "end": "0 18 * * *", "leadTime": "auto", "replicas": 1}]})


def test_lead_time_auto_settles_in_one_status_write() -> None:
    """The record and the AutoscalingReady message that quotes the lead it gives land together; the
    decorator then changes the ScaledObject (an attachment) once, and nothing is written after."""
    from hooks.controller import autoscaling as decorator

    parent = _windows_parent()
    worlds = [[], [waking_pod("qwen-backend-1", **STEPS[2][2])], *[[waking_pod("qwen-backend-1", **STEPS[-1][2])]] * 3]
    writes, starts = [], []
    for pods in worlds:
        status = sync(_request(parent, pods, replicas=1), h.config(h.LATER_TIME))["status"]
        writes.append(json.dumps(status, sort_keys=True) != json.dumps(parent.get("status"), sort_keys=True))
        parent = {**parent, "status": status}
        attached = decorator.sync(h.decorator_request(parent), h.config())["attachments"][0]
        starts.append(next(t for t in attached["spec"]["triggers"] if t["type"] == "cron")["metadata"]["start"])
    assert writes == [True, True, True, False, False]
    assert starts == ["0 8 * * *", "0 8 * * *", "57 7 * * *", "57 7 * * *", "57 7 * * *"]
    message = next(c["message"] for c in parent["status"]["conditions"] if c["type"] == "AutoscalingReady")
    assert "opening 3m early" in message


def test_a_leftover_pod_reports_no_backend_failure() -> None:
    # An evicted Pod whose engine was OOM-killed stays until pod GC removes it: it neither serves
    # nor fails the backend (its replacement, if any, is judged on its own).
    from hooks.controller.status import pod_failures

    oom = {"name": "engine", "ready": False, "state": {"terminated": {"reason": "OOMKilled"}}}
    live = {"metadata": {"name": "b-1"}, "status": {"phase": "Running", "containerStatuses": [oom]}}
    evicted = {"metadata": {"name": "b-2"}, "status": {"phase": "Failed", "reason": "Evicted",
                                                       "containerStatuses": [oom]}}
    assert pod_failures(live) and not pod_failures(evicted)
