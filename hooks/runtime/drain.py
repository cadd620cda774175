"""The serving container's preStop hook: wait for in-flight requests, not for the clock.

On scale-in (and on every scale to zero) the Pod leaves the Service at once, and the preStop hook
keeps the engine alive for the requests it is still answering; SIGTERM follows when it returns. A
fixed sleep holds the accelerator for the whole drain timeout even when nothing is in flight, so the
hook asks the engine instead: it polls the engine's own load gauges (the runtime's
``metrics.inFlightMetric`` and ``waitingMetric``) over localhost and returns as soon as their sum is
0, bounded by ``lifecycle.drainTimeout``.

The program is POSIX sh run in the engine's image, which brings no Noctaya code: it fetches with
whichever of curl, wget or python3 the image has (vLLM and SGLang images have python3, llama.cpp's
server image curl). With none of them it sleeps the whole timeout, as before. A failed fetch is
retried every second within the budget; only an engine that has answered nothing for
``UNANSWERED_SECONDS`` in a row has nothing left to wait for (an answer showing 0 in flight still
ends the wait at once). Runtimes without the gauges, or with
``lifecycle.drainWait: Sleep`` (images without sh), keep the kubelet's `sleep` action.

The program is part of every backend's Pod template, so editing one byte of it would restart every
backend that takes the new template. Released programs are therefore never edited: a change is a new
entry in ``PROGRAMS`` (and ``CURRENT`` moves to it), tests/hooks/test_drain.py pins the digest of each
released one, and a warm backend keeps the program it runs until it is next at zero
(hooks/controller/rollout.py).
"""

from __future__ import annotations

import re
from typing import Any

from hooks.api.runtime import InferenceRuntime

# How long the engine may go unanswered (every fetch failing: refused, timed out, an HTTP error)
# before the hook stops waiting for it. One failed fetch is not a dead engine: a busy engine's
# event loop can miss the 2 s fetch timeout, and its metrics endpoint can answer 5xx or refuse for
# a moment. Ten seconds is at least three full attempts (a timed-out round takes 2 s + the 1 s
# pause) and still short beside the drain budget (drainTimeout, 2 m by default),
# so an engine that really died holds its accelerator for ~10 s more, never the whole budget.
UNANSWERED_SECONDS = 10

# $1 port, $2 metrics path, $3 limit in seconds, $4 space-separated gauge names, $5 seconds of
# consecutive failed fetches after which the engine counts as gone.
# Version 2 (Noctaya 0.1.0, cac6700); version 1 (e304259) stopped at the first failed fetch.
WAIT_FOR_IDLE_V2 = r"""
port=$1 path=$2 limit=$3 gauges=$4 unanswered=$5
url="http://127.0.0.1:$port$path"
if command -v curl >/dev/null 2>&1; then fetch() { curl -fsS --max-time 2 "$url"; }
elif command -v wget >/dev/null 2>&1; then
  # GNU wget retries a dropped connection 20 times with back-off (minutes): one try only. BusyBox
  # wget does not retry, and may not know -t.
  case $(wget --version 2>/dev/null) in *"GNU Wget"*) once="-t 1" ;; *) once= ;; esac
  fetch() { wget -q -T 2 $once -O - "$url"; }
elif command -v python3 >/dev/null 2>&1; then
  fetch() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode())' "$url"; }
else echo "noctaya drain: no curl, wget or python3; waiting ${limit}s"; sleep "$limit"; exit 0; fi
# Waited at least $waited s (one sleep per round), and date's whole seconds cap slow rounds.
# failing_since: date of the first failed fetch since the last answer ("" while it answers); a
# streak ends the wait once its date span exceeds $unanswered, i.e. after more than that many
# real seconds without an answer.
start=$(date +%s) waited=0 failing_since=
while :; do
  if out=$(fetch); then
    [ -n "$failing_since" ] && echo "noctaya drain: engine answering again"
    failing_since=
    busy=$(printf '%s\n' "$out" | awk -v gauges="$gauges" '
      BEGIN { n = split(gauges, g, " ") }
      /^#/ { next }
      { name = $0; sub(/[{ \t].*$/, "", name)
        for (i = 1; i <= n; i++) if (name == g[i]) {
          rest = $0; sub(/^[^{ \t]*(\{[^}]*\})?[ \t]+/, "", rest); split(rest, v, /[ \t]+/); total += v[1] } }
      END { print (total > 0) ? 1 : 0 }')
    [ "$busy" = 0 ] && { echo "noctaya drain: nothing in flight; stopping"; exit 0; }
    state="still busy"
  else
    now=$(date +%s)
    if [ -z "$failing_since" ]; then
      failing_since=$now; echo "noctaya drain: metrics fetch failed; retrying for up to ${unanswered}s"
    elif [ $(( now - failing_since )) -gt "$unanswered" ]; then
      echo "noctaya drain: engine not answering for ${unanswered}s; stopping"; exit 0
    fi
    state="engine not answering"
  fi
  if [ "$waited" -ge "$limit" ] || [ $(( $(date +%s) - start )) -gt "$limit" ]; then
    echo "noctaya drain: $state after ${limit}s; stopping"; exit 0
  fi
  sleep 1; waited=$(( waited + 1 ))
done
""".strip()

# Released drain programs by version: never edit one (see the module doc); add the next instead.
PROGRAMS: dict[int, str] = {2: WAIT_FOR_IDLE_V2}
CURRENT = 2
WAIT_FOR_IDLE = PROGRAMS[CURRENT]

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def load_gauges(runtime: InferenceRuntime) -> list[str]:
    """The engine gauges whose sum is its in-flight work (empty when the runtime names none)."""
    metrics = runtime.spec.metrics
    if metrics is None:
        return []
    names = [m for m in (metrics.in_flight_metric, metrics.waiting_metric) if m]
    return names if all(_METRIC_NAME.match(m) for m in names) else []


def pre_stop(runtime: InferenceRuntime) -> dict[str, Any] | None:
    """The serving container's preStop handler, or None when the runtime drains for 0 seconds."""
    spec = runtime.spec
    limit = spec.lifecycle.drain_seconds
    if limit <= 0:
        return None
    gauges = load_gauges(runtime)
    if spec.lifecycle.drain_wait == "Sleep" or not gauges:
        # The `sleep` action needs nothing in the image (GA since Kubernetes 1.34, on since 1.30).
        return {"sleep": {"seconds": limit}}
    port = spec.metrics.port if spec.metrics is not None and spec.metrics.port is not None else spec.port
    path = spec.metrics.path if spec.metrics is not None else "/metrics"
    return {"exec": {"command": ["sh", "-c", WAIT_FOR_IDLE, "noctaya-drain", str(port), path, str(limit),
                                 " ".join(gauges), str(UNANSWERED_SECONDS)]}}
