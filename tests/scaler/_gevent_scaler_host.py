"""Subprocess for tests: a gevent-monkey-patched process shaped like the gateway (gevent pywsgi HTTP
server + in-process gRPC ExternalScaler over one DemandBroadcaster).

HTTP control (127.0.0.1, ephemeral port): GET /ping, POST /publish?queued=N&in_flight=N&lease=0|1,
POST /stop (stops the gRPC server with OK ends, then exits). Prints "PORTS <http> <grpc>" once up.
"""

from gevent import monkey

monkey.patch_all()

import sys  # noqa: E402
from urllib.parse import parse_qs  # noqa: E402

import gevent  # noqa: E402
from gevent.pywsgi import WSGIServer  # noqa: E402

from scaler.demand import Demand, DemandBroadcaster  # noqa: E402
from scaler.service import start_scaler_server  # noqa: E402

broadcaster = DemandBroadcaster()
scaler = start_scaler_server(broadcaster, 0, host="127.0.0.1", metric_name="noctaya-demand", target=10)
done = gevent.event.Event()


def app(environ, start_response):
    path = environ["PATH_INFO"]
    query = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
    if path == "/ping":
        body = f"pong {scaler.servicer.open_streams}".encode()
    elif path == "/publish":
        broadcaster.publish(Demand(int(query.get("queued", 0)), int(query.get("in_flight", 0)),
                                   query.get("lease") == "1"))
        body = b"ok"
    elif path == "/stop":
        gevent.spawn(lambda: (scaler.stop(5.0), done.set()))
        body = b"stopping"
    else:
        start_response("404 Not Found", [("Content-Length", "0")])
        return [b""]
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


http = WSGIServer(("127.0.0.1", 0), app, log=None)
http.start()
print(f"PORTS {http.server_port} {scaler.port}", flush=True)
done.wait(120)
http.stop(timeout=1)
sys.exit(0)
