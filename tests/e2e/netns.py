"""Pod addresses for the lifecycle suite: the harness's own network plumbing, so that every Pod the
harness plays has a non-loopback Pod IP that reaches the process playing that Pod.

Kubernetes rejects loopback addresses in EndpointSlices, and the EndpointSlice controller publishes
whatever a Pod's ``status.podIP`` says; a component that balances over a Service's Pods (dialling
each Pod's IP, as the gateway of issue 41 does) needs those IPs to answer. Two facilities:

- ``add_address(ip)``: an address in the root network namespace, on a veth pair of the harness's own
  (this kernel has no ``dummy`` module). A stand-in that binds one address (FakeBackend) serves on
  it; any local process, even one bound to a 127.x address, reaches it.
- ``add_pod(ip)``: a network namespace per Pod, for real containers that must run their rendered args
  unchanged: an engine told ``--host 0.0.0.0`` is reachable at its Pod IP and one told
  ``--host 127.0.0.1`` is not, as in a cluster. The namespace's ``eth0`` (a veth) holds the Pod IP
  as a /32; the root namespace routes that /32 to the veth's other end, and the namespace sends
  everything to a static neighbour (169.254.1.1, Calico's trick) that is that other end: proxy ARP
  would need ip_forward, which is off, and is not changed. ``exec_prefix`` runs a process inside.

  Two additions beyond the plain recipe, both on the harness's own interfaces and inside its own
  namespaces only: ``route_localnet`` on both ends, and in the namespace a policy rule that sends
  127.0.0.0/8 except 127.0.0.1 out of eth0. So a client bound to one of the suite's private loopback
  addresses (127.77.x.y) reaches a Pod, and a Pod reaches the suite's own servers on those addresses
  (the stand-in hub a prewarm Job downloads from), while the Pod's 127.0.0.1 stays its own.
  Pod-to-Pod traffic is not routed (it would need forwarding in the root namespace).

An address of the range that nothing plays any more (a deleted Pod's) is unreachable at once, as
the harness adds an ``unreachable`` route for the whole range (more specific routes and local
addresses win over it): a connection to it fails fast instead of leaving by the machine's default
route.

Everything carries its ``Network``'s prefix (``nce`` + the pid in base 36 + an instance letter;
namespaces are named ``nce-<pid>-<start time>-<instance>-<n>``, interfaces carry
``noctaya-e2e <pid> <start time>`` as their alias, names being limited to 15 characters; the
unreachable route's metric is ``METRIC_BASE`` + 36 × pid + instance)
and is removed by ``close``; at ``open`` the leftovers of a run whose process is gone (same prefix,
another pid, or the pid now naming another process) are removed. The machine's own interfaces,
routes and sysctls are never touched. Addresses come from ``POD_RANGE`` (10.245.0.0/16 unless
NOCTAYA_E2E_POD_RANGE says otherwise; kwok assigns 10.244.0.0/16 and nothing listens there), one
after another, each checked free on the machine under a lock shared by every run, so two suites
side by side never take the same one.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

POD_RANGE = os.environ.get("NOCTAYA_E2E_POD_RANGE", "10.245.0.0/16")
PREFIX = "nce"  # every interface and namespace of the harness starts with it
ALIAS = "noctaya-e2e"  # an interface's alias: "noctaya-e2e <owner pid> <owner start time>"
GATEWAY = "169.254.1.1"  # the link-local next hop every Pod namespace routes through
LOCALNET_TABLE = "100"  # in a Pod's namespace: 127.0.0.0/8 (but 127.0.0.1) leaves through eth0
IFNAMSIZ = 15
METRIC_BASE = 1 << 30  # the unreachable route's metric: METRIC_BASE + 36 * pid + instance (below 2**31)
MAX_PODS = 36 ** 5 - 1  # a Pod link: nce<pid36 ≤ 5><instance>p<serial36 ≤ 5> fits IFNAMSIZ
LOCK_FILE = Path(tempfile.gettempdir()) / "noctaya-e2e-netns.lock"
_INSTANCES = itertools.count()


class NetworkUnavailable(Exception):
    """A skip reason: the harness cannot make Pod addresses here."""


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks after boot), None once it is gone (tests/e2e/cluster.py has
    the same; not imported: this module must not need the cluster's imports)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(pid: int, start: str) -> bool:
    return _start_time(pid) == start


@dataclass
class PodNetwork:
    """One Pod's network namespace: ``namespace`` (for ``ip netns exec``), its ``ip`` on eth0, and
    ``host_link``, the root namespace's end of its veth."""

    namespace: str
    ip: str
    host_link: str


