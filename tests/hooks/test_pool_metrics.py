"""The AcceleratorPool series of the hook server: what a pool sync answer sets, what counts as a new
yield, the bound on tracked pools, that a failed sync records nothing, and how gunicorn's worker
processes merge the gauges (``mostrecent``) and the counter (sum)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hooks.app import ROUTES_BY_PATH, create_app
from hooks.metrics import MAX_TRACKED_POOLS, POOL_SYNC_HOOK, HookMetrics

ROOT = Path(__file__).resolve().parents[2]
POOL_SYNC = "/v1/acceleratorpool/sync"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def values(metrics: HookMetrics, pool: str) -> dict[str, float]:
    got = samples(generate_latest(metrics.registry).decode())
    return {name: value for (name, labels), value in got.items() if labels == (("pool", pool),)}


def yielding(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"scaledObject": so, "service": so.removesuffix("-backend"), "for": waiter, "node": "n1", "units": 1,
             "cooldownSeconds": 60} for so, waiter in pairs]


def status(waiting: int = 0, pairs: tuple[tuple[str, str], ...] = (), units: int | None = 4) -> dict[str, Any]:
    out: dict[str, Any] = {
        "waiting": [{"pod": f"ml/c-backend-{i}", "service": "ml/c", "need": 1} for i in range(waiting)],
        "yielding": yielding(*pairs),
    }
    if units is not None:
        out["capacity"] = {"nodes": 2, "units": units}
    return out


A_FOR_C = ("ml/a-backend", "ml/c-backend-0")
B_FOR_C = ("ml/b-backend", "ml/c-backend-0")
B_FOR_D = ("ml/b-backend", "ml/d-backend-0")


def test_a_sync_answer_sets_the_gauges_and_counts_only_new_yields() -> None:
    metrics = HookMetrics()
    metrics.observe_pool("gpu", None, status(waiting=1, pairs=(A_FOR_C,)))
    got = values(metrics, "gpu")
    assert got["noctaya_pool_waiting"] == 1
    assert got["noctaya_pool_yielding"] == 1
    assert got["noctaya_pool_capacity_units"] == 4
    assert got["noctaya_pool_yields_total"] == 1
    assert got["noctaya_pool_last_sync_timestamp_seconds"] > 0

    # The same promise again (a resync): nothing new.
    metrics.observe_pool("gpu", status(waiting=1, pairs=(A_FOR_C,)), status(waiting=1, pairs=(A_FOR_C,)))
    assert values(metrics, "gpu")["noctaya_pool_yields_total"] == 1
    # A moved to B (A turned busy): a new pair; B now yielding to another waiter: new pair too.
    metrics.observe_pool("gpu", status(waiting=1, pairs=(A_FOR_C,)), status(waiting=2, pairs=(B_FOR_C,)))
    metrics.observe_pool("gpu", status(waiting=2, pairs=(B_FOR_C,)), status(waiting=2, pairs=(B_FOR_C, B_FOR_D)))
    got = values(metrics, "gpu")
    assert got["noctaya_pool_yields_total"] == 3
    assert (got["noctaya_pool_waiting"], got["noctaya_pool_yielding"]) == (2, 2)
    # The waiters bound: the promises end, the gauges fall, the counter stays.
    metrics.observe_pool("gpu", status(waiting=2, pairs=(B_FOR_C, B_FOR_D)), status())
    got = values(metrics, "gpu")
    assert (got["noctaya_pool_waiting"], got["noctaya_pool_yielding"], got["noctaya_pool_yields_total"]) == (0, 0, 3)


def test_partial_or_missing_status_counts_as_empty() -> None:
    metrics = HookMetrics()
    metrics.observe_pool("amd", {}, {"conditions": []})  # InvalidSpec: no capacity, no lists
    got = values(metrics, "amd")
    assert (got["noctaya_pool_waiting"], got["noctaya_pool_yielding"], got["noctaya_pool_capacity_units"]) == (0, 0, 0)
    assert got["noctaya_pool_yields_total"] == 0  # the series exists at 0, so rate() sees the first yield
    metrics.observe_pool("amd", {"yielding": "garbage"}, {"yielding": [None, "x", *yielding(A_FOR_C)]})
    assert values(metrics, "amd")["noctaya_pool_yielding"] == 1
    metrics.observe_pool_sync({"parent": "not an object"}, {"status": {}})  # ignored, never raises
    metrics.observe_pool_sync({"parent": {"metadata": {}}}, {"status": {}})


def test_pools_tracked_are_bounded() -> None:
    metrics = HookMetrics()
    for i in range(MAX_TRACKED_POOLS + 5):
        metrics.observe_pool(f"pool-{i}", None, status(waiting=1))
    pools = {dict(labels).get("pool") for (name, labels) in samples(generate_latest(metrics.registry).decode())
             if name == "noctaya_pool_waiting"}
    assert len(pools) == MAX_TRACKED_POOLS
    assert f"pool-{MAX_TRACKED_POOLS}" not in pools
    metrics.observe_pool("pool-0", None, status(waiting=3))  # a tracked pool still updates
    assert values(metrics, "pool-0")["noctaya_pool_waiting"] == 3


def pool_request(name: str, before: dict[str, Any] | None) -> dict[str, Any]:
    parent: dict[str, Any] = {"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "AcceleratorPool",
                              "metadata": {"name": name, "generation": 1}, "spec": {"resourceName": "nvidia.com/gpu"}}
    if before is not None:
        parent["status"] = before
    return {"controller": {}, "parent": parent, "children": {}, "related": {}}


def test_the_hook_server_records_successful_pool_syncs_only() -> None:
    assert ROUTES_BY_PATH[POOL_SYNC].name == POOL_SYNC_HOOK

    def answer(request: dict[str, Any], config: Any) -> dict[str, Any]:
        if request["parent"]["metadata"]["name"] == "broken":
            raise RuntimeError("boom")
        return {"status": status(waiting=1, pairs=(A_FOR_C,)), "children": [], "resyncAfterSeconds": 0}

    metrics = HookMetrics()
    client = create_app({POOL_SYNC: answer}, metrics=metrics).test_client()
    first = client.post(POOL_SYNC, json=pool_request("gpu", None))
    assert first.status_code == 200
    # Metacontroller's ETag cache: a 304 is still a successful sync of the same answer.
    again = client.post(POOL_SYNC, json=pool_request("gpu", status(waiting=1, pairs=(A_FOR_C,))),
                        headers={"If-None-Match": first.headers["ETag"]})
    assert again.status_code == 304
    assert client.post(POOL_SYNC, json=pool_request("broken", None)).status_code == 500
    got = values(metrics, "gpu")
    assert (got["noctaya_pool_waiting"], got["noctaya_pool_yields_total"]) == (1, 1)
    assert values(metrics, "broken") == {}
    text = client.get("/metrics").get_data(as_text=True)
    assert 'noctaya_pool_yields_total{pool="gpu"} 1.0' in text


WORKER = textwrap.dedent(
    """
    import json, sys
    from hooks.metrics import HookMetrics
    before, after = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    HookMetrics().observe_pool("gpu", before, after)
    """
)
SCRAPE = "from hooks.metrics import HookMetrics; import sys; sys.stdout.write(HookMetrics().exposition()[0].decode())"


@pytest.mark.timeout(120)
def test_gunicorn_workers_merge_gauges_by_most_recent_write_and_sum_the_counter(tmp_path: Path) -> None:
    """Two worker processes answer syncs of one pool; the scrape shows the last answer's gauges (not
    a sum or a maximum) and all yields started by either."""
    import json

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def worker(before: dict[str, Any] | None, after: dict[str, Any]) -> None:
        subprocess.run([sys.executable, "-c", WORKER, json.dumps(before), json.dumps(after)], env=env, check=True,
                       timeout=60, cwd=ROOT)

    worker(None, status(waiting=3, pairs=(A_FOR_C,), units=4))  # one process: 3 waiting, A yields
    worker(status(waiting=3, pairs=(A_FOR_C,)), status(waiting=1, pairs=(A_FOR_C, B_FOR_D), units=4))  # another
    out = subprocess.run([sys.executable, "-c", SCRAPE], env=env, capture_output=True, text=True, check=True,
                         timeout=60, cwd=ROOT).stdout
    got = {name: value for (name, labels), value in samples(out).items() if labels == (("pool", "gpu"),)}
    assert got["noctaya_pool_waiting"] == 1  # the newer answer, not 3 + 1 or max 3
    assert got["noctaya_pool_yielding"] == 2
    assert got["noctaya_pool_capacity_units"] == 4
    assert got["noctaya_pool_yields_total"] == 2  # A→C in the first process, B→D in the second


def test_each_yield_started_names_its_model_on_a_bounded_counter_and_in_the_log(caplog: pytest.LogCaptureFixture,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from hooks import metrics as metrics_module

    metrics = HookMetrics()
    with caplog.at_level(logging.INFO, logger=metrics_module.logger.name):
        metrics.observe_pool("gpu", None, status(waiting=1, pairs=(A_FOR_C,)))
        metrics.observe_pool("gpu", status(waiting=1, pairs=(A_FOR_C,)), status(waiting=1, pairs=(A_FOR_C,)))
        metrics.observe_pool("gpu", status(waiting=1, pairs=(A_FOR_C,)), status(waiting=2, pairs=(B_FOR_C, B_FOR_D)))
    got = samples(generate_latest(metrics.registry).decode())
    by_victim = {dict(labels)["victim"]: value for (name, labels), value in got.items()
                 if name == "noctaya_pool_model_yields_total"}
    assert by_victim == {"ml/a": 1, "ml/b": 2}
    lines = [r.getMessage() for r in caplog.records if "yields" in r.getMessage()]
    assert lines[0] == "pool gpu: ml/a yields 1 on n1 to ml/c (pod ml/c-backend-0)"
    assert len(lines) == 3, lines
    # Bounded: beyond MAX_TRACKED_VICTIMS a new model is counted on the pool's total only.
    monkeypatch.setattr(metrics_module, "MAX_TRACKED_VICTIMS", 2)
    metrics.observe_pool("gpu", None, status(waiting=1, pairs=(("ml/z-backend", "ml/c-backend-0"),)))
    got = samples(generate_latest(metrics.registry).decode())
    assert not any(dict(labels).get("victim") == "ml/z" for (_name, labels) in got)
    assert values(metrics, "gpu")["noctaya_pool_yields_total"] == 4
