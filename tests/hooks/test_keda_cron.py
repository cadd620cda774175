"""Warm windows against a model of KEDA's cron scaler, minute by minute over all of 2026.

The model, transliterated from the sources KEDA runs (github.com/kedacore/keda/v2@v2.20.1 and
github.com/robfig/cron/v3@v3.0.1 in the Go module cache, Go 1.26's time package):

- KEDA, pkg/scalers/cron_scaler.go 123-151 (GetMetricsAndActivity): now in the trigger's time zone,
  nextStart = start.Next(now), nextEnd = end.Next(now) (84-87, getCronTime); active when
  `nextStart.Before(nextEnd)` is false... precisely: if nextStart < nextEnd it is active when
  now > nextStart && now < nextEnd, which never holds (Next is after now); else when
  now > nextStart || now < nextEnd, which always holds. So: active <=> not nextStart < nextEnd.
- robfig/cron parser.go 88-140 and 236-357 (Parse with Minute|Hour|Dom|Month|Dow: the seconds field
  defaults to "0"; getRange sets the star bit for `*`/`?` unless a step above 1 is given).
- robfig/cron spec.go 58-188 (SpecSchedule.Next and dayMatches), line by line below, on:
- Go time: Date (time.go 1734-1773: normalise, look the offset up at the wall time read as UTC,
  look again at the corrected instant when it falls outside that zone period), AddDate (= Date
  with the fields added), Add (absolute), Truncate (absolute, since the zero time: whole minutes
  here), and Location.lookup (zoneinfo.go 149-: the offset and the [start, end) of its period).

What the test shows: for every window below, in Europe/Berlin, America/New_York and
Australia/Sydney (and America/Santiago, whose clocks change at midnight, robfig's special case),
either the hooks refuse it, or KEDA with the rendered trigger is active at exactly the minutes of
2026 from start − lead to end (the lead the hooks chose and announce). Refusals are checked too:
each refused window, rendered naively, would be active at other minutes than written.

Speed: Next is iterated from firing to firing (a few hundred calls per expression and year); between
two firings of either expression KEDA's answer cannot change, so each stretch is written into a
bytearray of the year's minutes at once and the two are compared whole. Next is also called
directly at every minute within two hours of each clock change and at every 2003rd other minute, to show that "the next firing in the iterated sequence" is what Next answers from any
minute.
"""

from __future__ import annotations

import bisect
import datetime as dt
import os
import random
import re
import subprocess
import zoneinfo
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import pydantic
import pytest

from hooks.api import LLMService, cron
from hooks.controller import autoscaling
from hooks.controller.sync import sync
from tests.hooks import helpers as h
from tests.hooks.golden_cases import MEASURED_COLD_START


def test_the_checks_start_from_a_fixed_year() -> None:
    # Never the clock's: the dates in the messages below are 2026's whenever the hooks run.
    assert cron.this_year() == cron.FIRST_YEAR == 2026


EPOCH = dt.date(1970, 1, 1).toordinal()
STAR_BIT = 1 << 63

# --------------------------------------------------------------------------------------------------
# Go's time.Location, from the IANA database Python reads (the same files Go reads on this system)


@dataclass
class Location:
    name: str
    tx: list[int]  # instants (unix seconds) where the offset changes
    offsets: list[int]  # offsets[i] holds from tx[i-1] to tx[i]; offsets[0] before tx[0]

    @classmethod
    @cache
    def load(cls, name: str) -> Location:
        zone = zoneinfo.ZoneInfo(name)

        def offset(ts: int) -> int:
            return int(dt.datetime.fromtimestamp(ts, zone).utcoffset().total_seconds())  # type: ignore[union-attr]

        lo, hi = int(dt.datetime(2024, 1, 1, tzinfo=dt.UTC).timestamp()), int(dt.datetime(2029, 1, 1, tzinfo=dt.UTC).timestamp())
        tx, offsets = [], [offset(lo)]
        for ts in range(lo, hi, 3600):
            if offset(ts + 3600) != offsets[-1]:
                a, b = ts, ts + 3600
                while b - a > 1:
                    mid = (a + b) // 2
                    a, b = (mid, b) if offset(mid) == offsets[-1] else (a, mid)
                tx.append(b)
                offsets.append(offset(b))
        return cls(name, tx, offsets)

    def lookup(self, sec: int) -> tuple[int, float, float]:
        """zoneinfo.go lookup: the offset at `sec` and its period [start, end)."""
        i = bisect.bisect_right(self.tx, sec)
        start = self.tx[i - 1] if i > 0 else float("-inf")
        end = self.tx[i] if i < len(self.tx) else float("inf")
        return self.offsets[i], start, end


