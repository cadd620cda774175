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
