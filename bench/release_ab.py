"""Against the release before (issue 38, "Must show 3"): this tree's gateway beside the baseline
tree's (``--baseline REF``, default f8cf21f, main before issue 38, extracted with ``git archive``),
every figure from the same run, so a host that is slower today is slower for both.

1. Warm path: bench.gateway_bench's set-up (the gateway on core 0, wrk -t1 -c32 POST and a static
   nginx backend on core 1). Three gateways alive together, baseline / control (a second baseline
   process) / new, in interleaved rounds whose order rotates; the medians of per-round ratios to the
   baseline of throughput and of CPU per request (the gateway's process tree). The control's ratios
   are the host's noise floor: two identical processes differ by that much here.
2. Held streams: N held cold SSE streams (the backend scaled to zero) on each gateway in turn
   (bench.gateway_bench.held_connections): the worker's RSS growth per held connection.
3. Idle CPU of one gateway Pod: each runs as the rendered gateway Deployment runs it
   (bench.idle_footprint.GatewayPod: the hooks' env, the container's cgroup, one worker, the scaler in
   ``local`` mode), the three side by side in one window in which nothing talks to them; CPU seconds
   (utime + stime from /proc) of each whole process tree per second. The new gateway has an extra OS
   thread (admin port + in-process scaler on their own gevent hub): this shows what it costs idle.

Targets: throughput >= 0.95x the baseline's at CPU per request <= 1.05x; KiB per held connection
<= 1.05x; idle CPU <= the baseline's + IDLE_ALLOWANCE_MS_PER_S + one clock tick over the window.

Run: .venv/bin/python -m bench.release_ab [--baseline REF] [--quick] [--held N] [--idle-seconds S]
(about 3 min on 2 CPUs; ``--quick`` about 1.5). Exit status 1 when a target is missed.

Needs Debian's nginx and wrk (`apt-get install -y nginx wrk`), taskset and two cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench.gateway_bench import CPU0, CPU1, Gateway, StealMeter, free_port, held_connections, open_loop, wrk
from bench.gateway_nginx import Nginx, find_nginx
from bench.idle_footprint import SETTLE_SECONDS, TICK, GatewayPod, Window, rendered
from bench.replicas import ROOT, baseline_tree, load_text, per_round_ratio, rotate, tree_fingerprint, working_tree

DEFAULT_BASELINE = "f8cf21f"  # main before issue 38: "today's" in the issue
# Every variant is one of the two trees; "control" is the baseline tree again, a second process.
VARIANTS = ("baseline", "control", "new")
LABELS = {"baseline": "baseline gateway", "control": "baseline, a second process (noise floor)",
          "new": "new gateway (this tree)"}
# name -> (target, True when higher is better)
RATIO_TARGETS = {
    "warm_throughput_x_baseline": (0.95, True),
    "warm_cpu_per_request_x_baseline": (1.05, False),
    "held_kib_per_connection_x_baseline": (1.05, False),
}
# Idle CPU may exceed the baseline's by this much and still be "not above" it: bench.idle_footprint's
# floor under which two idle figures are the same (CPU_NOISE_MS_PER_S), to which the check adds one
# clock tick over the window, the finest step utime + stime can take (10 ms / 30 s = 0.33 ms/s).
IDLE_ALLOWANCE_MS_PER_S = 0.2


def tree_of(variant: str, baseline: Path) -> Path:
    return ROOT if variant == "new" else baseline


# -- 1. warm path ----------------------------------------------------------------------------------------

def warm_path(nginx_bin: str, baseline: Path, seconds: int, rounds: int) -> dict:
    """bench.replicas' warm path with the three variants of this A/B (its own is wired to issue 41's)."""
    static_port = free_port()
    static = Nginx(nginx_bin, static_port, cpu=int(CPU1))
    gateways: dict[str, Gateway] = {}
    try:
        for variant in VARIANTS:
            gateways[variant] = Gateway(f"http://127.0.0.1:{static_port}", cpus=CPU0, root=tree_of(variant, baseline))
        for gw in gateways.values():  # the first request is cold (readiness unknown at start): not measured
            open_loop(gw.port, 100, 1.0)
        runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
        load = [load_text()]
        steal = StealMeter()
        for turn in range(rounds):  # interleaved and rotated: a burst elsewhere, or a slot, hits all alike
            for variant in rotate(VARIANTS, turn):
                runs[variant].append(wrk(gateways[variant].port, seconds, 32, gateways[variant].proc.pid))
        load.append(load_text())
        return {"runs": runs, "steal": steal.percent(), "load": load}
    finally:
        for gw in gateways.values():
            gw.stop()
        static.stop()


# -- 2. held streams -------------------------------------------------------------------------------------

def held_streams(baseline: Path, count: int, rounds: int) -> dict:
    """One gateway at a time (``count`` held streams each need their file descriptors), order rotated."""
    runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    load = [load_text()]
    steal = StealMeter()
    for turn in range(rounds):
        for variant in rotate(VARIANTS, turn):
            runs[variant].append(held_connections(count, root=tree_of(variant, baseline)))
    load.append(load_text())
    return {"runs": runs, "steal": steal.percent(), "load": load}


# -- 3. idle CPU -----------------------------------------------------------------------------------------

def idle_cpu(baseline: Path, seconds: float) -> dict:
    """The three Pods side by side in one quiet window; per variant its tree's CPU ms per second from
    utime + stime (the target) and from the scheduler's nanosecond run time (finer, reported)."""
    container, _scaled = rendered()  # the hooks only reworded a description since the baseline: one env for both
    pods: dict[str, GatewayPod] = {}
    try:
        for variant in VARIANTS:
            pods[variant] = GatewayPod(tree_of(variant, baseline), container, variant)
        time.sleep(SETTLE_SECONDS)  # start-up work (imports, first probes of the closed backend) settles
        load = [load_text()]
        steal = StealMeter()
        window = Window({variant: pod.proc.pid for variant, pod in pods.items()}, seconds).run()
        figures = {}
        for variant, results in window.processes.items():
            figures[variant] = {
                "ticks_ms_per_s": sum(window.cpu_ms_per_s(r, precise=False) for r in results),
                "run_ms_per_s": sum(window.cpu_ms_per_s(r) for r in results),
                "wakeups_per_s": sum(window.wakeups_per_s(r) for r in results),
                "procs": len(results),
                "threads": sum(len(r.end.threads) if r.end else 0 for r in results),
            }
        load.append(load_text())
        return {"figures": figures, "elapsed": window.elapsed, "steal": steal.percent(), "load": load}
    finally:
        for pod in pods.values():
            pod.stop()