def _norm(hi: int, lo: int, base: int) -> tuple[int, int]:
    """time.go norm: move lo into [0, base) by carrying into hi."""
    if lo < 0:
        n = (-lo - 1) // base + 1
        hi, lo = hi - n, lo + n * base
    if lo >= base:
        n = lo // base
        hi, lo = hi + n, lo - n * base
    return hi, lo


def go_date(year: int, month: int, day: int, hour: int, minute: int, sec: int, loc: Location) -> int:
    """time.Date (time.go 1734-1773), returning unix seconds."""
    year, m = _norm(year, month - 1, 12)
    minute, sec = _norm(minute, sec, 60)
    hour, minute = _norm(hour, minute, 60)
    day, hour = _norm(day, hour, 24)
    unix = (dt.date(year, m + 1, 1).toordinal() - EPOCH + day - 1) * 86400 + hour * 3600 + minute * 60 + sec
    offset, start, end = loc.lookup(unix)
    if offset != 0:
        utc = unix - offset
        if utc < start or utc >= end:
            offset, _, _ = loc.lookup(utc)
        unix -= offset
    return unix


class Wall(tuple):  # (year, month, day, hour, minute, second, weekday with Sunday = 0): Time's fields in loc
    year = property(lambda w: w[0])
    month = property(lambda w: w[1])
    day = property(lambda w: w[2])
    hour = property(lambda w: w[3])
    minute = property(lambda w: w[4])
    second = property(lambda w: w[5])
    weekday = property(lambda w: w[6])


@lru_cache(maxsize=4096)
def _civil(days: int) -> tuple[int, int, int, int]:
    d = dt.date.fromordinal(EPOCH + days)
    return d.year, d.month, d.day, (d.weekday() + 1) % 7


