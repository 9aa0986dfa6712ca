"""The standard gRPC health service (grpc.health.v1), on asyncio, as every service of ours serves it.

As grpcio's own, except for the end: at a graceful stop each Watch stream writes NOT_SERVING and then ends
(OK). grpcio's streams never end, so each open Watch (a load balancer's, a client library's) held the server's
stop for its whole grace.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._status: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._changed = asyncio.Condition()
        self._version = 0  # of _status: a Watch that was writing while it changed still sees the change
        self._stopping = False

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r} here")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        seen, last = -1, None
        while True:
            async with self._changed:
                while self._version == seen:  # written up to the newest status
                    if self._stopping:
                        return
                    await self._changed.wait()
                seen = self._version
            status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))  # statuses may change meanwhile
                last = status

    async def set(self, service: str, status: int) -> None:
        """Ignored once stopping: the status stays NOT_SERVING."""
        if not self._stopping:
            await self._update({service: status})

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; each Watch writes that, then ends."""
        self._stopping = True
        await self._update(dict.fromkeys(self._status, health_pb2.HealthCheckResponse.NOT_SERVING))

    async def _update(self, statuses: dict[str, int]) -> None:
        async with self._changed:
            self._status.update(statuses)
            self._version += 1
            self._changed.notify_all()
