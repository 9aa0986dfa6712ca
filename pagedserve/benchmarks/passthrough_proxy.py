"""The floor of a routing hop, for `bench fleet`'s `router_overhead_floor_ms_p50`: a gRPC proxy that forwards
Generate to one pod and does nothing else.

The router's transport without its routing: the same grpc.aio server and client on uvloop, the caller's metadata
forwarded as the router forwards it, the deadline passed on, but request and response chunks kept as bytes (never
parsed) and no prompt hashed, no pod chosen, no metric kept. What a routed request costs beyond this is the
router's own work.

    python -m pagedserve.benchmarks.passthrough_proxy UPSTREAM   (prints "listening on 127.0.0.1:PORT (port PORT)")
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from ..services.common.grpc_server import CHANNEL_OPTIONS
from ..services.router.upstream import forwarded_metadata

SERVICE = "pagedserve.inference.v1.Inference"


def _same(data: bytes) -> bytes:
    return data


async def serve(upstream: str) -> None:
    channel = grpc.aio.insecure_channel(upstream, options=CHANNEL_OPTIONS)
    generate = channel.unary_stream(f"/{SERVICE}/Generate", request_serializer=_same, response_deserializer=_same)

    async def forward(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        call = generate(request, metadata=forwarded_metadata(context.invocation_metadata()),
                        timeout=context.time_remaining())
        async for chunk in call:
            yield chunk

    handler = grpc.unary_stream_rpc_method_handler(forward, request_deserializer=_same, response_serializer=_same)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Generate": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port} (port {port})", flush=True)
    await server.wait_for_termination()


def main() -> None:
    import uvloop

    uvloop.run(serve(sys.argv[1]))


if __name__ == "__main__":
    main()
