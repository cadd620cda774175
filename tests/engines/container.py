"""A rendered Pod's container run on this machine the way the kubelet starts it (there is no container
runtime here): its command and args with ``$(VAR)`` expanded as the kubelet expands them, its env
resolved in order, its volumes mapped to local directories, its image's program replaced by a local
build of the same program. Its network: with ``Sandbox.netns`` the Pod's own network namespace
(tests/e2e/netns.py), where every process of the Pod (containers, preStop hooks) runs through
``ip netns exec`` with its args unchanged, so an engine told ``--host 127.0.0.1`` is unreachable at
its Pod IP as in a cluster; without one (tests/engines' own tests, which need no root) a private
loopback address plays the namespace, and the container's ``0.0.0.0``, ``127.0.0.1`` and
``localhost`` are rewritten to that address. Stopping it is what the kubelet
does when the Pod goes away: the preStop exec hook, then SIGTERM, then SIGKILL at the end of the
termination grace period, which counts from the start of the preStop hook.

What runs is the rendered container, so a wrong argument in a runtime fails here as in a cluster.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, an undefined reference is left
    as written, ``$$`` is one ``$`` (so ``$$(VAR)`` is the literal ``$(VAR)``), any other ``$`` stays."""
    out: list[str] = []
    i = 0
    while i < len(value):
        if value[i] != "$" or i + 1 == len(value):
            out.append(value[i])
            i += 1
            continue
        nxt = value[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
            continue
        if nxt == "(":
            close = value.find(")", i + 2)
            name = value[i + 2:close] if close != -1 else ""
            if close != -1 and _NAME.fullmatch(name):
                out.append(env[name] if name in env else value[i:close + 1])
                i = close + 1
                continue
        out.append("$")
        i += 1
    return "".join(out)


def resolve_env(container: dict[str, Any], secrets: Mapping[tuple[str, str], str],
                fields: Mapping[str, str]) -> dict[str, str]:
    """The container's env as the kubelet resolves it: in order, each value expanded with the
    variables defined before it; ``secretKeyRef`` from ``secrets[(name, key)]``, ``fieldRef`` from
    ``fields`` (e.g. metadata.name, status.podIP)."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        source = var.get("valueFrom") or {}
        if not source:  # a value (an empty one is omitted from the object)
            env[var["name"]] = expand(var.get("value", ""), env)
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = secrets[(ref["name"], ref["key"])]
        elif "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        else:
            raise ValueError(f"env {var['name']}: only value, secretKeyRef and fieldRef are played here")
    return env


@dataclass
class Sandbox:
    """What stands in for the Pod's sandbox: the local directory of each volume, the local program of
    each image path, the Pod's address and, when it has one, its network namespace."""

    address: str
    volumes: dict[str, Path]  # volume name -> local directory
    programs: dict[str, str]  # a path inside the image -> the local program
    secrets: dict[tuple[str, str], str] = field(default_factory=dict)  # (Secret, key) -> value
    fields: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None  # the image's WORKDIR
    netns: list[str] | None = None  # the words that run a command in the Pod's network namespace

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` as started inside the Pod's network namespace (unchanged without one)."""
        return [*self.netns, *argv] if self.netns else list(argv)

    def mounts(self, container: dict[str, Any]) -> dict[str, Path]:
        """Mount path -> local directory for the volumes the container mounts (subPath included)."""
        out = {}
        for mount in container.get("volumeMounts") or []:
            local = self.volumes.get(mount["name"])
            if local is not None:
                out[mount["mountPath"]] = local / mount["subPath"] if mount.get("subPath") else local
        return out

    def localise(self, value: str, mounts: Mapping[str, Path]) -> str:
        """A path under a mount → the local directory; an image's program → the local one; without a
        network namespace, the Pod's own addresses → its address (in one, they mean what they say)."""
        if value in self.programs:
            return self.programs[value]
        for mount_path in sorted(mounts, key=len, reverse=True):
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(mounts[mount_path]) + value[len(mount_path):]
        if self.netns:
            return value
        return value.replace("0.0.0.0", self.address).replace("127.0.0.1", self.address).replace(
            "localhost", self.address)


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str]


def command_of(container: dict[str, Any], sandbox: Sandbox, argv: list[str] | None = None) -> Command:
    """The process the kubelet would start for ``container`` (or for ``argv``, e.g. its preStop exec
    command, in the container's env), localised to the sandbox and inside its network namespace."""
    if argv is None and not container.get("command"):
        raise ValueError(f"container {container.get('name')}: no command (the image's entrypoint is not known here)")
    env = resolve_env(container, sandbox.secrets, sandbox.fields)
    mounts = sandbox.mounts(container)
    words = argv if argv is not None else [*container["command"], *(container.get("args") or [])]
    local_env = {k: sandbox.localise(v, mounts) for k, v in env.items()}
    local_env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
    return Command(sandbox.wrap([sandbox.localise(expand(w, env), mounts) for w in words]), local_env)


def run_to_completion(container: dict[str, Any], sandbox: Sandbox, timeout: float) -> subprocess.CompletedProcess[str]:
    """An init container or a Job's container: run until it exits (the caller checks the code)."""
    command = command_of(container, sandbox)
    return subprocess.run(command.argv, env=command.env, cwd=sandbox.cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


class LocalContainer:
    """One container's process; ``stop`` plays the kubelet's termination (see the module doc)."""

    def __init__(self, container: dict[str, Any], sandbox: Sandbox, log: Path, grace_seconds: float = 30.0) -> None:
        self.container = container
        self.sandbox = sandbox
        self.command = command_of(container, sandbox)
        self.log = log
        self.grace_seconds = grace_seconds
        self.proc: subprocess.Popen[bytes] | None = None
        self.pre_stop_seconds: float | None = None  # how long the preStop hook ran
        self.pre_stop_output = ""
        self.exit_code: int | None = None
        self.killed = False

    def start(self) -> LocalContainer:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.command.argv, env=self.command.env, cwd=self.sandbox.cwd, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        """preStop (exec), SIGTERM, SIGKILL at the end of the grace period; the exit code."""
        if self.proc is None:
            return None
        started = time.monotonic()
        hook = ((self.container.get("lifecycle") or {}).get("preStop") or {}).get("exec")
        if hook and self.running():
            pre = command_of(self.container, self.sandbox, hook["command"])
            try:
                done = subprocess.run(pre.argv, env=pre.env, cwd=self.sandbox.cwd, capture_output=True, text=True,
                                      timeout=max(1.0, self.grace_seconds))
                self.pre_stop_output = done.stdout + done.stderr
            except subprocess.TimeoutExpired:
                self.pre_stop_output = "preStop hook still running at the end of the grace period"
            self.pre_stop_seconds = time.monotonic() - started
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(max(0.1, self.grace_seconds - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            self.killed = True
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.exit_code = self.proc.wait()
        return self.exit_code
