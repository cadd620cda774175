"""The kubelet's $(VAR) expansion and env resolution as tests/engines/container.py plays them
(Kubernetes' rules: k8s.io/kubernetes third_party/forked/golang/expansion)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.container import Sandbox, command_of, expand, resolve_env

ENV = {"A": "one", "PATH_VAR": "/cache/m", "EMPTY": ""}


@pytest.mark.parametrize(("text", "expanded"), [
    ("$(A)", "one"),
    ("x-$(A)-$(A)", "x-one-one"),
    ("$(PATH_VAR)/$(A).gguf", "/cache/m/one.gguf"),
    ("$(EMPTY)", ""),
    ("$(UNDEFINED)", "$(UNDEFINED)"),  # left as written
    ("$$(A)", "$(A)"),  # escaped
    ("$$$(A)", "$one"),
    ("$", "$"),
    ("a$b", "a$b"),
    ("$(A", "$(A"),  # unterminated
    ("$(not valid)", "$(not valid)"),
])
def test_expand_follows_the_kubelets_rules(text: str, expanded: str) -> None:
    assert expand(text, ENV) == expanded


def test_env_resolves_in_order_from_values_secrets_and_fields() -> None:
    container = {"env": [
        {"name": "LATER_REF", "value": "$(B)"},  # B is defined after it: not expanded
        {"name": "B", "value": "b"},
        {"name": "C", "value": "$(B)-c"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]}
    env = resolve_env(container, {("s", "token"): "t0ken"}, {"metadata.name": "p-1"})
    assert env == {"LATER_REF": "$(B)", "B": "b", "C": "b-c", "TOKEN": "t0ken", "POD": "p-1"}


def test_a_command_is_localised_to_the_sandbox(tmp_path: Path) -> None:
    container = {
        "name": "engine", "command": ["/app/server"],
        "args": ["--model", "$(MODEL)", "--host", "0.0.0.0", "--port", "$(PORT)", "$$(KEPT)"],
        "env": [{"name": "MODEL", "value": "/cache/m/x.gguf"}, {"name": "PORT", "value": "8080"}],
        "volumeMounts": [{"name": "model-cache", "mountPath": "/cache"}],
    }
    sandbox = Sandbox(address="127.77.1.2", volumes={"model-cache": tmp_path}, programs={"/app/server": "/bin/true"})
    command = command_of(container, sandbox)
    assert command.argv == ["/bin/true", "--model", f"{tmp_path}/m/x.gguf", "--host", "127.77.1.2", "--port", "8080",
                            "$(KEPT)"]
    assert command.env["MODEL"] == f"{tmp_path}/m/x.gguf"


def test_in_a_network_namespace_the_args_run_unchanged_inside_it(tmp_path: Path) -> None:
    # With a namespace of its own the Pod's 0.0.0.0 and 127.0.0.1 mean what they say (a runtime that
    # binds 127.0.0.1 is unreachable, as in a cluster); every process of the Pod runs inside it.
    container = {
        "name": "engine", "command": ["/app/server"], "args": ["--host", "127.0.0.1", "--peer", "localhost:1"],
        "env": [{"name": "BIND", "value": "0.0.0.0"}],
    }
    sandbox = Sandbox(address="10.245.0.7", volumes={}, programs={"/app/server": "/bin/true"},
                      netns=["ip", "netns", "exec", "pod-ns"])
    command = command_of(container, sandbox)
    assert command.argv == ["ip", "netns", "exec", "pod-ns", "/bin/true", "--host", "127.0.0.1", "--peer", "localhost:1"]
    assert command.env["BIND"] == "0.0.0.0"
    pre_stop = command_of(container, sandbox, ["sh", "-c", "curl http://127.0.0.1:8080/metrics"])
    assert pre_stop.argv == ["ip", "netns", "exec", "pod-ns", "sh", "-c", "curl http://127.0.0.1:8080/metrics"]
