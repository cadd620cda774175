"""HookConfig: defaults, environment, token key file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hooks.config import DEFAULT_IMAGE, HookConfig, utc_now_rfc3339


def test_from_env_defaults() -> None:
    cfg = HookConfig.from_env({})
    assert cfg.image == DEFAULT_IMAGE and cfg.image_pull_policy == "IfNotPresent" and cfg.cluster_domain == "cluster.local"
    assert len(cfg.token_key) >= 16
    assert HookConfig.from_env({}).token_key == cfg.token_key  # one random key per process, not per call
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", cfg.clock())
    assert "token_key" not in repr(cfg)


def test_from_env_reads_values_and_key_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    cfg = HookConfig.from_env({"NOCTAYA_IMAGE": "registry.local/noctaya:dev", "NOCTAYA_IMAGE_PULL_POLICY": "Always",
                               "NOCTAYA_CLUSTER_DOMAIN": "corp.internal.", "NOCTAYA_TOKEN_KEY_FILE": str(key)})
    assert (cfg.image, cfg.image_pull_policy, cfg.cluster_domain) == ("registry.local/noctaya:dev", "Always", "corp.internal")
    assert cfg.token_key == b"0123456789abcdef0123456789abcdef"


def test_from_env_rejects_bad_values(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        HookConfig.from_env({"NOCTAYA_TOKEN_KEY_FILE": str(short)})
    with pytest.raises(ValueError, match="PULL_POLICY"):
        HookConfig.from_env({"NOCTAYA_IMAGE_PULL_POLICY": "Sometimes"})


def test_clock_format() -> None:
    assert utc_now_rfc3339().endswith("Z")


def test_kubernetes_timestamps_parse_to_aware_datetimes_and_anything_else_to_none() -> None:
    from datetime import UTC, datetime

    from hooks.config import parse_rfc3339

    assert parse_rfc3339("2026-12-07T10:00:00Z") == datetime(2026, 12, 7, 10, tzinfo=UTC)
    assert parse_rfc3339("2026-12-07T11:00:00+01:00") == datetime(2026, 12, 7, 10, tzinfo=UTC)
    # No offset (a hand-written status): read as UTC, never a naive datetime an aware clock cannot subtract.
    assert parse_rfc3339("2026-12-07T10:00:00") == datetime(2026, 12, 7, 10, tzinfo=UTC)
    for bad in ("", "yesterday", None, 12, ["2026-12-07T10:00:00Z"]):
        assert parse_rfc3339(bad) is None


def test_a_routed_condition_stamped_without_an_offset_counts_its_grace_instead_of_failing_the_hook() -> None:
    from hooks.config import HookConfig
    from hooks.controller.finalize import route_grace_left

    cfg = HookConfig(clock=lambda: "2026-12-07T10:00:30Z", route_grace_seconds=90)
    parent = {"status": {"conditions": [{"type": "Routed", "status": "False", "lastTransitionTime": "2026-12-07T10:00:00"}]}}
    assert route_grace_left(parent, cfg) == 60.0
    parent["status"]["conditions"][0]["lastTransitionTime"] = "not a time"
    assert route_grace_left(parent, cfg) == 90.0