class Network:
    """The plumbing of one process (see the module doc). ``open`` it once; ``close`` removes it all."""

    def __init__(self, pod_range: str = POD_RANGE) -> None:
        self.pod_range = ipaddress.ip_network(pod_range)
        self.pid = os.getpid()
        self.start = _start_time(self.pid) or "0"
        serial = next(_INSTANCES) % 36  # several in one process (tests/e2e/test_netns.py)
        instance = _base36(serial)
        self.metric = str(METRIC_BASE + 36 * self.pid + serial)
        self.prefix = f"{PREFIX}{_base36(self.pid)}{instance}"  # interfaces: nce<pid36><instance><kind><n36>
        self.ns_prefix = f"{PREFIX}-{self.pid}-{self.start}-{instance}-"  # namespaces
        self.address_link = f"{self.prefix}a"  # holds add_address's addresses (its peer: <prefix>b)
        self.host_address = ""  # the root namespace's source address towards Pod namespaces
        self.addresses: set[str] = set()
        self.pods: dict[str, PodNetwork] = {}  # by namespace
        self._hosts = self.pod_range.hosts()
        self._serial = 0
        self._lock = threading.Lock()
        self._opened = False
        self.ip = shutil.which("ip") or "ip"

    # --- life -------------------------------------------------------------------------------------

    def open(self) -> Network:
        """Check the machine allows it (NetworkUnavailable with the reason otherwise), remove stale
        leftovers of crashed runs, make the address link and the root namespace's own address."""
        if self._opened:
            return self
        self._check_possible()
        self.remove_stale()
        self._check_range()
        with self._machine_lock():
            self._make_address_link()
            self.host_address = self._allocate_locked()
            self._run("addr", "add", f"{self.host_address}/32", "dev", self.address_link)
            self.addresses.add(self.host_address)
            self._run("route", "add", "unreachable", str(self.pod_range), "metric", self.metric)
        self._opened = True
        atexit.register(self.close)  # a run that ends without its fixture's teardown still cleans up
        return self

    def _check_possible(self) -> None:
        if os.geteuid() != 0:
            raise NetworkUnavailable("Pod network namespaces and addresses need root (the harness runs `ip netns`)")
        if shutil.which("ip") is None:
            raise NetworkUnavailable("`ip` (iproute2) not found: needed for the Pods' network namespaces")
        if len(f"{self.prefix}p{_base36(MAX_PODS)}") > IFNAMSIZ:
            raise NetworkUnavailable(f"pid {self.pid} too large for the harness's interface names")
        probe = f"{self.ns_prefix}probe"
        made = subprocess.run([self.ip, "netns", "add", probe], capture_output=True, text=True, check=False)
        if made.returncode != 0:
            raise NetworkUnavailable(f"`ip netns add` is not permitted here: {made.stderr.strip()}")
        subprocess.run([self.ip, "netns", "delete", probe], capture_output=True, check=False)

    def _check_range(self) -> None:
        """The range must be nobody else's here: an address of it on this machine would hide a host
        of the machine's own network."""
        for route in self._out("-4", "route", "show", "table", "main").splitlines():
            dest = route.split()[0]
            if dest == "default":
                continue
            try:
                overlaps = ipaddress.ip_network(dest, strict=False).overlaps(self.pod_range)
            except ValueError:
                continue
            if overlaps and not self._harness_route(route):
                raise NetworkUnavailable(f"{self.pod_range} is routed on this machine ({route.strip()}); "
                                         "set NOCTAYA_E2E_POD_RANGE to a free range")

    @staticmethod
    def _harness_route(route: str) -> bool:
        words = route.split()
        dev = words[words.index("dev") + 1] if "dev" in words else ""
        return dev.startswith(PREFIX)

    def close(self) -> None:
        """Remove every namespace, interface and address this process made (idempotent)."""
        if not self._opened:
            return
        for pod in list(self.pods.values()):
            self.remove_pod(pod)
        self._run("link", "delete", self.address_link, check=False)
        self._run("route", "delete", "unreachable", str(self.pod_range), "metric", self.metric, check=False)
        self.addresses.clear()
        self._opened = False

    def leftovers(self) -> list[str]:
        """What of this process's plumbing still exists (namespaces, interfaces): empty after close."""
        found = [ns for ns in self._namespaces() if ns.startswith(self.ns_prefix)]
        found += [link for link, _alias in self._links() if link.startswith(self.prefix)]
        return found + [f"unreachable {dest} metric {metric}" for dest, metric in self._unreachable()
                        if metric == self.metric]

    def remove_stale(self) -> list[str]:
        """Remove the namespaces and interfaces of runs whose process is gone; what was removed."""
        removed = []
        for ns in self._namespaces():
            owner = ns.removeprefix(f"{PREFIX}-").split("-")
            if (ns.startswith(f"{PREFIX}-") and len(owner) >= 3 and owner[0].isdigit()
                    and not _owner_alive(int(owner[0]), owner[1])):
                self._run("netns", "delete", ns, check=False)
                removed.append(ns)
        for link, alias in self._links():
            owner = alias.split()
            if (link.startswith(PREFIX) and len(owner) == 3 and owner[0] == ALIAS and owner[1].isdigit()
                    and not _owner_alive(int(owner[1]), owner[2])):
                self._run("link", "delete", link, check=False)
                removed.append(link)
        for dest, metric in self._unreachable():
            owner = (int(metric) - METRIC_BASE) // 36
            if int(metric) >= METRIC_BASE and owner != self.pid and _start_time(owner) is None:
                self._run("route", "delete", "unreachable", dest, "metric", metric, check=False)
                removed.append(f"unreachable {dest} metric {metric}")
        return removed

    def _unreachable(self) -> list[tuple[str, str]]:
        """(destination, metric) of the machine's unreachable routes with a metric (the harness's
        carry its owner in it)."""
        found = []
        for line in self._out("-4", "route", "show", "type", "unreachable", check=False).splitlines():
            words = line.split()
            if "metric" in words and words[0] == "unreachable":
                found.append((words[1], words[words.index("metric") + 1]))
        return found

    # --- addresses in the root namespace -----------------------------------------------------------

    def allocate(self) -> str:
        """The next address of the range free on this machine (not plumbed: ``add_address`` or
        ``add_pod`` it; an address only reported, never served, may stay unplumbed)."""
        with self._machine_lock():
            return self._allocate_locked()

    def add_address(self, ip: str | None = None) -> str:
        """``ip`` (or the next free address) on the harness's address link: local to this machine."""
        with self._machine_lock():
            ip = ip or self._allocate_locked()
            self._run("addr", "add", f"{ip}/32", "dev", self.address_link)
        self.addresses.add(ip)
        return ip

    def remove_address(self, ip: str) -> None:
        self._run("addr", "delete", f"{ip}/32", "dev", self.address_link, check=False)
        self.addresses.discard(ip)

    # --- a network namespace per Pod ----------------------------------------------------------------

    def add_pod(self, ip: str | None = None) -> PodNetwork:
        """A network namespace whose eth0 has ``ip`` (or the next free address), routed from the root
        namespace (see the module doc)."""
        with self._lock:
            self._serial += 1
            serial = self._serial
        pod = PodNetwork(f"{self.ns_prefix}{serial}", "", f"{self.prefix}p{_base36(serial)}")
        self.pods[pod.namespace] = pod
        with self._machine_lock():
            pod.ip = ip or self._allocate_locked()
            try:
                self._plumb(pod)
            except RuntimeError:
                self.remove_pod(pod)
                raise
        return pod

    def _plumb(self, pod: PodNetwork) -> None:
        ns, ip, host = pod.namespace, pod.ip, pod.host_link
        self._run("netns", "add", ns)
        self._run("link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._run("link", "set", "dev", host, "alias", self._alias())
        self._run("-n", ns, "addr", "add", f"{ip}/32", "dev", "eth0")
        self._run("-n", ns, "link", "set", "eth0", "up")
        self._run("-n", ns, "link", "set", "lo", "up")
        self._run("link", "set", host, "up")
        self._run("route", "add", f"{ip}/32", "dev", host, "src", self.host_address)
        self._run("-n", ns, "route", "add", GATEWAY, "dev", "eth0")
        self._run("-n", ns, "route", "add", "default", "via", GATEWAY, "dev", "eth0")
        mac = Path(f"/sys/class/net/{host}/address").read_text().strip()
        self._run("-n", ns, "neigh", "replace", GATEWAY, "lladdr", mac, "dev", "eth0", "nud", "permanent")
        # The suite's private loopback addresses across the link, both ways (module doc): the kernel
        # refuses a loopback source or destination on a non-loopback device without route_localnet.
        Path(f"/proc/sys/net/ipv4/conf/{host}/route_localnet").write_text("1")
        subprocess.run([self.ip, "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.eth0.route_localnet=1"],
                       check=True, capture_output=True)
        self._run("-n", ns, "route", "add", "127.0.0.0/8", "via", GATEWAY, "dev", "eth0", "table", LOCALNET_TABLE)
        self._run("-n", ns, "rule", "add", "pref", "5", "to", "127.0.0.1/32", "lookup", "local")
        self._run("-n", ns, "rule", "add", "pref", "10", "to", "127.0.0.0/8", "iif", "lo", "lookup", LOCALNET_TABLE)
        self._run("-n", ns, "rule", "add", "pref", "20", "lookup", "local")
        self._run("-n", ns, "rule", "delete", "pref", "0")

    def remove_pod(self, pod: PodNetwork) -> None:
        """The namespace and its link gone. A process still inside keeps a namespace alive after its
        name is deleted, so any left (all started by this harness inside it) are killed first."""
        for pid in self._out("netns", "pids", pod.namespace, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        self._run("netns", "delete", pod.namespace, check=False)
        self._run("link", "delete", pod.host_link, check=False)
        self.pods.pop(pod.namespace, None)

    def exec_prefix(self, pod: PodNetwork | str) -> list[str]:
        """The words that run a command inside the Pod's namespace."""
        return [self.ip, "netns", "exec", pod if isinstance(pod, str) else pod.namespace]

    # --- helpers -------------------------------------------------------------------------------------

    def _alias(self) -> str:
        return f"{ALIAS} {self.pid} {self.start}"

    def _make_address_link(self) -> None:
        peer = f"{self.prefix}b"
        self._run("link", "add", self.address_link, "type", "veth", "peer", "name", peer)
        for link in (self.address_link, peer):
            self._run("link", "set", "dev", link, "alias", self._alias())
            self._run("link", "set", link, "up")

    def _allocate_locked(self) -> str:
        """The next address of the range that nothing on the machine holds (an address or a /32
        route); the caller holds the machine lock until it is plumbed."""
        taken = self._taken()
        for host in self._hosts:
            ip = str(host)
            if ip not in taken and not ip.endswith((".0", ".255")):
                return ip
        raise NetworkUnavailable(f"no free address left in {self.pod_range}")

    def _taken(self) -> set[str]:
        taken = {line.split()[3].split("/")[0] for line in self._out("-o", "-4", "addr", "show").splitlines()
                 if len(line.split()) > 3}
        taken |= {line.split()[0].split("/")[0] for line in self._out("-4", "route", "show").splitlines() if line}
        return taken

    @staticmethod
    @contextmanager
    def _machine_lock() -> Iterator[None]:
        """An exclusive flock for a ``with`` block: one allocation at a time on the machine, across
        the suites that run side by side (tests/e2e/run.py)."""
        with open(LOCK_FILE, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield  # the lock ends with the file

    def _namespaces(self) -> list[str]:
        return [line.split()[0] for line in self._out("netns", "list", check=False).splitlines() if line.strip()]

    def _links(self) -> Iterator[tuple[str, str]]:
        """(name, alias) of every interface of the root namespace whose name has the harness's prefix."""
        for path in Path("/sys/class/net").iterdir():
            if path.name.startswith(PREFIX):
                try:
                    alias = (path / "ifalias").read_text().strip()
                except OSError:
                    alias = ""
                yield path.name, alias

    def _run(self, *args: str, check: bool = True) -> None:
        done = subprocess.run([self.ip, *args], capture_output=True, text=True, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")

    def _out(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([self.ip, *args], capture_output=True, text=True, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
        return done.stdout

