"""Child names and label values: valid, stable, unique."""

from __future__ import annotations

from hooks.resources import labels as lb
from hooks.resources import names


def test_short_names_are_readable() -> None:
    assert names.backend("qwen") == "qwen-backend"
    assert names.public_service("qwen") == "qwen-gateway"
    assert names.scaler("qwen") == "qwen-scaler"
    assert names.scaler_token("qwen") == "qwen-scaler-token"


def test_long_and_dotted_names_are_shortened_with_a_stable_hash() -> None:
    long = "a" * 60 + ".example.com"
    got = names.backend(long)
    assert names.is_dns1035_label(got) and len(got) <= 63 and got.endswith("-backend")
    assert got == names.backend(long)  # stable
    assert names.stable_hash(long) in got
    # The hash is of the full name: two names that share a long prefix stay distinct.
    assert names.backend("b" * 70) != names.backend("b" * 71)
    # Dots are not allowed in Service names: replaced, and hashed so `a.b` never equals `a-b`.
    assert names.backend("a.b") != names.backend("a-b") == "a-b-backend"
    assert names.is_dns1035_label(names.backend("7up"))  # must start with a letter
    assert names.stable_hash("qwen") == "67f2d225"  # sha256 prefix: fixed across processes and versions


def test_no_two_services_share_a_child_name() -> None:
    services = ["qwen", "qwen-backend", "qwen-gateway", "qwen-scaler", "qwen-scaler-token", "qwen-cache", "q", "q-scaler"]
    builders = [names.backend, names.gateway, names.scaler, names.aggregator, names.scaler_token, names.cache]
    seen: dict[str, tuple[str, str]] = {}
    for svc in services:
        for build in builders:
            name = build(svc)
            assert name not in seen or seen[name][0] == svc, (name, seen.get(name), svc)
            seen[name] = (svc, build.__name__)


def test_label_rules() -> None:
    assert lb.is_valid_label_value("") and lb.is_valid_label_value("a.b_c-d")
    assert not lb.is_valid_label_value("-a") and not lb.is_valid_label_value("a" * 64)
    assert lb.is_valid_label_key("serving.noctaya.io/llmservice") and lb.is_valid_label_key("app")
    assert not lb.is_valid_label_key("Bad_Prefix/x") and not lb.is_valid_label_key("/x") and not lb.is_valid_label_key("a/")
    long = "m" * 200 + ".models"
    value = lb.label_value(long)
    assert lb.is_valid_label_value(value) and value == lb.label_value(long) and value != lb.label_value(long + "x")
    assert lb.label_value("qwen") == "qwen"


def test_no_child_suffix_is_the_tail_of_another_so_llmservices_and_llmgateways_never_share_a_child_name():
    suffixes = [names.BACKEND, names.GATEWAY, names.SCALER, names.AGGREGATOR, names.SCALER_TOKEN, names.CACHE,
                names.SHARED_GATEWAY, names.SHARED_SCALER, names.SHARED_AGGREGATOR, names.SHARED_TOKEN,
                names.SHARED_ROUTES]
    for a in suffixes:
        for b in suffixes:
            assert a == b or not f"-{a}".endswith(f"-{b}"), (a, b)
    assert names.shared_gateway("chat") == "chat-llmgw" and names.shared_scaler("chat") == "chat-llmgwscaler"
