"""The router's HTTP /health on a real uvicorn (the test's loop), before a real fleet's bookkeeping: 503 naming
why while no pod that serves HTTP is routable or while the tokenizer is not settled, 200 once both hold."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from typing import Any

from polling import free_port
from test_fleet import PODS, synced

from pagedserve.protos import inference_pb2 as pb
from pagedserve.services.common.http_server import HttpService
from pagedserve.services.router.choice import Chooser
from pagedserve.services.router.fleet import Fleet
from pagedserve.services.router.http_api import HttpRouting, build_app
from pagedserve.services.router.http_upstream import PodHttp
from pagedserve.services.router.request_blocks import RequestHasher
from pagedserve.services.router.telemetry import RouterMetrics


def health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_health_waits_for_a_pod_serving_http_and_for_the_tokenizer() -> None:
    async def run() -> None:
        fleet, pods = Fleet(PODS[:1], Chooser()), PodHttp()
        routing = HttpRouting(fleet, pods, RequestHasher(None, os.urandom(32)), RouterMetrics(fleet), None)
        settled = False
        service = HttpService(build_app(routing, 1024, settled=lambda: settled), f"127.0.0.1:{free_port()}")
        await service.start()
        url = f"http://127.0.0.1:{service.port}"
        try:
            status, answer = await asyncio.to_thread(health, url)  # no pod in sync yet: that is the reason given
            assert status == 503 and PODS[0] in answer["reason"], answer
            synced(fleet, PODS[0])
            status, answer = await asyncio.to_thread(health, url)  # routable, but not known to serve HTTP
            assert status == 503 and "serves the HTTP API" in answer["reason"], answer
            pods.on_model(PODS[0], pb.ModelInfo(http_port=8000))
            status, answer = await asyncio.to_thread(health, url)  # a pod to route to, the tokenizer not settled
            assert (status, answer["reason"]) == (503, "the router's tokenizer is not settled yet"), answer
            settled = True
            assert await asyncio.to_thread(health, url) == (200, {"status": "serving"})
        finally:
            await service.stop()
            await pods.close()

    asyncio.run(run())
