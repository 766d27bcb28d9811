"""The standard gRPC health service (``grpc.health.v1.Health``) on every port the daemon serves.

What it answers, for the whole server (service ``""``) and for ``kvstore.v1.KVStore``:

- NOT_SERVING from the moment the server is built until :meth:`DaemonHealth.serving`, which the
  daemon calls once the store is open (every tier open, the SSD index read) and its sockets
  are up;
- SERVING after that;
- NOT_SERVING again, for good, from :meth:`DaemonHealth.draining` at the start of shutdown, so
  a load balancer stops sending work before in-flight calls are drained.

Any other service name is NOT_FOUND. ``Check`` needs no token (probes carry none: see
:data:`UNAUTHENTICATED_METHODS`); it reveals one of two states and nothing about tenants,
blocks or configuration. ``Watch`` keeps a stream open for as long as the caller likes, so it
stays behind the same token check as every kvstore call. Unlike a kvstore call, a ``Check``'s
request message is read before anything is checked (grpc reads a unary request first), so an
unauthenticated caller can make the daemon receive up to ``server.max_message_bytes`` per call.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.rpc import kvstore_pb2

KVSTORE_SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
SERVICES = (health.OVERALL_HEALTH, KVSTORE_SERVICE)
# Full method names the auth interceptor admits without a token.
UNAUTHENTICATED_METHODS = frozenset({f"/{health.SERVICE_NAME}/Check"})

ServingStatus = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Servicer(health.aio.HealthServicer):
    """grpc's servicer with ``Watch`` as an async generator, the form the daemon's interceptors
    wrap (grpc's writes through ``context.write`` from a coroutine)."""

    async def Watch(self, request: health_pb2.HealthCheckRequest, context):
        service = request.service
        condition = self._server_watchers[service]
        self._watcher_count_by_service[service] += 1
        last = None
        try:
            async with condition:
                while True:
                    status = self._server_status.get(
                        service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    if status != last:  # a missed state in between is fine: watchers want the last
                        last = status
                        yield health_pb2.HealthCheckResponse(status=status)
                    await condition.wait()
        finally:
            self._watcher_count_by_service[service] -= 1
            if not self._watcher_count_by_service[service]:  # forget names nobody watches
                del self._server_watchers[service]
                del self._watcher_count_by_service[service]


class DaemonHealth:
    """The daemon's health servicer and the two transitions it goes through."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._servicer = _Servicer()
        # Set in place (the servicer's setter is a coroutine): no call can arrive before the
        # server starts, and no watcher exists yet to be notified.
        self._servicer._server_status = dict.fromkeys(SERVICES, NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def status(self, service: str = health.OVERALL_HEALTH) -> ServingStatus:
        """What ``Check`` answers for ``service`` now (SERVICE_UNKNOWN if not served)."""
        return self._servicer._server_status.get(
            service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)

    async def serving(self) -> None:
        """The store is open and the sockets are up: answer SERVING."""
        for service in SERVICES:
            await self._servicer.set(service, SERVING)

    async def draining(self) -> None:
        """Shutdown began: answer NOT_SERVING from now on (later ``serving`` calls are ignored)."""
        await self._servicer.enter_graceful_shutdown()
