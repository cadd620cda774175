"""hooks.compat on its own: version order and the start-up check (the HTTP boundary is in test_app.py)."""

from __future__ import annotations

import pytest

from hooks.compat import check_controller, expected_version_problem, parse_version


def controller(version: str) -> dict:
    return {"controller": {"metadata": {"name": "c", "annotations": {"serving.noctaya.io/version": version}}}}


@pytest.mark.parametrize(("wanted", "running", "refused"), [
    ("0.10.0", "0.9.0", True),  # numbers, not strings: "0.10.0" < "0.9.0" as text
    ("0.9.0", "0.10.0", False),
    ("1.0.0", "0.99.99", True),
    ("0.2.1", "0.2.0", True),
    ("0.2.0", "0.2.0", False),
])
def test_only_a_newer_controller_is_refused(wanted: str, running: str, refused: bool) -> None:
    assert (check_controller(controller(wanted), running=running) is not None) is refused


def test_a_request_without_a_controller_object_is_left_to_the_hook() -> None:
    assert check_controller({}) is None and check_controller({"controller": "x"}) is None
    assert check_controller({"controller": {"metadata": {"annotations": "x"}}}) is None


@pytest.mark.parametrize(("expected", "problem"), [
    ("", None),
    ("0.2.0", None),
    ("0.1.5", None),  # a newer image serves older manifests
    ("0.2.1", "this image runs Noctaya 0.2.0 but the noctaya-hooks Deployment is from 0.2.1"),
    ("latest", 'NOCTAYA_EXPECTED_VERSION: "latest" is not a MAJOR.MINOR.PATCH version'),
])
def test_expected_version_at_start(expected: str, problem: str | None) -> None:
    said = expected_version_problem({"NOCTAYA_EXPECTED_VERSION": expected}, running="0.2.0")
    assert said == problem if problem is None else said.startswith(problem)


def test_a_long_annotation_is_quoted_short() -> None:
    refusal = check_controller(controller("x" * 10_000), running="0.2.0")
    assert refusal is not None and len(refusal.message) < 600
    with pytest.raises(ValueError, match="is not a MAJOR.MINOR.PATCH version"):
        parse_version("1.2")