def wall(sec: int, loc: Location) -> Wall:
    offset, _, _ = loc.lookup(sec)
    days, rest = divmod(sec + offset, 86400)
    y, m, d, wd = _civil(days)
    return Wall((y, m, d, rest // 3600, rest % 3600 // 60, rest % 60, wd))


def add_date(sec: int, loc: Location, months: int = 0, days: int = 0) -> int:
    """Time.AddDate: Date with the wall fields plus the given months and days."""
    w = wall(sec, loc)
    return go_date(w.year, w.month + months, w.day + days, w.hour, w.minute, w.second, loc)


# --------------------------------------------------------------------------------------------------
# robfig/cron/v3: parser.go getField/getRange/getBits and spec.go Next/dayMatches

BOUNDS = {"minute": (0, 59, {}), "hour": (0, 23, {}), "dom": (1, 31, {}),
          "month": (1, 12, {n.lower(): v for n, v in cron.MONTHS.items()}),
          "dow": (0, 6, {n.lower(): v for n, v in cron.DAYS.items()})}


def get_field(text: str, bound: str) -> int:
    low, high, names = BOUNDS[bound]
    bits = 0
    for expr in text.split(","):
        range_and_step = expr.split("/")
        low_high = range_and_step[0].split("-")
        extra = 0
        if low_high[0] in ("*", "?"):
            start, end, extra = low, high, STAR_BIT
        else:
            start = names.get(low_high[0].lower(), None)
            start = int(low_high[0]) if start is None else start
            end = start if len(low_high) == 1 else names.get(low_high[1].lower(), None)
            end = int(low_high[1]) if end is None else end
        step = 1
        if len(range_and_step) == 2:
            step = int(range_and_step[1])
            if len(low_high) == 1:
                end = high
            if step > 1:
                extra = 0
        assert low <= start <= end <= high and step > 0, expr
        for i in range(start, end + 1, step):
            bits |= 1 << i
        bits |= extra
    return bits


@dataclass(frozen=True)
class Spec:
    second: int
    minute: int
    hour: int
    dom: int
    month: int
    dow: int

    @classmethod
    def parse(cls, expr: str) -> Spec:
        m, hr, dom, mon, dow = expr.split()
        return cls(1, get_field(m, "minute"), get_field(hr, "hour"), get_field(dom, "dom"), get_field(mon, "month"),
                   get_field(dow, "dow"))


def day_matches(s: Spec, w: Wall) -> bool:  # spec.go 179-188
    dom_match = (1 << w.day) & s.dom > 0
    dow_match = (1 << w.weekday) & s.dow > 0
    if s.dom & STAR_BIT or s.dow & STAR_BIT:
        return dom_match and dow_match
    return dom_match or dow_match


def next_fire(s: Spec, t: int, loc: Location) -> int | None:
    """spec.go 58-175, SpecSchedule.Next, for a schedule parsed without a TZ= prefix (Location is
    time.Local, so `loc` is the location of the time passed in: KEDA passes now in the trigger's
    zone). `t` is a whole second (unix); the result is unix seconds or None (the zero time)."""
    t = t + 1  # 82: the upcoming second (t has no nanoseconds here)
    added = False
    year_limit = wall(t, loc).year + 5
    while True:  # WRAP
        w = wall(t, loc)
        if w.year > year_limit:  # 91
            return None
        wrapped = False
        while (1 << w.month) & s.month == 0:  # 97-110
            if not added:
                added = True
                t = go_date(w.year, w.month, 1, 0, 0, 0, loc)
            t = add_date(t, loc, months=1)
            w = wall(t, loc)
            if w.month == 1:
                wrapped = True
                break
        if wrapped:
            continue
        while not day_matches(s, w):  # 117-136
            if not added:
                added = True
                t = go_date(w.year, w.month, w.day, 0, 0, 0, loc)
            t = add_date(t, loc, days=1)
            w = wall(t, loc)
            if w.hour != 0:  # 125-131: DST moved midnight
                t += (24 - w.hour) * 3600 if w.hour > 12 else -w.hour * 3600
                w = wall(t, loc)
            if w.day == 1:
                wrapped = True
                break
        if wrapped:
            continue
        while (1 << w.hour) & s.hour == 0:  # 138-148
            if not added:
                added = True
                t = go_date(w.year, w.month, w.day, w.hour, 0, 0, loc)
            t += 3600
            w = wall(t, loc)
            if w.hour == 0:
                wrapped = True
                break
        if wrapped:
            continue
        while (1 << w.minute) & s.minute == 0:  # 150-160
            if not added:
                added = True
                t -= t % 60  # Truncate(time.Minute)
            t += 60
            w = wall(t, loc)
            if w.minute == 0:
                wrapped = True
                break
        if wrapped:
            continue
        while (1 << w.second) & s.second == 0:  # 162-172
            if not added:
                added = True
            t += 1
            w = wall(t, loc)
            if w.second == 0:
                wrapped = True
                break
        if wrapped:
            continue
        return t


def firings(s: Spec, loc: Location, first: int, last: int) -> list[int]:
    """Every firing after `first` up to the first after `last`, by iterating Next."""
    out, t = [], first
    while True:
        nxt = next_fire(s, t, loc)
        if nxt is None:
            break
        out.append(nxt)
        if nxt > last:
            break
        t = nxt
    return out


def next_after(fires: list[int], t: int) -> int | None:
    """The first firing strictly after `t` in an iterated sequence."""
    i = bisect.bisect_right(fires, t)
    return fires[i] if i < len(fires) else None


# --------------------------------------------------------------------------------------------------
# The year


def utc(y: int, m: int, d: int, hh: int = 0, mm: int = 0) -> int:
    return int(dt.datetime(y, m, d, hh, mm, tzinfo=dt.UTC).timestamp())


YEAR_FIRST, YEAR_LAST = utc(2026, 1, 1) - 14 * 3600, utc(2027, 1, 1) + 14 * 3600  # 2026 in every zone below
MINUTES = range(YEAR_FIRST, YEAR_LAST, 60)


def minute_index(t: int) -> int:
    """The first minute of the grid at or after instant t (clamped to the grid)."""
    return min(max(0, -(-(t - YEAR_FIRST) // 60)), len(MINUTES))


def mark(active: bytearray, lo: int, hi: int) -> None:
    """Minutes in [lo, hi) are warm."""
    a, b = minute_index(lo), minute_index(hi)
    if b > a:
        active[a:b] = b"\x01" * (b - a)
MARGIN = 40 * 86400  # firings looked at before and after the year (a monthly window's previous start)


def _keda_says(next_start: int | None, next_end: int | None) -> bool:
    """cron_scaler.go 135-143 with now before both: active unless nextStart.Before(nextEnd). (The
    zero time, no firing within five years, is before any other time.)"""
    ns = -1 if next_start is None else next_start
    ne = -1 if next_end is None else next_end
    return not ns < ne


@cache
def keda_active(start: str, end: str, tz: str, probe_every: int = 0) -> bytes:
    """KEDA's answer at each minute of the year (1 = active)."""
    loc = Location.load(tz)
    s, e = Spec.parse(start), Spec.parse(end)
    fs = firings(s, loc, YEAR_FIRST - MARGIN, YEAR_LAST + MARGIN)
    fe = firings(e, loc, YEAR_FIRST - MARGIN, YEAR_LAST + MARGIN)
    active = bytearray(len(MINUTES))
    cuts = sorted({YEAR_FIRST, *(t for t in fs + fe if YEAR_FIRST < t < YEAR_LAST), YEAR_LAST})
    for lo, hi in zip(cuts, cuts[1:], strict=False):  # KEDA's answer is the same from lo up to hi
        if _keda_says(next_after(fs, lo), next_after(fe, lo)):
            mark(active, lo, hi)
    # Next from any minute is the next firing in the iterated sequence: every minute within two
    # hours of a clock change, and every `probe_every`th minute elsewhere.
    probe = set(range(0, len(MINUTES), probe_every)) if probe_every else set()
    for change in loc.tx:
        if YEAR_FIRST < change < YEAR_LAST:
            i = minute_index(change)
            probe.update(range(max(0, i - 120), min(len(MINUTES), i + 120)))
    for i in sorted(probe):
        m = MINUTES[i]
        got = next_fire(s, m, loc), next_fire(e, m, loc)
        assert got == (next_after(fs, m), next_after(fe, m)), (start, end, tz, m)
        assert active[i] == _keda_says(*got)
    return bytes(active)


def _wall_firings(expr: str, tz: str) -> list[tuple[int, str]]:
    """The wall-clock firings of `expr` around 2026 as instants, independently of robfig: each
    written wall time must exist exactly once (else the window is ill-defined and must have been
    refused); returns (instant, problem) with problem '' when the time is well-defined."""
    fields = cron.parse(expr)
    dom_star, dow_star = cron.stars(expr)
    zone = zoneinfo.ZoneInfo(tz)
    out = []
    day = dt.date(2025, 11, 20)
    while day <= dt.date(2027, 2, 10):
        dom_ok, dow_ok = day.day in fields[2], (day.weekday() + 1) % 7 in fields[4]
        on = day.month in fields[3] and ((dom_ok and dow_ok) if (dom_star or dow_star) else (dom_ok or dow_ok))
        if on:
            for hour in sorted(fields[1]):
                for minute in sorted(fields[0]):
                    naive = dt.datetime(day.year, day.month, day.day, hour, minute)
                    a, b = naive.replace(tzinfo=zone, fold=0), naive.replace(tzinfo=zone, fold=1)
                    inst = int(a.timestamp())
                    back = dt.datetime.fromtimestamp(inst, zone).replace(tzinfo=None)
                    problem = "" if back == naive and a.timestamp() == b.timestamp() else f"{naive} is not one instant"
                    out.append((inst, problem))
        day += dt.timedelta(days=1)
    return out


def intended_active(start: str, end: str, tz: str, lead: int) -> bytearray:
    """Warm from each start − lead to the next end after that start, on the instants the wall times
    mean; asserts the window is well-defined (what an admitted window must be)."""
    starts, ends = _wall_firings(start, tz), _wall_firings(end, tz)
    bad = [p for _, p in starts + ends if p]
    assert not bad, (start, end, tz, bad[:3])
    events = sorted([(t, 1) for t, _ in starts] + [(t, 0) for t, _ in ends])
    active = bytearray(len(MINUTES))
    kinds = [k for _, k in events]
    assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False)), f"{start}/{end}: starts and ends do not alternate"
    times = [t for t, _ in events]
    assert len(set(times)) == len(times), f"{start}/{end}: a start and an end at one instant"
    for (t0, k0), (t1, _) in zip(events, events[1:], strict=False):
        if k0 == 1:
            assert t0 - lead * 60 > max([t for t, k in events if k == 0 and t < t0], default=-1), "lead reaches the previous end"
            mark(active, t0 - lead * 60, t1)
    return active


# (start, end, time zone, leadTime, measured cold start in seconds or None)
WINDOWS = [
    # The issue's two examples: refused (fixed lead) and held short (auto).
    ("30 3 * * *", "0 18 * * *", "Europe/Berlin", "1h", None),
    ("0 3 * * *", "0 9 * * *", "America/New_York", "auto", 83),
    ("0 3 * * *", "0 9 * * *", "America/New_York", "2m", None),
    # Europe/Berlin: 2026-03-29 02:00→03:00, 2026-10-25 03:00→02:00.
    ("30 3 * * *", "0 18 * * *", "Europe/Berlin", "30m", None),
    ("30 3 * * *", "0 18 * * *", "Europe/Berlin", "auto", 3000),
    ("0 8 * * MON-FRI", "0 18 * * MON-FRI", "Europe/Berlin", "auto", 83),
    ("30 2 * * *", "0 6 * * *", "Europe/Berlin", None, None),
    ("0 3 * * SUN", "0 12 * * SUN", "Europe/Berlin", "45m", None),
    ("0 22 * * SAT", "0 4 * * SUN", "Europe/Berlin", "1h", None),
    ("0 1 * * *", "30 2 * * *", "Europe/Berlin", None, None),
    ("15 3 * * *", "0 4 * * *", "Europe/Berlin", "15m", None),
    ("0 3 * * *", "0 4 * * *", "Europe/Berlin", "1m", None),
    ("0 0 * * *", "0 6 * * *", "Europe/Berlin", "1h", None),
    ("0 8,14 * * *", "0 12,18 * * *", "Europe/Berlin", "20m", None),
    ("*/15 9-17 * * 1-5", "0 18 * * 1-5", "Europe/Berlin", None, None),
    ("0 8 * * MON", "0 18 * * *", "Europe/Berlin", None, None),
    # America/New_York: 2026-03-08 02:00→03:00, 2026-11-01 02:00→01:00.
    ("0 8 * * MON-FRI", "0 17 * * MON-FRI", "America/New_York", "1h", None),
    ("30 1 * * SUN", "0 5 * * SUN", "America/New_York", None, None),
    ("0 2 * * *", "0 3 * * *", "America/New_York", None, None),
    ("0 20 * * SAT", "0 4 * * SUN", "America/New_York", "30m", None),
    ("5 3 * * *", "0 6 * * *", "America/New_York", "5m", None),
    ("0 1 * * *", "0 5 * * *", "America/New_York", "1h", None),
    ("0 0 * * SUN", "30 0 * * SUN", "America/New_York", "auto", 3600),
    # Australia/Sydney: 2026-04-05 03:00→02:00, 2026-10-04 02:00→03:00.
    ("0 3 * * *", "0 9 * * *", "Australia/Sydney", "1h", None),
    ("0 4 * * *", "0 9 * * *", "Australia/Sydney", "1h", None),
    ("0 3 * * *", "0 9 * * *", "Australia/Sydney", "auto", 1800),
    ("0 8 * * MON-FRI", "0 18 * * MON-FRI", "Australia/Sydney", "auto", 1200),
    ("30 23 * * SAT", "0 6 * * SUN", "Australia/Sydney", "45m", None),
    ("30 2 * * SUN", "0 5 * * SUN", "Australia/Sydney", None, None),
    ("0 9 1 * *", "0 17 1 * *", "Australia/Sydney", "10m", None),
    ("*/30 * 1 * *", "59 23 1 * *", "Australia/Sydney", None, None),
    # America/Santiago changes its clocks at midnight (robfig's "midnight does not exist" branch).
    ("0 6 * * *", "0 12 * * *", "America/Santiago", "1h", None),
    ("0 1 * * *", "0 7 * * *", "America/Santiago", "1h", None),
    ("30 23 * * SAT", "0 2 * * SUN", "America/Santiago", None, None),
]


def _service(start: str, end: str, tz: str, lead: str | None, measured: int | None) -> dict[str, Any]:
    win: dict[str, Any] = {"start": start, "end": end, "timeZone": tz}
    if lead is not None:
        win["leadTime"] = lead
    status = {"lastColdStart": {**MEASURED_COLD_START, "total": f"{measured}s"}} if measured else None
    return h.llmservice(scaling={"min": 0, "max": 3, "schedules": [win]}, status=status)


def _naive_lead(lead: str | None, measured: int | None) -> int:
    if lead is None:
        return 0
    if lead == "auto":
        return -(-(measured or 0) // 60)
    return int(re.match(r"(\d+)", lead).group(1)) * (60 if lead.endswith("h") else 1)  # type: ignore[union-attr]


@pytest.mark.parametrize("case", WINDOWS, ids=lambda c: f"{c[2]}:{c[0]}-{c[1]}:{c[3]}")
def test_a_year_of_minutes_each_window_is_warm_exactly_as_written_or_refused(case: tuple) -> None:
    start, end, tz, lead, measured = case
    svc = _service(*case)
    try:
        model = LLMService.model_validate(svc)
    except pydantic.ValidationError:
        # Refused: rendered as it was before the check (start shifted on the wall clock), KEDA
        # would indeed be warm at other minutes than written (or the window means no one thing).
        shifted = cron.shift_earlier(start, _naive_lead(lead, measured))
        assert shifted is not None
        try:
            intended = intended_active(start, end, tz, _naive_lead(lead, measured))
        except AssertionError:
            return
        assert keda_active(shifted, end, tz) != intended, f"{case} was refused but KEDA would open it as written"
        return
    (window,) = model.spec.scaling.schedules
    lead_minutes = window.lead(float(measured) if measured else None)
    (so,) = autoscaling.sync(h.decorator_request(svc), h.config())["attachments"]
    (trigger,) = [t for t in so["spec"]["triggers"] if t["type"] == "cron"]
    meta = trigger["metadata"]
    assert meta["timezone"] == tz and meta["end"] == end and meta["start"] == cron.shift_earlier(start, lead_minutes)
    if lead not in (None, "auto"):
        assert lead_minutes == _naive_lead(lead, measured)
    keda = keda_active(meta["start"], meta["end"], tz, probe_every=2003)
    intended = intended_active(start, end, tz, lead_minutes)
    if keda != intended:
        wrong = [i for i in range(len(MINUTES)) if keda[i] != intended[i]]
        raise AssertionError(f"{case}: KEDA is {'warm' if keda[wrong[0]] else 'cold'} at "
                             f"{dt.datetime.fromtimestamp(MINUTES[wrong[0]], zoneinfo.ZoneInfo(tz))}, "
                             f"{len(wrong)} minutes differ")
    assert intended.count(1) > 0


def test_the_model_reproduces_the_issue_measurements() -> None:
    """Rendered as before (the lead shifted on the wall clock), the issue's two windows stay warm for
    a whole extra day in KEDA's model: that is what the checks refuse or avoid."""
    berlin = keda_active("30 2 * * *", "0 18 * * *", "Europe/Berlin")
    z = zoneinfo.ZoneInfo("Europe/Berlin")
    at = {int(dt.datetime(2026, 3, d, hh, mm, tzinfo=z).timestamp()): (d, hh, mm)
          for d, hh, mm in [(28, 2, 29), (28, 2, 30), (28, 18, 0), (29, 12, 0), (29, 17, 59), (29, 18, 0)]}
    got = {v: bool(berlin[minute_index(k)]) for k, v in at.items()}
    assert got == {(28, 2, 29): False, (28, 2, 30): True, (28, 18, 0): True, (29, 12, 0): True, (29, 17, 59): True,
                   (29, 18, 0): False}
    ny = keda_active("58 2 * * *", "0 9 * * *", "America/New_York")
    z = zoneinfo.ZoneInfo("America/New_York")
    warm = [bool(ny[minute_index(int(dt.datetime(2026, 3, d, hh, tzinfo=z).timestamp()))])
            for d, hh in [(7, 3), (7, 12), (7, 23), (8, 8), (8, 9)]]
    assert warm == [True, True, True, True, False]


def test_every_30_minutes_on_the_1st_is_warm_29_minutes_a_month_in_keda() -> None:
    active = keda_active("*/30 * 1 * *", "59 23 1 * *", "UTC")
    assert active[minute_index(utc(2026, 1, 1)):minute_index(utc(2026, 2, 1))].count(1) == 29


def test_the_auto_lead_held_short_is_announced() -> None:
    svc = _service("0 3 * * *", "0 9 * * *", "America/New_York", "auto", 83)
    cond = next(c for c in sync(h.sync_request(svc), h.config())["status"]["conditions"] if c["type"] == "AutoscalingReady")
    assert "held at 0m because a longer lead would cross a clock change" in cond["message"]


GO_MAIN = '''package main

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// Each stdin line "<tz>|<expr>|<unix>": print Next(unix in tz) as unix seconds, 0 for the zero time.
func main() {
	parser := cron.NewParser(cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow)
	in, out := bufio.NewScanner(os.Stdin), bufio.NewWriter(os.Stdout)
	defer out.Flush()
	for in.Scan() {
		p := strings.Split(in.Text(), "|")
		loc, _ := time.LoadLocation(p[0])
		s, _ := parser.Parse(p[1])
		u, _ := strconv.ParseInt(p[2], 10, 64)
		n := s.Next(time.Unix(u, 0).In(loc))
		if n.IsZero() {
			fmt.Fprintln(out, 0)
		} else {
			fmt.Fprintln(out, n.Unix())
		}
	}
}
'''


@pytest.mark.skipif(os.environ.get("NOCTAYA_GO_CROSSCHECK") != "1", reason="set NOCTAYA_GO_CROSSCHECK=1 (needs go and "
                    "github.com/robfig/cron/v3@v3.0.1 in the module cache; builds offline, about a minute)")
def test_the_model_answers_what_robfig_cron_answers(tmp_path: Any) -> None:
    """The Python Next against robfig/cron's own, compiled here: every minute within three hours of
    each 2026 clock change and 200 random seconds of the year, in zones whose clocks change at 02:00,
    03:00, midnight and by 30 minutes."""
    (tmp_path / "main.go").write_text(GO_MAIN)
    (tmp_path / "go.mod").write_text("module check\n\ngo 1.22\n\nrequire github.com/robfig/cron/v3 v3.0.1\n")
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOPROXY": "off", "GOSUMDB": "off"}
    subprocess.run(["go", "build", "-o", "check", "."], cwd=tmp_path, env=env, check=True, timeout=600)
    rng = random.Random(20)
    exprs = ["30 2 * * *", "0 3 * * *", "58 2 * * *", "30 1 * * *", "0 0 * * *", "30 23 * * SAT", "*/15 9-17 * * 1-5",
             "0 9 1 * *", "59 23 1 * *", "0 12 29 2 *", "5/10 0-23/2 1,15 jan-DEC sun"]
    cases = []
    for tz in ["Europe/Berlin", "America/New_York", "Australia/Sydney", "America/Santiago", "Australia/Lord_Howe",
               "America/Havana"]:
        loc = Location.load(tz)
        points = {p for change in loc.tx if YEAR_FIRST < change < YEAR_LAST for p in range(change - 3 * 3600, change + 3 * 3600, 60)}
        points.update(rng.randrange(YEAR_FIRST, YEAR_LAST) for _ in range(200))
        cases += [(tz, e, p) for e in exprs for p in sorted(points)]
    answer = subprocess.run([str(tmp_path / "check")], input="".join(f"{tz}|{e}|{p}\n" for tz, e, p in cases),
                            capture_output=True, text=True, check=True, timeout=600).stdout.split()
    differ = [(c, int(a) or None) for c, a in zip(cases, answer, strict=True)
              if next_fire(Spec.parse(c[1]), c[2], Location.load(c[0])) != (int(a) or None)]
    assert not differ, differ[:5]
