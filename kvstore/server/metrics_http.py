"""The metrics port: prometheus_client's WSGI app behind an HTTP server with a per-request
socket timeout and a bounded number of handler threads.

prometheus_client's own ``start_http_server`` starts a thread per connection with no timeout:
idle connections each held a thread and a descriptor for good, until the daemon ran out of
descriptors and its accept loop spun. Here a connection that has not sent its request (or
read its reply) within ``server.unauthenticated_timeout_s`` is dropped, at most ``max_connections`` are
served at once, and one more drops the new connection at once (a scraper retries at its next
interval).
"""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

_log = logging.getLogger("kvstore.server.metrics_http")

class _QuietHandler(WSGIRequestHandler):
    timeout = 5.0  # StreamRequestHandler sets it on the connection's socket; set per server

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not logged."""


class BoundedMetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` at once."""

    daemon_threads = True
    # socketserver's default backlog of 5 drops a burst's SYNs (each then waits a second to
    # retry): a scraper arriving during a flood would wait too
    request_queue_size = 128
    max_connections = 8  # set per instance by ``start_metrics_http``
    num_refused = 0

    def server_bind(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_bind()

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.num_refused += 1
            if self.num_refused in (1, 10, 100) or self.num_refused % 1000 == 0:
                _log.warning("metrics port: %d connections refused, %d being served already",
                             self.num_refused, self.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def start_metrics_http(host: str, port: int, registry: CollectorRegistry,
                       max_connections: int, timeout_s: float) -> BoundedMetricsServer:
    """Serve ``registry`` on ``host:port`` (0 picks a port) from a daemon thread; a request
    must arrive, and its reply be read, within ``timeout_s`` (a scrape takes milliseconds)."""
    handler = type("MetricsHandler", (_QuietHandler,), {"timeout": timeout_s})
    server_class = type("MetricsServer", (BoundedMetricsServer,),
                        {"max_connections": max_connections,
                         "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
    server = make_server(host, port, make_wsgi_app(registry), server_class,
                         handler_class=handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="kvstore-metrics").start()
    return server
