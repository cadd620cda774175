"""The shared gateway's model table (gateway.modeltable): parsing at its limits, clear refusals that
name the entry, and a mounted file reread on change that keeps the last good table when the new one
is bad (a wrong ConfigMap must never drop the models already served)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from gateway.config import ConfigError, GatewayConfig
from gateway.modeltable import MAX_MODELS, MAX_TABLE_BYTES, ModelTableFile, parse_model_table

BASE = GatewayConfig(backend_url="http://unused:1", served_model_name="unused", max_held_body_bytes=64 * 2**20)


def table(*entries: dict) -> bytes:
    return json.dumps({"models": list(entries)}).encode()


def entry(name: str, **fields: object) -> dict:
    host = "".join(c if c.isalnum() else "-" for c in name.lower())[:50]
    return {"name": name, "backendURL": f"http://{host}-backend.models.svc:8000", **fields}


def test_each_model_gets_the_pods_settings_with_its_own_replaced() -> None:
    parsed = parse_model_table(table(entry("qwen", maxQueue=7, coldMode="REJECT"), entry("org/Llama-3.1:8b")), BASE)
    assert list(parsed.models) == ["qwen", "org/Llama-3.1:8b"]  # the file's order is the listing's
    qwen = parsed.models["qwen"]
    assert (qwen.served_model_name, qwen.max_queue, qwen.cold_mode) == ("qwen", 7, "reject")
    assert qwen.backend_port == 8000 and qwen.listen_port == BASE.listen_port
    llama = parsed.models["org/Llama-3.1:8b"]
    assert llama.max_queue == BASE.max_queue and llama.max_connections == BASE.max_connections


@pytest.mark.parametrize(("doc", "message"), [
    (b"{", "not JSON"),
    (b"[]", '"models" list'),
    (table({"backendURL": "http://a:1"}), "models[0]: name"),
    (table(entry(" padded")), "surrounding spaces"),
    (table(entry("x" * 257)), "at most 256"),
    (table(entry("tab\there")), "printable"),
    (table({"name": "a"}), "models[0] (a): backendURL is required"),
    (table(entry("a", backendURL="https://a:1")), "backendURL: must be an http:// URL"),
    (table(entry("a", maxQueue=0)), "maxQueue: must be >= 1"),
    (table(entry("a", maxQueue=True)), "maxQueue must be a string or a number"),
    (table(entry("a", listenPort=1)), "unknown field(s) listenPort"),
    (table(entry("a", maxBodyBytes=64 * 2**20 + 1)), "held-body budget"),
    (table(entry("a"), entry("b"), entry("a")), "models[2]: 'a' is listed twice"),
    (table(entry("a", authKeyFile="/k", authKeyFiles=["/k"])), "models[0] (a): authKeyFile and authKeyFiles"),
    (table(entry("a", authKeyFiles=[])), "models[0] (a): authKeyFiles must be a list of 1 to 16"),
    (table(entry("a", authKeyFiles="/k")), "authKeyFiles must be a list"),
    (table(entry("a", authKeyFiles=[f"/k{i}" for i in range(17)])), "authKeyFiles must be a list of 1 to 16"),
    (table(entry("a", authKeyFiles=["/k", 7])), "models[0] (a): authKeyFiles[1] must be a non-empty string"),
    (table(entry("a", authKeyFiles=["/k", "  "])), "authKeyFiles[1] must be a non-empty string"),
    (table(entry("a", authKeyFiles=["/k", "/k"])), "authKeyFiles[1] lists '/k' twice"),
])
def test_a_bad_table_is_refused_naming_the_entry_and_field(doc: bytes, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_model_table(doc, BASE)
    assert message in str(refused.value)


def test_limits_hold_exactly_at_the_limit() -> None:
    at_limit = table(*(entry(f"m{i}") for i in range(MAX_MODELS)))
    assert len(parse_model_table(at_limit, BASE).models) == MAX_MODELS
    with pytest.raises(ConfigError, match="at most 256"):
        parse_model_table(table(*(entry(f"m{i}") for i in range(MAX_MODELS + 1))), BASE)
    name = "n" * 256
    assert name in parse_model_table(table(entry(name)), BASE).models
    padded = table(entry("a"))
    padded = padded[:-1] + b" " * (MAX_TABLE_BYTES - len(padded)) + b"}"
    assert len(padded) == MAX_TABLE_BYTES and parse_model_table(padded, BASE).models
    with pytest.raises(ConfigError, match="larger than"):
        parse_model_table(padded[:-1] + b" }", BASE)
    with pytest.raises(ConfigError, match="not JSON"):
        parse_model_table(b"[" * 100_000, BASE)  # nesting: refused, never a RecursionError


def test_a_model_takes_one_key_file_or_a_list_of_up_to_16() -> None:
    files = [f"/keys/team-{i}/api-key" for i in range(16)]
    parsed = parse_model_table(table(entry("a", authKeyFiles=files), entry("b", authKeyFile="/keys/b"),
                                     entry("c", authKeyFiles=[" /keys/c "])), BASE)
    assert parsed.models["a"].key_files == tuple(files) and parsed.models["a"].auth_key_file is None
    assert parsed.models["b"].key_files == ("/keys/b",)
    assert parsed.models["c"].key_files == ("/keys/c",)
    # A Pod-wide key file is replaced by a model's list, never added to it.
    pod_keyed = dataclasses.replace(BASE, auth_key_file="/keys/pod")
    assert parse_model_table(table(entry("a", authKeyFiles=["/keys/a"])), pod_keyed).models["a"].key_files == (
        "/keys/a",)


def test_diff_names_added_removed_and_changed_models() -> None:
    old = parse_model_table(table(entry("a"), entry("b"), entry("c")), BASE)
    new = parse_model_table(table(entry("b", maxQueue=5), entry("c"), entry("d")), BASE)
    change = old.diff(new)
    assert (change.added, change.removed, change.changed) == (("d",), ("a",), ("b",))
    assert old.diff(old) == type(change)((), (), ())


def test_diff_names_a_member_with_a_new_name_renamed_not_removed_and_added() -> None:
    old = parse_model_table(table(entry("qwen-7b", member="qwen"), entry("x", member="x"), entry("old")), BASE)
    new = parse_model_table(table(entry("qwen-14b", member="qwen"), entry("x", member="x"), entry("fresh")), BASE)
    assert old.members == {"qwen-7b": "qwen", "x": "x"}
    change = old.diff(new)
    assert change.renamed == (("qwen-7b", "qwen-14b"),)
    assert (change.added, change.removed, change.changed) == (("fresh",), ("old",), ())
    # Taking the name another model still has is no rename: the old name is removed.
    taken = parse_model_table(table(entry("x", member="qwen")), BASE)
    assert old.diff(taken).renamed == () and old.diff(taken).removed == ("qwen-7b", "old")


def test_the_upgrade_that_adds_members_to_a_table_changes_no_model() -> None:
    """The first table the 0.2.0 hooks write differs from 0.1.0's by `member` and `scaledObject` only:
    the gateway's reload keeps every model's app (held requests, leases) as it is."""
    old = parse_model_table(table(entry("a"), entry("b")), BASE)
    new = parse_model_table(table(entry("a", member="a", scaledObject="ns/a-backend"),
                                  entry("b", member="b", scaledObject="ns/b-backend")), BASE)
    assert old.diff(new) == type(old.diff(new))((), (), ())


@pytest.mark.parametrize(("doc", "message"), [
    (table(entry("a", member=""), entry("b")), "member must be a non-empty string"),
    (table(entry("a", member=7)), "member must be a non-empty string"),
    (table(entry("a", member="s"), entry("b", member="s")), "member 's' is listed twice"),
    (table(entry("a", scaledObject="ns/s"), entry("b", scaledObject="ns/s")), "scaledObject 'ns/s' is listed twice"),
    (table(entry("a", scaledObject=["ns/s"])), "scaledObject must be a non-empty string"),
])
def test_a_bad_member_is_refused(doc: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_model_table(doc, BASE)


def swap(path: Path, data: bytes) -> None:
    """As the kubelet updates a ConfigMap volume: a new file renamed over the old one."""
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_the_mounted_table_is_reread_on_change_and_a_bad_one_keeps_the_last_good(tmp_path: Path) -> None:
    path = tmp_path / "models.json"
    watched = ModelTableFile(path, BASE)
    assert watched.poll() is None and "No such file" in (watched.error or "")
    swap(path, table(entry("a")))
    first = watched.poll()
    assert first is not None and list(first.models) == ["a"] and watched.error is None
    assert watched.poll() is None  # unchanged: one stat, nothing parsed
    swap(path, b'{"models": [')  # half-written
    assert watched.poll() is None and watched.table is first and "not JSON" in (watched.error or "")
    assert watched.poll() is None  # the same bad file is not parsed (or reported) again
    swap(path, table(entry("a"), entry("b")))
    second = watched.poll()
    assert second is not None and list(second.models) == ["a", "b"] and watched.error is None
    path.unlink()  # a vanished file keeps the table in force
    assert watched.poll() is None and watched.table is second


def test_balancing_beside_the_table_sets_per_model_options_and_never_refuses_it(tmp_path: Path) -> None:
    """``balancing.json`` (written by the hooks only when a member sets an option; a file of its own
    because the previous release's gateway refuses unknown table fields) applies to the models it
    names; a bad one is ignored whole, the table still served."""
    path = tmp_path / "models.json"
    swap(path, table(entry("a"), entry("b")))
    watched = ModelTableFile(path, BASE)
    first = watched.poll()
    assert first is not None and first.models["a"].prefix_affinity is True and first.models["a"].pod_batch == 8
    swap(tmp_path / "balancing.json", json.dumps({"models": {
        "a": {"prefixAffinity": False, "coldBatchPerPod": 3, "someFutureField": 1}, "gone": {"coldBatchPerPod": 2}}
    }).encode())
    second = watched.poll()  # the balancing file changed: reread, though the table did not
    assert second is not None and watched.balancing_error is None
    assert (second.models["a"].prefix_affinity, second.models["a"].pod_batch) == (False, 3)
    assert second.models["b"] == first.models["b"]
    assert second.diff(first).changed == ("a",)
    swap(tmp_path / "balancing.json", b'{"models": {"a": {"coldBatchPerPod": 0}}}')
    third = watched.poll()
    assert third is not None and third.models["a"] == first.models["a"]  # ignored whole, defaults in force
    assert "coldBatchPerPod" in (watched.balancing_error or "")
    swap(tmp_path / "balancing.json", b"[")
    assert watched.poll() is not None and "not an object" in (watched.balancing_error or "")
