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
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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

