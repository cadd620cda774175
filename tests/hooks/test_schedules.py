"""Warm windows (`scaling.schedules`): cron expressions checked as KEDA's parser would, lead times
shifted into an equivalent earlier expression, and the cron triggers the ScaledObject carries."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import pydantic
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as hs

from hooks.api import LLMService, cron
from hooks.controller import autoscaling
from hooks.controller.sync import sync
from tests.hooks import helpers as h
from tests.hooks.golden_cases import MEASURED_COLD_START


def test_the_checks_start_from_a_fixed_year() -> None:
    # Never the clock's: the dates in the messages below are 2026's whenever the hooks run.
    assert cron.this_year() == cron.FIRST_YEAR == 2026


def window(**fields: Any) -> dict[str, Any]:
    return {"start": "0 8 * * MON-FRI", "end": "0 18 * * MON-FRI", **fields}


def service(*windows: dict[str, Any], status: dict | None = None, **scaling: Any) -> dict[str, Any]:
    return h.llmservice(scaling={"min": 0, "max": 3, **scaling, "schedules": list(windows)}, status=status)


def cron_triggers(svc: dict[str, Any]) -> list[dict[str, Any]]:
    (so,) = autoscaling.sync(h.decorator_request(svc), h.config())["attachments"]
    return [t for t in so["spec"]["triggers"] if t["type"] == "cron"]


def _refused(bad: dict[str, Any], message: str) -> tuple[dict[str, Any], int, int]:
    """The model refuses the window with ``message``; then the sync hook answers a service that had
    valid children: its Ready condition, how many children it kept, and how many there were."""
    svc = service(bad)
    with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
        LLMService.model_validate(svc)
    good = sync(h.sync_request(service(window())), h.config())["children"]
    answer = sync(h.sync_request(svc, children=h.observe_all(good)), h.config())
    ready = next(c for c in answer["status"]["conditions"] if c["type"] == "Ready")
    return ready, len(answer["children"]), len(good)


@pytest.mark.parametrize("expr", ["0 8 * * MON-FRI", "*/15 9-17 * * 1-5", "5/10 0-23/2 1,15 jan-DEC sun", "0 0 1 1 ?",
                                  "59 23 31 12 6", "00 08 * * *"])
def test_expressions_keda_accepts_are_accepted(expr: str) -> None:
    assert cron.problem(expr) is None
    assert re.match(cron.CRON_RE, expr)


@pytest.mark.parametrize(("expr", "why"), [
    ("0 8 * *", "needs 5 fields"),
    ("0 8 * * * *", "needs 5 fields"),
    ("60 8 * * *", "minute: 60 is outside 0-59"),
    ("0 24 * * *", "hour: 24 is outside 0-23"),
    ("0 8 0 * *", "day of month: 0 is outside 1-31"),
    ("0 8 * 13 *", "month: 13 is outside 1-12"),
    ("0 8 * * 7", "day of week: 7 is outside 0-6"),
    ("0 8 * * FUNDAY", "day of week: 'FUNDAY' is not a number"),
    ("0 18-8 * * *", "hour: range 18-8 runs backwards"),
    ("*/0 8 * * *", "minute: step must be at least 1"),
    ("0 8 * * @", "day of week: '@' is not"),
])
def test_expressions_keda_refuses_are_refused_with_the_field_named(expr: str, why: str) -> None:
    assert why in (cron.problem(expr) or "")


def test_the_admission_regex_never_refuses_what_the_parser_accepts() -> None:
    # Backwards ranges and zero steps pass the regex (the hooks report them); nothing valid fails it.
    for expr in ["0 18-8 * * *", "*/0 8 * * *"]:
        assert re.match(cron.CRON_RE, expr) and cron.problem(expr)


def fires_at(fields: list[set[int]], minute: int, hour: int, day: int, month: int, weekday: int, *,
             dom_any: bool, dow_any: bool) -> bool:
    """Whether a parsed expression fires at that minute (cron's rule: when both day fields are
    restricted, either may match)."""
    if minute not in fields[0] or hour not in fields[1] or month not in fields[3]:
        return False
    dom_ok, dow_ok = day in fields[2], weekday in fields[4]
    if dom_any or dow_any:
        return dom_ok and dow_ok
    return dom_ok or dow_ok


def _week_minutes(start: datetime) -> list[datetime]:
    return [start + timedelta(minutes=i) for i in range(7 * 24 * 60)]


def _fires(expr: str) -> Any:
    fields = cron.parse(expr)
    parts = expr.split()
    dom_any, dow_any = parts[2] in ("*", "?"), parts[4] in ("*", "?")

    def at(t: datetime) -> bool:
        return fires_at(fields, t.minute, t.hour, t.day, t.month, (t.weekday() + 1) % 7,
                             dom_any=dom_any, dow_any=dow_any)
    return at


starts = hs.tuples(
    hs.integers(0, 59),
    hs.lists(hs.integers(0, 23), min_size=1, max_size=3, unique=True),
    hs.sampled_from(["*", "1-5", "MON,WED,FRI", "0", "6", "SUN-SAT"]),
    hs.sampled_from(["*", "1", "1,15"]),
).map(lambda p: f"{p[0]} {','.join(map(str, sorted(p[1])))} {p[3]} * {p[2]}")


@settings(max_examples=60, deadline=None)
@given(starts, hs.integers(1, 24 * 60 - 1))
def test_a_shifted_start_fires_exactly_lead_minutes_before_every_original_firing(expr: str, lead: int) -> None:
    shifted = cron.shift_earlier(expr, lead)
    assume(shifted is not None)
    assert cron.problem(shifted) is None
    original, earlier = _fires(expr), _fires(shifted)
    # A week that includes a month boundary (Jan 31 → Feb 1), a Sunday → Monday and a Saturday.
    for t in _week_minutes(datetime(2027, 1, 28)):
        assert earlier(t) == original(t + timedelta(minutes=lead)), (expr, lead, shifted, t)


def test_what_cannot_be_shifted_is_refused_not_approximated() -> None:
    assert cron.shift_earlier("*/15 8 * * *", 10) is None  # several minutes
    assert cron.shift_earlier("10 0 1 * *", 30) is None  # crosses midnight with a pinned day of month
    assert cron.shift_earlier("30 0,12 * * *", 31) is None  # one firing crosses midnight, the other not
    assert cron.shift_earlier("0 8 * * MON-FRI", 0) == "0 8 * * MON-FRI"
    assert cron.shift_earlier("0 0 * * MON", 1) == "59 23 * * 0"


def test_rendered_windows_are_cron_triggers_beside_the_demand_trigger() -> None:
    triggers = cron_triggers(service(window(replicas=2, timeZone="Asia/Tokyo")))
    assert triggers == [{"type": "cron", "name": "warm-window-0", "metricType": "AverageValue",
                         "metadata": {"timezone": "Asia/Tokyo", "start": "0 8 * * MON-FRI", "end": "0 18 * * MON-FRI",
                                      "desiredReplicas": "2"}}]


def test_lead_time_auto_follows_the_last_measured_cold_start() -> None:
    assert cron_triggers(service(window(leadTime="auto")))[0]["metadata"]["start"] == "0 8 * * MON-FRI"  # none yet
    measured = {**MEASURED_COLD_START, "total": "83s"}
    assert cron_triggers(service(window(leadTime="auto"), status={"lastColdStart": measured}))[0]["metadata"][
        "start"] == "58 7 * * MON-FRI"
    slow = {**MEASURED_COLD_START, "total": "7200s"}  # capped at an hour
    assert cron_triggers(service(window(leadTime="auto"), status={"lastColdStart": slow}))[0]["metadata"][
        "start"] == "0 7 * * MON-FRI"
    assert cron_triggers(service(window(leadTime="90s")))[0]["metadata"]["start"] == "58 7 * * MON-FRI"


def test_the_autoscaling_condition_says_when_windows_open() -> None:
    status = {"lastColdStart": MEASURED_COLD_START}
    answer = sync(h.sync_request(service(window(leadTime="auto", timeZone="Europe/Berlin"), status=status)), h.config())
    cond = next(c for c in answer["status"]["conditions"] if c["type"] == "AutoscalingReady")
    assert cond["status"] == "True"
    assert "warm windows hold 1 from '0 8 * * MON-FRI' to '0 18 * * MON-FRI' Europe/Berlin, opening 2m early" in cond["message"]


@pytest.mark.parametrize(("bad", "message"), [
    (window(timeZone="Mars/Olympus"), "schedules[].timeZone 'Mars/Olympus' is not an IANA time zone"),
    (window(start="0 18-8 * * *"), "schedules[].start '0 18-8 * * *': hour: range 18-8 runs backwards"),
    (window(start="*/15 8 * * *", leadTime="5m"), "cannot move start '*/15 8 * * *' earlier"),
    (window(start="30 0,12 * * *", leadTime="auto"), "cannot move start '30 0,12 * * *' earlier"),
    (window(start="61 8 * * *"), "schedules[].start must be a 5-field cron expression"),
    (window(end="0 8 * * MON-FRI"), "schedules[].start and end must differ"),
    (window(leadTime="2h"), "schedules[].leadTime must be auto or a duration up to 1h"),
    (window(replicas=4), "scaling.schedules[].replicas must not exceed scaling.max"),
])
def test_bad_windows_are_refused_and_the_hook_keeps_every_child(bad: dict[str, Any], message: str) -> None:
    # What CEL cannot check reaches the hook: Ready=False InvalidSpec with the same words, children kept.
    ready, kept, good = _refused(bad, message)
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec" and message in ready["message"]
    assert kept == good


def test_eight_windows_are_the_limit() -> None:
    eight = [window(start=f"0 {h} * * *", end=f"30 {h} * * *") for h in range(8)]
    LLMService.model_validate(service(*eight))
    assert len(cron_triggers(service(*eight))) == 8
    with pytest.raises(pydantic.ValidationError, match="at most 8 items"):
        LLMService.model_validate(service(*eight, window(start="0 9 * * *", end="30 9 * * *")))


def test_lead_time_and_replicas_at_their_limits_are_accepted() -> None:
    at_limit = service(window(leadTime="1h", replicas=3), max=3)
    LLMService.model_validate(at_limit)
    (trigger,) = cron_triggers(at_limit)
    assert trigger["metadata"]["start"] == "0 7 * * MON-FRI" and trigger["metadata"]["desiredReplicas"] == "3"
    with pytest.raises(pydantic.ValidationError, match="up to 1h"):
        LLMService.model_validate(service(window(leadTime="3601s")))


# KEDA's rule (cron_scaler.go): active while the next end comes before the next start. What it would
# open at other times than written is refused, with the date and the reason (tests/hooks/test_keda_cron.py
# checks a whole year of minutes against a model of KEDA and robfig/cron).
@pytest.mark.parametrize(("bad", "message"), [
    (window(start="*/15 9-17 * * 1-5", end="0 18 * * 1-5"),
     "start '*/15 9-17 * * 1-5' fires 36 times before end '0 18 * * 1-5' (2026-01-01 09:00, 2026-01-01 09:15, "
     "… 2026-01-01 17:45): KEDA's cron scaler is active only while the next end comes before the next start, so it "
     "would open this window at the last of them (2026-01-01 17:45), not at the first"),
    (window(start="*/30 * 1 * *", end="59 23 1 * *"), "fires 48 times before end '59 23 1 * *'"),
    (window(start="0 8 * * MON", end="0 18 * * *"),
     "end '0 18 * * *' fires 4 times before the next start '0 8 * * MON' (2026-01-01 18:00, 2026-01-02 18:00, … "
     "2026-01-04 18:00): KEDA's cron scaler stays active while the next end comes before the next start"),
    (window(start="0 8 * * *", end="0 8 * * MON"), "fires 4 times before end"),
    (window(start="0 8 * * *", end="0 8 1 * *"), "both fire at 2026-01-01 08:00"),
    (window(start="0 8 30 2 *", end="0 18 * * *"), "start '0 8 30 2 *' never fires"),
    (window(start="0 8 * * *", end="30 7 * * *", leadTime="30m"),
     "leadTime 30m would open the window before the previous one has ended (end '30 7 * * *' comes 30m before "
     "start '0 8 * * *'); give a leadTime under 30m"),
    (window(start="30 3 * * *", end="0 18 * * *", timeZone="Europe/Berlin", leadTime="1h"),
     "start '30 3 * * *' moved 60m earlier fires at 2026-03-29 02:30, which does not exist: Europe/Berlin moves its "
     "clocks from 02:00 to 03:00 on 2026-03-29; KEDA (robfig/cron) skips a time that does not exist, so the previous "
     "window would stay open until the next end (a whole extra day or more); a leadTime of at most 30m avoids it"),
    (window(start="30 2 * * *", end="0 18 * * *", timeZone="Europe/Berlin"), "start '30 2 * * *' fires at 2026-03-29 02:30, which does not exist"),
    (window(start="30 1 * * *", end="0 9 * * *", timeZone="America/New_York"),
     "start '30 1 * * *' fires at 2026-11-01 01:30, which occurs twice: America/New_York moves its clocks back from "
     "02:00 to 01:00 on 2026-11-01; KEDA (robfig/cron) fires it twice and opens the window at the second, 60m late"),
    (window(start="0 20 * * *", end="30 2 * * *", timeZone="Australia/Sydney"),
     "end '30 2 * * *' fires at 2026-04-05 02:30, which occurs twice: Australia/Sydney moves its clocks back from "
     "03:00 to 02:00"),
    # Lord Howe Island moves its clocks by 30 minutes: a lead can reach across the whole change.
    (window(start="0 2 * * *", end="0 9 * * *", timeZone="Australia/Lord_Howe", leadTime="31m"),
     "start '0 2 * * *' moved 31m earlier opens at 2026-04-05 01:29, before the clock change and its start after it "
     "(2026-04-05 02:00): Australia/Lord_Howe moves its clocks back from 02:00 to 01:30 on 2026-04-05, so that window "
     "would open 61m early instead; no lead avoids it"),
])
def test_windows_keda_would_open_at_other_times_are_refused_saying_when_and_why(bad: dict[str, Any], message: str) -> None:
    ready, kept, good = _refused(bad, message)
    assert ready["reason"] == "InvalidSpec" and "spec.scaling.schedules.0" in ready["message"]
    assert kept == good


def test_an_auto_lead_is_held_where_the_early_start_would_fall_in_a_clock_change() -> None:
    # America/New_York skips 02:00-03:00 on 2026-03-08: any lead before 03:00 would be skipped that day.
    ny = window(start="0 3 * * *", end="0 9 * * *", timeZone="America/New_York", leadTime="auto")
    status = {"lastColdStart": {**MEASURED_COLD_START, "total": "83s"}}
    assert cron_triggers(service(ny, status=status))[0]["metadata"]["start"] == "0 3 * * *"
    answer = sync(h.sync_request(service(ny, status=status)), h.config())
    cond = next(c for c in answer["status"]["conditions"] if c["type"] == "AutoscalingReady")
    assert ("1 from '0 3 * * *' to '0 9 * * *' America/New_York, opening on time (leadTime auto: the last cold start "
            "asks for 2m, held at 0m because a longer lead would cross a clock change: America/New_York moves its "
            "clocks from 02:00 to 03:00 on 2026-03-08)") in cond["message"]
    # Europe/Berlin skips 02:00-03:00: a 03:30 start may open up to 30 minutes early.
    berlin = window(start="30 3 * * *", end="0 18 * * *", timeZone="Europe/Berlin", leadTime="auto")
    slow = {"lastColdStart": {**MEASURED_COLD_START, "total": "3000s"}}
    assert cron_triggers(service(berlin, status=slow))[0]["metadata"]["start"] == "0 3 * * *"
    # Short of the previous end: 07:30 to 08:00 leaves at most 29 minutes.
    tight = window(start="0 8 * * *", end="30 7 * * *", leadTime="auto")
    assert cron_triggers(service(tight, status=slow))[0]["metadata"]["start"] == "31 7 * * *"
