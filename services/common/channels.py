"""Client channels to our services, for a caller that makes a call every step.

grpcio polls a channel's future calls from a thread it starts when the channel has none in flight and ends
when the last one completes (grpc/_channel.py). A client with one call at a time (the block manager's Step,
or any call in lock step) thus started a thread per call: an empty Step cost the client 460 µs of CPU with
it, 294 without. `StepChannel` keeps one call open (the service's health Watch, which every service answers
and which sends nothing while the status holds), so that thread lives on.
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .grpc_server import CHANNEL_OPTIONS
from .tracing import traced_channel


class StepChannel:
    """An insecure channel to a sidecar (traced when tracing is on) that keeps its polling thread alive. Used
    from one thread (the engine's)."""

    def __init__(self, address: str) -> None:
        self._raw = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.channel = traced_channel(self._raw)
        self._health = health_pb2_grpc.HealthStub(self._raw)  # untraced: it is no request of anyone's
        self._watch: grpc.Call | None = None

    def keep_polled(self) -> None:
        """Opens the health Watch unless one is open: a service that restarted ended the last one. Cheap
        enough for every step (a flag read)."""
        if not self.watch_open:
            # no deadline: it lasts as long as the server. Read on a thread of its own, so that its end (a
            # stopped server ends it OK, with messages the client must have read first) is seen here.
            self._watch = self._health.Watch(health_pb2.HealthCheckRequest(service=""))
            threading.Thread(target=_drain, args=(self._watch,), name="keep-polled", daemon=True).start()

    @property
    def watch_open(self) -> bool:
        return self._watch is not None and self._watch.is_active()

    def close(self) -> None:
        self.channel.close()  # the Watch with it


def _drain(watch: grpc.Call) -> None:
    try:
        for _ in watch:  # a Watch call iterates its messages
            pass
    except grpc.RpcError:
        pass  # the server went away, or the channel closed: the next step opens another
