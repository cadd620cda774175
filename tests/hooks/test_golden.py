"""Golden tests: committed Metacontroller-shaped requests → exactly the committed responses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.hooks import helpers as h
from tests.hooks.golden_cases import CASES, HOOKS
from tests.hooks.golden_facts import FACTS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hooks"
UPDATE = os.environ.get("NOCTAYA_UPDATE_GOLDEN") == "1"


def _dump(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    folder = FIXTURES / case
    if UPDATE:
        hook, request = CASES[case]()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hook").write_text(hook + "\n")
        (folder / "request.json").write_text(_dump(request))
        (folder / "expected.json").write_text(_dump(HOOKS[hook](request, h.config(h.LATER_TIME))))
    hook = (folder / "hook").read_text().strip()
    request = json.loads((folder / "request.json").read_text())
    expected = json.loads((folder / "expected.json").read_text())
    answer = HOOKS[hook](request, h.config(h.LATER_TIME))
    assert answer == expected, f"{case}: response differs; rerun with NOCTAYA_UPDATE_GOLDEN=1 and review the diff"
    # Byte-identical on the wire too (the hook server serialises with json.dumps).
    assert json.dumps(answer) == json.dumps(HOOKS[hook](json.loads(json.dumps(request)), h.config(h.LATER_TIME)))


def test_every_fixture_folder_is_a_case() -> None:
    on_disk = {p.name for p in FIXTURES.iterdir() if p.is_dir() and (p / "request.json").exists()}
    assert on_disk == set(CASES), "stale or missing golden folders"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_facts_hold(case: str) -> None:
    """The hand-written facts hold for the committed snapshot and for the live answer alike."""
    folder = FIXTURES / case
    hook = (folder / "hook").read_text().strip()
    request = json.loads((folder / "request.json").read_text())
    FACTS[case](json.loads((folder / "expected.json").read_text()))
    FACTS[case](HOOKS[hook](request, h.config(h.LATER_TIME)))


def test_every_case_has_facts() -> None:
    assert set(FACTS) == set(CASES)
