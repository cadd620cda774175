"""``python -m gateway``: one gevent process serving the OpenAI-compatible front door.

gevent's monkey-patching must precede every other import (the demand reporter and the feeder of
the scaler child process then run as greenlets).
"""

from gevent import monkey

monkey.patch_all()

import gc  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

import gevent  # noqa: E402

from gateway.app import GatewayServer  # noqa: E402
from gateway.config import ConfigError, GatewayConfig, load_config  # noqa: E402
from gateway.drain import Drainer  # noqa: E402
from gateway.logs import configure_logging  # noqa: E402
from scaler.demand import DemandBroadcaster  # noqa: E402

log = logging.getLogger("noctaya.gateway")


def _start_scaler(config: GatewayConfig, broadcaster: DemandBroadcaster) -> list[Callable[[], None]]:
    """Start the demand sink of the configured scaler mode; returns its shutdown steps."""
    if config.scaler_mode == "local":
        from gateway.scaler_process import ScalerProcess

        scaler = ScalerProcess(config, broadcaster).start()
        return [lambda: scaler.stop(grace=5.0)]
    if config.scaler_mode == "report":
        from scaler.reporter import DemandReporter

        assert config.aggregator_url and config.aggregator_token_file
        reporter = DemandReporter(config.aggregator_url, config.aggregator_token_file, broadcaster).start()
        return [lambda: reporter.stop(withdraw=True)]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    broadcaster = DemandBroadcaster()
    server = GatewayServer(config, broadcaster)
    try:
        shutdown_steps = _start_scaler(config, broadcaster)
    except Exception as exc:
        log.error("cannot start the scaler", extra={"mode": config.scaler_mode, "error": str(exc)})
        return 1
    server.start()
    # Everything allocated so far lives for the whole process: keep it out of the cyclic GC's
    # scans, so collections during traffic are short (they show up directly in tail latency).
    gc.collect()
    gc.freeze()
    drainer = Drainer(server, config.drain_grace_seconds, after_withdraw=shutdown_steps)
    gevent.signal_handler(signal.SIGTERM, drainer.begin)
    gevent.signal_handler(signal.SIGINT, drainer.begin)
    drainer.done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
