"""Five-field cron expressions as KEDA's cron scaler reads them, checked and shifted here.

KEDA parses `start` and `end` with robfig/cron's standard fields (minute, hour, day of month,
month, day of week; no seconds, no @descriptors). What it accepts per field: `*` or `?`, a value, a
range `a-b`, either with a step `/n` (a value with a step runs to the field's maximum), several of
those joined by commas; months and days of the week also by name (JAN-DEC, SUN-SAT). The same
grammar is checked here so a bad expression is refused at admission, not found later in KEDA's log.

`shift_earlier` moves a start earlier by a lead time (a warm window opening before people arrive).
It handles what can be written as one cron expression again: a single minute with one or more
hours; crossing midnight moves the days of the week too, and is refused when a day of month or a
month is pinned (the day before the 1st is not one cron field).

`pairing` and `clock_change_clash` (below) refuse windows KEDA would open at other times than
written: KEDA's rule, robfig/cron's daylight-saving behaviour, and why, are described there.
"""

from __future__ import annotations

import datetime as _dt
import re
import zoneinfo
from dataclasses import dataclass
from functools import lru_cache

MONTHS = {name: i + 1 for i, name in enumerate(("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"))}
DAYS = {name: i for i, name in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"))}


@dataclass(frozen=True)
class Field:
    name: str
    low: int
    high: int
    names: dict[str, int]


FIELDS = (
    Field("minute", 0, 59, {}),
    Field("hour", 0, 23, {}),
    Field("day of month", 1, 31, {}),
    Field("month", 1, 12, MONTHS),
    Field("day of week", 0, 6, DAYS),
)


def _field_re(field: Field) -> str:
    values = "|".join(str(v) for v in range(field.low, field.high + 1))
    value = f"0?(?:{values})" + (f"|(?i:{'|'.join(field.names)})" if field.names else "")
    item = rf"(?:\*|\?|(?:{value})(?:-(?:{value}))?)(?:/[0-9]+)?"
    return rf"{item}(?:,{item})*"


# What CEL checks at admission (RE2 and Python's re read it alike): five fields, each made of items
# whose values lie in the field's bounds. Ranges that run backwards and zero steps are left to
# `parse` (the hooks then report the spec invalid).
CRON_RE = r"^\s*" + r"\s+".join(_field_re(f) for f in FIELDS) + r"\s*$"


_ITEM = re.compile(r"^(?:(\*|\?)|([0-9A-Za-z]+)(?:-([0-9A-Za-z]+))?)(?:/([0-9]+))?$")


class CronError(ValueError):
    """A cron expression KEDA would refuse; the message says which field and why."""


def _value(text: str, field: Field) -> int:
    upper = text.upper()
    if upper in field.names:
        return field.names[upper]
    if not text.isdigit():
        raise CronError(f"{field.name}: {text!r} is not a number" + (f" or a name ({'/'.join(field.names)})" if field.names else ""))
    value = int(text)
    if not field.low <= value <= field.high:
        raise CronError(f"{field.name}: {value} is outside {field.low}-{field.high}")
    return value


def expand(text: str, field: Field) -> set[int]:
    """The values one field matches."""
    out: set[int] = set()
    for item in text.split(","):
        m = _ITEM.match(item)
        if m is None:
            raise CronError(f"{field.name}: {item!r} is not *, a value, a range a-b or one of those with /step")
        star, first, last, step = m.groups()
        if star:
            low, high = field.low, field.high
        else:
            low = _value(first, field)
            high = _value(last, field) if last else (field.high if step else low)
            if low > high:
                raise CronError(f"{field.name}: range {low}-{high} runs backwards")
        stride = int(step) if step else 1
        if stride < 1:
            raise CronError(f"{field.name}: step must be at least 1")
        out.update(range(low, high + 1, stride))
    return out


def parse(expr: str) -> list[set[int]]:
    """The five fields' value sets; raises CronError like KEDA's parser would refuse."""
    parts = expr.split()
    if len(parts) != 5:
        raise CronError(f"needs 5 fields (minute hour day-of-month month day-of-week), found {len(parts)}")
    return [expand(text, field) for text, field in zip(parts, FIELDS, strict=True)]


def problem(expr: str) -> str | None:
    try:
        parse(expr)
    except CronError as exc:
        return str(exc)
    return None


def _is_any(text: str) -> bool:
    return text in ("*", "?")


def shift_earlier(expr: str, minutes: int) -> str | None:
    """`expr` with every firing `minutes` earlier, or None when that is not one cron expression."""
    if minutes == 0:
        return expr
    parts = expr.split()
    try:
        fields = parse(expr)
    except CronError:
        return None
    minute_set, hour_set = fields[0], fields[1]
    if len(minute_set) != 1 or minutes < 0 or minutes >= 24 * 60:
        return None
    (minute,) = minute_set
    moved = sorted(h * 60 + minute - minutes for h in hour_set)
    crossing = [t < 0 for t in moved]
    if any(crossing) and not all(crossing):
        return None  # some firings move to the day before, some do not: two expressions
    new_minute = moved[0] % (24 * 60) % 60
    new_hours = ",".join(str(t % (24 * 60) // 60) for t in moved)
    dom, month, dow = parts[2], parts[3], parts[4]
    if all(crossing):
        if not (_is_any(dom) and _is_any(month)):
            return None
        if not _is_any(dow):
            dow = ",".join(str(d) for d in sorted((d - 1) % 7 for d in fields[4]))
    return f"{new_minute} {new_hours} {dom} {month} {dow}"



# ---------------------------------------------------------------------------------------------
# When a window is warm under KEDA's rule
#
# KEDA's cron scaler (pkg/scalers/cron_scaler.go, GetMetricsAndActivity) asks robfig/cron for the
# next start and the next end after now, in the window's time zone, and reports the trigger active
# unless the next start comes before the next end: active <=> next end <= next start. So a window is
# "open from start to end" only when starts and ends take turns. A start that fires again before an
# end moves the opening to its last firing; an end that fires again before a start keeps the window
# open until its last firing; a start and an end at the same minute keep it open for good. robfig's
# Next (spec.go) skips a wall time that does not exist (spring forward) and fires twice at a wall time
# that occurs twice (fall back). The checks below refuse what would not open exactly from
# start − lead to end, and say on which date and why.
# ---------------------------------------------------------------------------------------------

CYCLE_YEARS = 29  # the Gregorian calendar repeats every 28 years between 1901 and 2099: all weekday/date combinations
DAY = 24 * 60


def stars(expr: str) -> tuple[bool, bool]:
    """Whether day of month and day of week carry robfig's star bit (`*` or `?` with no step above
    1, parser.go getRange). With both restricted, a day matches either field (spec.go dayMatches)."""
    def star(text: str) -> bool:
        return any(item.split("/")[0] in ("*", "?") and (len(item.split("/")) == 1 or int(item.split("/")[1]) <= 1)
                   for item in text.split(","))
    parts = expr.split()
    return star(parts[2]), star(parts[4])


@dataclass(frozen=True)
class Schedule:
    """A parsed expression: the minutes of the day it fires at, and the days it fires on."""

    expr: str
    minutes: tuple[int, ...]  # minute of the day, sorted
    dom: frozenset[int]
    months: frozenset[int]
    dow: frozenset[int]
    dom_star: bool
    dow_star: bool

    @classmethod
    def of(cls, expr: str) -> Schedule:
        minute, hour, dom, month, dow = parse(expr)
        dom_star, dow_star = stars(expr)
        return cls(expr, tuple(sorted(h * 60 + m for h in hour for m in minute)), frozenset(dom), frozenset(month),
                   frozenset(dow), dom_star, dow_star)

    def on(self, day: _dt.date) -> bool:
        if day.month not in self.months:
            return False
        dom_ok, dow_ok = day.day in self.dom, (day.weekday() + 1) % 7 in self.dow
        if self.dom_star or self.dow_star:
            return dom_ok and dow_ok
        return dom_ok or dow_ok


def _hhmm(minute: int) -> str:
    return f"{minute % DAY // 60:02d}:{minute % 60:02d}"


def _when(day: _dt.date, minute: int) -> str:
    return f"{day + _dt.timedelta(days=minute // DAY)} {_hhmm(minute)}"


@dataclass(frozen=True)
class Pairing:
    """How a start and an end take turns on the wall clock (no time zone)."""

    problem: str | None
    gap: int  # the fewest minutes from an end to the next start: a lead must stay below it


def _days(first_year: int) -> list[_dt.date]:
    first = _dt.date(first_year, 1, 1)
    return [first + _dt.timedelta(days=i) for i in range((_dt.date(first_year + CYCLE_YEARS, 1, 1) - first).days)]


@lru_cache(maxsize=256)
def pairing(start: str, end: str, first_year: int) -> Pairing:
    """Walk every start and end firing over CYCLE_YEARS years: they must alternate (start, end,
    start, ...) and never coincide, else KEDA's rule opens the window at other times than written."""
    s, e = Schedule.of(start), Schedule.of(end)
    days = _days(first_year)
    for kind, schedule in (("start", s), ("end", e)):
        if not any(schedule.on(day) for day in days):
            return Pairing(f"{kind} {schedule.expr!r} never fires (no month has that day)", 0)
    last: tuple[str, _dt.date, int] | None = None  # kind, day, minute of the last firing
    gap = 2 * DAY * 366 * CYCLE_YEARS
    patterns: dict[tuple[bool, bool], list[tuple[int, str]]] = {}
    for day in days:
        key = (s.on(day), e.on(day))
        if key not in patterns:
            patterns[key] = sorted([(m, "start") for m in s.minutes] * key[0] + [(m, "end") for m in e.minutes] * key[1])
        events = patterns[key]
        for i, (minute, kind) in enumerate(events):
            if i + 1 < len(events) and events[i + 1][0] == minute and events[i + 1][1] != kind:
                return Pairing(f"start {start!r} and end {end!r} both fire at {_when(day, minute)}: KEDA's cron "
                               "scaler is active while the next end is not after the next start, so that window "
                               "would never close", 0)
            if last is not None and last[0] == kind:
                return Pairing(_run_problem(s, e, kind, last[1], last[2], day, minute), 0)
            if last is not None and kind == "start":
                gap = min(gap, (day - last[1]).days * DAY + minute - last[2])
            last = (kind, day, minute)
    return Pairing(None, gap)


def _run_problem(s: Schedule, e: Schedule, kind: str, day0: _dt.date, minute0: int, day1: _dt.date, minute1: int) -> str:
    """Explain two firings of one kind in a row: count the run until the other kind comes."""
    other = e if kind == "start" else s
    mine = s if kind == "start" else e
    count, last = 2, (day1, minute1)
    day = day1
    for _ in range(400):  # the run's end (a window whose run is longer is described by its start)
        later = [m for m in other.minutes if other.on(day) and (day > day1 or m > minute1)]
        ours = [m for m in mine.minutes if mine.on(day) and (day > day1 or m > minute1)]
        stop = min(later) if later else None
        more = [m for m in ours if stop is None or m < stop]
        count += len(more)
        if more:
            last = (day, more[-1])
        if stop is not None:
            break
        day += _dt.timedelta(days=1)
    first_at, second_at, last_at = _when(day0, minute0), _when(day1, minute1), _when(*last)
    if kind == "start":
        return (f"start {s.expr!r} fires {count} times before end {e.expr!r} ({first_at}, {second_at}, … "
                f"{last_at}): KEDA's cron scaler is active only while the next end comes before the next start, so "
                f"it would open this window at the last of them ({last_at}), not at the first; give start one "
                "firing per window")
    return (f"end {e.expr!r} fires {count} times before the next start {s.expr!r} ({first_at}, {second_at}, … "
            f"{last_at}): KEDA's cron scaler stays active while the next end comes before the next start, so "
            f"the window would stay open until the last of them ({last_at}); give end one firing per window")


@dataclass(frozen=True)
class Change:
    """One clock change of a time zone, on the wall clock: [low, high) is the stretch of wall times
    that does not exist (spring forward, `gap`) or occurs twice (fall back)."""

    day: _dt.date
    low: int  # wall minute, counted from `day`'s midnight
    high: int
    gap: bool

    def describe(self, tz: str) -> str:
        if self.gap:
            return f"{tz} moves its clocks from {_hhmm(self.low)} to {_hhmm(self.high)} on {self.day}"
        return f"{tz} moves its clocks back from {_hhmm(self.high)} to {_hhmm(self.low)} on {self.day}"


@lru_cache(maxsize=64)
def changes(tz: str, first_year: int) -> tuple[Change, ...]:
    """Every change of the UTC offset of `tz` over CYCLE_YEARS years from `first_year`."""
    zone = zoneinfo.ZoneInfo(tz)
    utc = _dt.UTC
    lo = int(_dt.datetime(first_year, 1, 1, tzinfo=utc).timestamp()) - 2 * 86400
    hi = int(_dt.datetime(first_year + CYCLE_YEARS, 1, 1, tzinfo=utc).timestamp()) + 2 * 86400

    def offset(ts: int) -> int:
        return int(_dt.datetime.fromtimestamp(ts, zone).utcoffset().total_seconds())  # type: ignore[union-attr]

    out = []
    step = 86400  # no zone changes its offset twice within a day
    prev = offset(lo)
    for ts in range(lo + step, hi, step):
        now = offset(ts)
        if now == prev:
            continue
        a, b = ts - step, ts  # offset(a) == prev, offset(b) == now: find the first second of `now`
        while b - a > 1:
            mid = (a + b) // 2
            a, b = (mid, b) if offset(mid) == prev else (a, mid)
        before, after = (b + prev) // 60, (b + now) // 60  # the wall minute the change happens at, both ways
        low, high = min(before, after), max(before, after)
        day = _dt.date(1970, 1, 1) + _dt.timedelta(days=low // DAY)
        epoch_day = (day - _dt.date(1970, 1, 1)).days * DAY
        if first_year <= day.year < first_year + CYCLE_YEARS:
            out.append(Change(day, low - epoch_day, high - epoch_day, now > prev))
        prev = now
    return tuple(out)


def _firings_near(schedule: Schedule, change: Change, before: int, after: int) -> list[int]:
    """`schedule`'s firings from change.low − before to change.high + after, in minutes from the
    change's day."""
    out = []
    for delta in range(-1 - before // DAY, 2 + after // DAY):
        day = change.day + _dt.timedelta(days=delta)
        if schedule.on(day):
            out += [delta * DAY + m for m in schedule.minutes
                    if change.low - before <= delta * DAY + m < change.high + after]
    return out


def _at_change(kind: str, expr: str, change: Change, minute: int, tz: str, lead: int = 0) -> str:
    written = f"{kind} {expr!r}" + (f" moved {lead}m earlier" if lead else "")
    when = _when(change.day, minute)
    if change.gap:
        effect = ("KEDA (robfig/cron) skips a time that does not exist, so " +
                  ("the previous window would stay open until the next end (a whole extra day or more)"
                   if kind == "start" else "that window would stay open until the next end, or not open at all"))
        return f"{written} fires at {when}, which does not exist: {change.describe(tz)}; {effect}"
    effect = ("KEDA (robfig/cron) fires it twice and opens the window at the second, "
              f"{(change.high - change.low)}m late" if kind == "start" else
              f"KEDA (robfig/cron) fires it twice and closes the window at the second, {(change.high - change.low)}m late")
    return f"{written} fires at {when}, which occurs twice: {change.describe(tz)}; {effect}"


def clock_change_clash(start: str, end: str, tz: str, lead: int, first_year: int) -> str | None:
    """Why KEDA would not open this window exactly from start − lead to end in `tz`, on the first
    date that goes wrong, or None. A start or end at a wall time that does not exist or occurs twice
    is refused; so is a lead that reaches across a clock change (the early start would fall in the
    change, or before it, and the window would open an hour early or late that day)."""
    s, e = Schedule.of(start), Schedule.of(end)
    for change in changes(tz, first_year):
        for kind, schedule, expr in (("end", e, end), ("start", s, start)):
            for minute in _firings_near(schedule, change, 0, 0):
                return _at_change(kind, expr, change, minute, tz)
        for minute in _firings_near(s, change, 0, lead):  # start − lead < high with start ≥ low
            early = minute - lead
            if change.low <= early < change.high:
                return _at_change("start", start, change, early, tz, lead)
            return (f"start {start!r} moved {lead}m earlier opens at {_when(change.day, early)}, before the clock "
                    f"change and its start after it ({_when(change.day, minute)}): {change.describe(tz)}, so "
                    f"that window would open {lead - (change.high - change.low) if change.gap else lead + change.high - change.low}m "
                    "early instead")
    return None


# The first year the checks walk (CYCLE_YEARS from it). Fixed, not the current year: the hooks'
# answer must not depend on the date they run (a message naming a date would change at New Year and
# write the status again). 29 years from 2026 cover every weekday/date combination and the time zone
# rules tzdata knows for the next decades; move it forward when tzdata is bumped years from now.
FIRST_YEAR = 2026


def this_year() -> int:
    """The year the checks start from (FIRST_YEAR, never the clock)."""
    return FIRST_YEAR


def max_safe_lead(start: str, tz: str, limit: int, first_year: int) -> int | None:
    """The longest lead up to `limit` minutes that keeps every early start clear of the clock
    changes of `tz` (None when the start itself falls in one)."""
    s = Schedule.of(start)
    best = limit
    for change in changes(tz, first_year):
        for minute in _firings_near(s, change, 0, limit):
            if minute < change.high:
                return None
            best = min(best, minute - change.high)
    return best
