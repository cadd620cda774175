"""Subprocess for tests: DemandReporter inside a gevent-patched process (as in the gateway's report
mode). argv: aggregator URL, token file. Publishes from greenlets, then stops (withdraw)."""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import sys  # noqa: E402

import gevent  # noqa: E402

from scaler.demand import Demand, DemandBroadcaster  # noqa: E402
from scaler.reporter import DemandReporter  # noqa: E402

broadcaster = DemandBroadcaster()
reporter = DemandReporter(sys.argv[1], sys.argv[2], broadcaster, member_id="gevent-probe", interval=0.2).start()
ticks = []


def ticker() -> None:
    while True:
        ticks.append(1)
        gevent.sleep(0.01)


gevent.spawn(ticker)
gevent.sleep(0.3)
broadcaster.publish(Demand(queued=4, lease_active=True))
print("published", flush=True)
gevent.get_hub().threadpool.apply(sys.stdin.readline)  # wait for the test without blocking the hub
reporter.stop()
print(json.dumps({"ticks": len(ticks), "sent": reporter.sent, "failures": reporter.failures}), flush=True)
