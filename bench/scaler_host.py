"""Benchmark helper process: hosts the gRPC ExternalScaler over a DemandBroadcaster with grpcio
natively, with grpcio inside a gevent-monkey-patched process, or with h2 on a gevent loop (the
one-worker gateway's in-process scaler), driven over stdin/stdout.

Usage: python -m bench.scaler_host [--gevent | --h2]
Prints "PORT <n>". Commands (one per line): "publish <queued> <in_flight> <lease 0|1>" answers
"published <time.monotonic()>" (CLOCK_MONOTONIC is system-wide on Linux, so the benchmark compares
it with its own receive times); "streams" answers "streams <open>"; "stop" ends streams with OK.
"""

from __future__ import annotations

import sys

GEVENT = "--gevent" in sys.argv
H2 = "--h2" in sys.argv
if GEVENT:
    from gevent import monkey

    monkey.patch_all()

import time  # noqa: E402

from scaler.demand import Demand, DemandBroadcaster  # noqa: E402
from scaler.service import start_scaler_server  # noqa: E402


def main() -> int:
    broadcaster = DemandBroadcaster()
    if H2:
        from scaler.h2server import start_h2_scaler_server

        server = start_h2_scaler_server(broadcaster, 0, host="127.0.0.1")
    else:
        server = start_scaler_server(broadcaster, 0, host="127.0.0.1")
    if GEVENT or H2:
        import gevent

        def readline() -> str:
            return gevent.get_hub().threadpool.apply(sys.stdin.readline)
    else:
        readline = sys.stdin.readline
    print(f"PORT {server.port}", flush=True)
    while True:
        line = readline()
        if not line or line.strip() == "stop":
            break
        cmd, *args = line.split()
        if cmd == "publish":
            queued, in_flight, lease = (int(a) for a in args)
            t = time.monotonic()
            broadcaster.publish(Demand(queued, in_flight, bool(lease)))
            print(f"published {t}", flush=True)
        elif cmd == "streams":
            print(f"streams {server.servicer.open_streams}", flush=True)
    server.stop(5.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
