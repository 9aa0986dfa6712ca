"""The HTTP API's scaffold without a model: uvicorn on the test's own event loop (as in the frontend), 503 until an
engine is attached and while a sidecar is lost, keys checked before anything else, OpenAI's error shape (a bug is
a generic 500, never a traceback), and a taken port refused at startup."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest
from polling import free_port

from pagedserve.services.common.http_server import HttpService, parse_listen
from pagedserve.services.frontend.auth import ApiKeys
from pagedserve.services.frontend.generation import Serving
from pagedserve.services.frontend.http_api import build_app

KEY = "a-key-of-the-test-0123456789"


def fetch(url: str, body: dict[str, Any] | None = None, key: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_not_ready_lost_sidecar_and_keys() -> None:
    async def run() -> None:
        serving = Serving(ApiKeys.parse(f"{KEY} tenant"))
        service = HttpService(build_app(serving, 1024), f"127.0.0.1:{free_port()}")
        await service.start()
        url = f"http://127.0.0.1:{service.port}"
        try:
            assert await asyncio.to_thread(fetch, f"{url}/health") == (503, {"status": "loading"})
            status, answer = await asyncio.to_thread(fetch, f"{url}/v1/models", None, KEY)
            assert status == 503 and answer["error"]["message"] == "the model is still loading", answer
            status, answer = await asyncio.to_thread(fetch, f"{url}/v1/completions", {"prompt": "hi"}, KEY)
            assert status == 503 and answer["error"]["type"] == "server_error", answer
            status, answer = await asyncio.to_thread(fetch, f"{url}/v1/completions", {"prompt": "hi"})
            assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer  # the key first
            loop = SimpleNamespace(status={"available": False}, alive=True)
            serving.attach(SimpleNamespace(loop=loop, tokenizer=None, info=None))  # type: ignore[arg-type]
            assert await asyncio.to_thread(fetch, f"{url}/health") == (503, {"status": "unavailable"})
            loop.status = {"available": True}
            assert await asyncio.to_thread(fetch, f"{url}/health") == (200, {"status": "serving"})
            status, answer = await asyncio.to_thread(fetch, f"{url}/v1/models", None, KEY)  # info is None: a bug
            assert (status, answer["error"]["message"], answer["error"]["type"]) == (500, "internal error",
                                                                                    "server_error"), answer
            status, answer = await asyncio.to_thread(fetch, f"{url}/v1/completions", {"prompt": "x" * 2000}, KEY)
            assert status == 413, answer
        finally:
            await service.stop()
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(fetch, f"{url}/health")

    asyncio.run(run())


def test_a_taken_port_fails_at_start() -> None:
    async def run() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            service = HttpService(build_app(Serving(), 1024), f"127.0.0.1:{taken.getsockname()[1]}")
            with pytest.raises(OSError, match="cannot listen on http://127\\.0\\.0\\.1"):
                await service.start()

    asyncio.run(run())


def test_listen_addresses() -> None:
    assert parse_listen("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_listen("[::1]:8000") == ("::1", 8000)
    for bad in ("8000", "host:", ":8000", "host:port"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen(bad)
