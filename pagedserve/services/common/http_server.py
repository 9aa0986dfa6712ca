"""An ASGI app served by uvicorn on the running event loop, beside the gRPC servers of the same process.

uvicorn's own runner would make a loop of its own and take SIGINT/SIGTERM for itself; here the process's
uvloop loop (grpc_server.run) runs it as one more task, and serve_until_signalled keeps the signals and stops
it with the gRPC servers (`also`). The socket is bound in `start`, so a taken port fails the process at
startup with an OSError, as a gRPC listener does, instead of uvicorn's sys.exit from inside a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpTls:
    cert: str
    key: str
    client_ca: str | None = None  # mutual TLS: client certificates signed by this CA are required


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the process's signal handlers stay in charge
        yield


def parse_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT ([::1]:PORT for IPv6)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{listen!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class HttpService:
    """The same life cycle as a GrpcService: `start`, `mark_serving` (a no-op: the app answers 503 itself until
    its backend is there), `stop`. `grace`: seconds open requests get at a stop before they are cancelled."""

    def __init__(self, app: Any, listen: str, tls: HttpTls | None = None) -> None:
        self.host, self.port = parse_listen(listen)
        scheme = "https" if tls is not None else "http"
        self.listen = f"{scheme}://{listen}"
        tls_options: dict[str, Any] = {}
        if tls is not None:
            tls_options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.client_ca is not None:
                tls_options |= {"ssl_ca_certs": tls.client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        # log_config=None: the process's logging stays as configured; no access log (one line per request)
        self.config = uvicorn.Config(app, loop="none", lifespan="off", log_config=None, access_log=False,
                                     server_header=False, timeout_graceful_shutdown=5, **tls_options)
        self.server = _EmbeddedServer(self.config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            sock = socket.create_server((self.host, self.port), family=family)
        except OSError as exc:
            raise OSError(f"cannot listen on {self.listen}: {exc.strerror}") from None
        if self.port == 0:
            self.port = sock.getsockname()[1]
        self.config.load()  # the certificate files are read here, before anything is served
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]), name=f"http {self.listen}")
        while not self.server.started:
            if self._task.done():  # it failed to start: say why
                await self._task
                raise OSError(f"the HTTP server on {self.listen} stopped at startup")
            await asyncio.sleep(0.01)

    async def mark_serving(self) -> None:
        pass

    async def mark_not_serving(self) -> None:
        pass

    async def stop(self, grace: float = 5.0) -> None:
        if self._task is None:
            return
        self.config.timeout_graceful_shutdown = max(1, round(grace))
        self.server.should_exit = True
        await self._task
