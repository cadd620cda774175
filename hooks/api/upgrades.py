"""`spec.upgrades`: how Noctaya's own changes reach a model's running Pods.

A Pod template the hooks render has two authors: the user (the LLMService and its InferenceRuntime)
and Noctaya (the drain program, init containers, env, labels, the gateway's image). A change by the
user rolls at once, as Kubernetes always does. A change by Noctaya alone (a new release, a changed
install setting) never reloads a warm model: it waits until the model is next at zero, or until one
of these windows opens, or until the user approves it (see hooks/controller/rollout.py).

Windows use the warm-window syntax (`scaling.schedules`): a start and an end cron expression in an
IANA time zone. A window is open from a start firing until the next end firing, the rule KEDA's cron
scaler uses for warm windows. Whether one is open now is the one decision of the hooks that reads the
clock; it is read only while an upgrade is actually waiting.
"""

from __future__ import annotations

import datetime as _dt
import re
import zoneinfo
from functools import lru_cache
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from hooks.api import cron
from hooks.api.common import ApiModel, Rule
from hooks.errors import explain_pattern

TIME_ZONE_RE = explain_pattern(r"^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+){0,2}$",
                               "an IANA time zone name such as Europe/Berlin or UTC")
MAX_WINDOWS = 8
# How far back a window's last start or end is looked for: every day of the week, month and leap
# day recurs within eight years.
_LOOKBACK_DAYS = 8 * 366


@lru_cache(maxsize=1)
def time_zones() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


def _cel_string(regex: str) -> str:
    return "'" + regex.replace("\\", "\\\\").replace("'", "\\'") + "'"


def cron_window_rules(field: str, start_example: str, end_example: str) -> tuple[Rule, ...]:
    """The admission rules of a start/end cron window (warm windows, upgrade windows): both 5-field
    cron expressions, and different. `field` names the list in messages, e.g. "schedules"."""
    help_text = ("5-field cron expression (minute 0-59, hour 0-23, day of month 1-31, month 1-12 or JAN-DEC, day "
                 "of week 0-6 or SUN-SAT)")
    return (
        Rule(
            cel=f"self.start.matches({_cel_string(cron.CRON_RE)})",
            message=f"{field}[].start must be a {help_text}, e.g. \"{start_example}\"",
            check=lambda w: re.match(cron.CRON_RE, w.start) is not None,
        ),
        Rule(
            cel=f"self.end.matches({_cel_string(cron.CRON_RE)})",
            message=f"{field}[].end must be a {help_text}, e.g. \"{end_example}\"",
            check=lambda w: re.match(cron.CRON_RE, w.end) is not None,
        ),
        Rule(
            cel="self.start != self.end",
            message=f"{field}[].start and end must differ",
            check=lambda w: w.start != w.end,
        ),
    )


def check_window_expressions(field: str, start: str, end: str, time_zone: str) -> None:
    """What CEL cannot say about a cron window (warm or upgrade): backwards ranges and the time zone
    database. Raises ValueError naming `field` (e.g. "schedules")."""
    for name, expr in (("start", start), ("end", end)):
        bad = cron.problem(expr)
        if bad is not None:
            raise ValueError(f"{field}[].{name} {expr!r}: {bad}")
    if time_zone not in time_zones():
        raise ValueError(f"{field}[].timeZone {time_zone!r} is not an IANA time zone "
                         "(e.g. Europe/Berlin, America/New_York, UTC)")


class UpgradeWindow(ApiModel):
    """A recurring time in which a warm model may take Noctaya's pending changes (its Pods restart)."""

    start: str = Field(description="When the window opens: a 5-field cron expression (minute hour day-of-month "
                       "month day-of-week), e.g. \"0 3 * * SUN\".", max_length=100)
    end: str = Field(description="When it closes, the same way, e.g. \"0 5 * * SUN\".", max_length=100)
    time_zone: str = Field(default="UTC", description="IANA time zone both expressions are read in, "
                           "e.g. Europe/Berlin.", max_length=64, pattern=TIME_ZONE_RE)

    rules: ClassVar[tuple[Rule, ...]] = cron_window_rules("upgrades.windows", "0 3 * * SUN", "0 5 * * SUN")

    @model_validator(mode="after")
    def _check_beyond_cel(self) -> UpgradeWindow:
        """What CEL cannot say: backwards ranges, the time zone database, starts and ends that do not
        take turns (the window would open at other times than written)."""
        check_window_expressions("upgrades.windows", self.start, self.end, self.time_zone)
        turns = cron.pairing(self.start, self.end, cron.this_year())
        if turns.problem is not None:
            raise ValueError(f"upgrades.windows[]: {turns.problem}")
        return self

    def is_open(self, now: _dt.datetime) -> bool:
        """Whether `now` (timezone-aware) lies between a start firing and the end firing after it,
        read on the wall clock of `time_zone`."""
        local = now.astimezone(zoneinfo.ZoneInfo(self.time_zone)).replace(tzinfo=None)
        last_start = _last_firing(cron.Schedule.of(self.start), local)
        if last_start is None:
            return False
        last_end = _last_firing(cron.Schedule.of(self.end), local)
        return last_end is None or last_start > last_end


def _last_firing(schedule: cron.Schedule, local: _dt.datetime) -> _dt.datetime | None:
    """The latest firing of `schedule` at or before the wall-clock time `local` (minute resolution)."""
    minute_now = local.hour * 60 + local.minute
    for back in range(_LOOKBACK_DAYS):
        day = local.date() - _dt.timedelta(days=back)
        if not schedule.on(day):
            continue
        minutes = [m for m in schedule.minutes if back > 0 or m <= minute_now]
        if minutes:
            last = max(minutes)
            return _dt.datetime(day.year, day.month, day.day, last // 60, last % 60)
    return None


UpgradePolicy = Literal["WhenIdle", "Immediate"]


class Upgrades(ApiModel):
    """How Noctaya's own changes reach this model's running Pods. Changes to this LLMService or its
    InferenceRuntime always roll at once; these settings are about Noctaya's part only."""

    policy: UpgradePolicy = Field(
        default="WhenIdle",
        description="WhenIdle: a Pod template that changes only because Noctaya changed (a new release, an "
        "install setting) is applied when the model is next at zero replicas, inside one of `windows`, or when "
        "the LLMService is annotated serving.noctaya.io/approve-upgrade=<status.pendingUpgrade.digest>; until "
        "then the running Pods keep their template and condition UpgradePending says so. Immediate: applied at "
        "once, restarting warm Pods (they reload the model).",
    )
    windows: list[UpgradeWindow] = Field(
        default_factory=list, max_length=MAX_WINDOWS,
        description="Recurring times in which a warm model may take pending Noctaya changes (its Pods restart "
        "and reload the model): what a model that never reaches zero (scaling.min >= 1) needs to ever take them "
        "without an approval.",
    )

    def window_open(self, now: _dt.datetime) -> bool:
        return any(window.is_open(now) for window in self.windows)
