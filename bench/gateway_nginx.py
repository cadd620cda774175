"""Start Debian's nginx as a fast static backend, or as a plain reverse proxy, for the gateway
benchmark. Everything lives in a temporary prefix and listens on 127.0.0.1 only."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

RESPONSE = '{"id":"chatcmpl-bench","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'  # noqa: E501

_COMMON = """
worker_processes 1;
daemon off;
master_process off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  keepalive_timeout 120s;
  client_body_temp_path {prefix}/body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
{body}
}}
"""

STATIC = """
  server {{
    listen 127.0.0.1:{port};
    location = /health {{ return 200 '{{"status":"ok"}}'; }}
    location / {{ default_type application/json; return 200 '{response}'; }}
  }}
"""

PROXY = """
  upstream backend {{ server 127.0.0.1:{upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
"""


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )


def wait_listening(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port}")


class Nginx:
    def __init__(self, binary: str, port: int, upstream: int | None = None, cpu: int | None = None) -> None:
        self.prefix = tempfile.mkdtemp(prefix="noctaya-bench-nginx-")
        if upstream is None:
            body = STATIC.format(port=port, response=RESPONSE)
        else:
            body = PROXY.format(port=port, upstream=upstream)
        conf = Path(self.prefix) / "nginx.conf"
        conf.write_text(_COMMON.format(prefix=self.prefix, body=body))
        pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
        self.proc = subprocess.Popen([*pin, binary, "-p", self.prefix, "-c", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.port = port
        wait_listening(port)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        shutil.rmtree(self.prefix, ignore_errors=True)