# -- report ----------------------------------------------------------------------------------------------

def report_warm(warm: dict, rounds: int, seconds: int) -> dict[str, float]:
    runs = warm["runs"]
    print(f"\n== 1. Warm path: wrk -t1 -c32 POST /v1/chat/completions, {rounds} interleaved rotated rounds of "
          f"{seconds} s; gateway on core {CPU0}, wrk + static nginx on core {CPU1}")
    out: dict[str, float] = {}
    for variant in VARIANTS:
        rps = statistics.median(r["rps"] for r in runs[variant])
        cpu = statistics.median(r["cpu_us_per_request"] for r in runs[variant])
        each = ", ".join(f"{r['rps']:.0f}" for r in runs[variant])
        line = f"  {LABELS[variant]:42s} {rps:7.0f} req/s median ({each})  CPU {cpu:6.1f} us/request"
        if variant != "baseline":
            thr, thr_each = per_round_ratio(runs, variant, "rps")
            cpu_x, _ = per_round_ratio(runs, variant, "cpu_us_per_request")
            out[f"{variant}_throughput"], out[f"{variant}_cpu"] = thr, cpu_x
            line += f"  / baseline: throughput {thr:.3f} (rounds {', '.join(f'{x:.2f}' for x in thr_each)}), CPU {cpu_x:.3f}"
        bad = sum(r["non2xx"] + r["socket_errors"] for r in runs[variant])
        print(line + (f"  non-2xx or socket errors {bad:.0f}" if bad else ""))
    print(f"  CPU steal {warm['steal']:.1f}%; {warm['load'][0]} -> {warm['load'][1]}")
    return out


def report_held(held: dict, count: int) -> dict[str, float]:
    runs = held["runs"]
    print(f"\n== 2. Held streams: {count} held cold SSE streams per gateway (backend scaled to zero), "
          "worker RSS growth per held connection")
    kib = {variant: statistics.median(r["kib_per_connection"] for r in rs) for variant, rs in runs.items()}
    out: dict[str, float] = {}
    for variant, rs in runs.items():
        each = ", ".join(f"{r['rss_before_kib']} -> {r['rss_after_kib']} KiB" for r in rs)
        line = f"  {LABELS[variant]:42s} {kib[variant]:6.2f} KiB per connection  (RSS {each})"
        if variant != "baseline":
            out[variant] = kib[variant] / kib["baseline"]
            line += f"  / baseline {out[variant]:.3f}"
        print(line)
    print(f"  CPU steal {held['steal']:.1f}%; {held['load'][0]} -> {held['load'][1]}")
    return out


