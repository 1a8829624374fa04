"""Prometheus metrics over HTTP, always in the text format, for every process that serves its own
port: a worker (workers/common/metrics.py) and the router's `--metrics-port` (router/server.py).

Not prometheus_client's `start_http_server`: it answers a scraper that accepts OpenMetrics (Prometheus
does) in that format, and its OpenMetrics writer turns the ':' of vLLM-style names into '_', so a real
Prometheus stored splitserve_time_to_first_token_seconds (tests/test_e2e_prometheus.py found it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class _Union(Collector):
    def __init__(self, *registries: CollectorRegistry) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        for r in self.registries:
            yield from r.collect()


def serve_metrics_http(
    host: str,
    port: int,
    *registries: CollectorRegistry,
    authorize: Callable[[str | None], bool] | None = None,
) -> tuple[str, Callable[[], None]]:
    """Serve the registries' metrics together at http://host:port/metrics (port 0: a free one).
    `authorize`: whether a scrape's Authorization header may read them (None: anyone who reaches
    the port). Returns the bound "host:port" and a function that stops the server."""
    served = CollectorRegistry()
    served.register(_Union(*registries))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if authorize is not None and not authorize(self.headers.get("Authorization")):
                self.send_error(401, "missing or wrong key (authorization: Bearer <key>)")
                return
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics here")
                return
            body = generate_latest(served)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a scrape every few seconds is not news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()

    def close() -> None:
        server.shutdown()
        server.server_close()

    return f"{host}:{server.server_port}", close