def report_idle(idle: dict) -> dict[str, float]:
    figures = idle["figures"]
    tick_ms_per_s = 1000.0 / TICK / idle["elapsed"]
    print(f"\n== 3. Idle CPU of one gateway Pod (rendered env and cgroup, backend scaled to zero), the three side by "
          f"side for {idle['elapsed']:.1f} s after {SETTLE_SECONDS:.0f} s to settle, nothing talking to them; "
          f"whole process tree")
    print(f"  {'':42s} {'procs':>5} {'threads':>7} {'utime+stime ms/s':>16} {'(run time ms/s)':>15} {'wakeups/s':>9}")
    for variant in VARIANTS:
        f = figures[variant]
        print(f"  {LABELS[variant]:42s} {f['procs']:5d} {f['threads']:7d} {f['ticks_ms_per_s']:16.3f}"
              f" {f['run_ms_per_s']:15.3f} {f['wakeups_per_s']:9.1f}")
    print(f"  one clock tick over the window: {tick_ms_per_s:.3f} ms/s (utime + stime's resolution); "
          f"CPU steal {idle['steal']:.1f}%; {idle['load'][0]} -> {idle['load'][1]}")
    base = figures["baseline"]["ticks_ms_per_s"]
    return {"new": figures["new"]["ticks_ms_per_s"], "control": figures["control"]["ticks_ms_per_s"],
            "baseline": base, "limit": base + IDLE_ALLOWANCE_MS_PER_S + tick_ms_per_s}


def targets(warm: dict[str, float], held: dict[str, float], idle: dict[str, float]) -> bool:
    """Print the targets with the control's figure beside each; whether every one is met."""
    values = {
        "warm_throughput_x_baseline": (warm["new_throughput"], warm["control_throughput"]),
        "warm_cpu_per_request_x_baseline": (warm["new_cpu"], warm["control_cpu"]),
        "held_kib_per_connection_x_baseline": (held["new"], held["control"]),
    }
    print("\n== Against the release before: targets (issue 38, Must show 3)")
    met = True
    for key, (target, higher) in RATIO_TARGETS.items():
        new, control = values[key]
        ok = new >= target if higher else new <= target
        met &= ok
        print(f"  {key:38s} new {new:7.3f}  (control {control:6.3f})  target {'>=' if higher else '<='} {target:g}"
              f"  {'PASS' if ok else 'FAIL'}")
    ok = idle["new"] <= idle["limit"]
    met &= ok
    print(f"  {'idle_cpu_ms_per_s':38s} new {idle['new']:7.3f}  (control {idle['control']:6.3f})  target <= baseline "
          f"{idle['baseline']:.3f} + {idle['limit'] - idle['baseline']:.3f} = {idle['limit']:.3f}  {'PASS' if ok else 'FAIL'}")
    return met


def check_tools() -> str | None:
    """What is missing to run, or None."""
    missing = [name for name, found in (("nginx", find_nginx()), ("wrk", shutil.which("wrk")),
                                        ("taskset", shutil.which("taskset"))) if not found]
    if missing:
        return f"needs {', '.join(missing)}: apt-get install -y nginx wrk util-linux"
    if len(os.sched_getaffinity(0)) < 2:
        return "needs two cores (the gateway on one, wrk and the backend on the other)"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help=f"the baseline commit (default {DEFAULT_BASELINE})")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds; 200 held streams; a 10 s idle window")
    parser.add_argument("--held", type=int, default=None, help="held streams per gateway (default 1000; --quick 200)")
    parser.add_argument("--idle-seconds", type=float, default=None, help="the idle window (default 30; --quick 10)")
    args = parser.parse_args()
    missing = check_tools()
    if missing:
        print(f"bench.release_ab {missing}", file=sys.stderr)
        return 2
    warm_rounds, warm_seconds, held_rounds = (2, 2, 1) if args.quick else (5, 4, 2)
    count = args.held or (200 if args.quick else 1000)
    idle_seconds = args.idle_seconds or (10.0 if args.quick else 30.0)
    os.sched_setaffinity(0, {int(CPU1)})  # this process opens the held streams: off the gateways' core
    started = time.monotonic()
    baseline, commit = baseline_tree(args.baseline)
    fingerprint = tree_fingerprint(ROOT)
    print(f"baseline: {commit[:12]} ({args.baseline}); new: {working_tree()} (gateway/ fingerprint {fingerprint}); "
          f"{os.cpu_count()} CPUs; {load_text()}", flush=True)
    # Others edit this working tree while it runs: the fingerprint after each phase says which code
    # each phase's gateways ran (a gateway runs the files as they were when it started).
    seen = [fingerprint]
    try:
        warm = warm_path(find_nginx() or "nginx", baseline, warm_seconds, warm_rounds)
        seen.append(tree_fingerprint(ROOT))
        held = held_streams(baseline, count, held_rounds)
        seen.append(tree_fingerprint(ROOT))
        idle = idle_cpu(baseline, idle_seconds)
        seen.append(tree_fingerprint(ROOT))
    finally:
        shutil.rmtree(baseline, ignore_errors=True)
    if len(set(seen)) > 1:
        print(f"\nWARNING: gateway/ changed during the run: fingerprint at the start and after the warm path, "
              f"the held streams and idle CPU: {', '.join(seen)}; now {working_tree()}")
    met = targets(report_warm(warm, warm_rounds, warm_seconds), report_held(held, count), report_idle(idle))
    print(f"\n(total {time.monotonic() - started:.0f} s; {load_text()})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
