"""Tracing across the pod's three processes, received by a real OTLP/gRPC trace receiver on loopback.

The receiver is the OTLP TraceService itself (opentelemetry-proto's generated server), so the services'
own exporters, batching and wire format are what is tested.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from polling import free_port, wait_for
from stack_testing import PROMPTS, Pod

from pagedserve.protos import inference_pb2 as pb

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"  # the client's own trace, continued by the pod
PARENT_ID = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, span)
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [(attributes.get("service.name", ""), s) for s in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def find(self, service: str, name: str) -> list[Any]:
        with self.lock:
            return [s for svc, s in self.spans if svc == service and s.name == name]


@pytest.fixture()
def receiver() -> Iterator[tuple[Receiver, str]]:
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(None)


def test_a_request_is_traced_across_the_three_processes(
    tiny_chat_model_dir: Path, receiver: tuple[Receiver, str]
) -> None:
    spans, endpoint = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    pod = Pod(tiny_chat_model_dir, "--num-blocks", "64", env=env)
    try:
        request = pb.GenerateRequest(text=PROMPTS[0], params=pb.GenerationParameters(max_tokens=4, ignore_eos=True))
        traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
        chunks = list(pod.stub.Generate(request, timeout=60, metadata=[("traceparent", traceparent)]))
        usage = chunks[-1].usage

        method = "pagedserve.inference.v1.Inference/Generate"
        (generate,) = wait_for(lambda: spans.find("pagedserve-frontend", method), "the frontend's Generate span")
        assert generate.trace_id.hex() == TRACE_ID and generate.parent_span_id.hex() == PARENT_ID
        attributes = {a.key: a.value for a in generate.attributes}
        assert attributes["pagedserve.request_id"].string_value == chunks[-1].request_id
        assert attributes["gen_ai.usage.input_tokens"].int_value == usage.prompt_tokens
        assert attributes["gen_ai.usage.output_tokens"].int_value == usage.completion_tokens == 4
        assert attributes["pagedserve.num_preemptions"].int_value == 0
        assert [e.name for e in generate.events] == ["first_token"]

        # every step that ran the request links to its Generate span: the prefill and three decodes at least
        steps = wait_for(lambda: [s for s in spans.find("pagedserve-frontend", "engine.step")
                                  if any(link.span_id == generate.span_id for link in s.links)], "linked steps")
        assert len(steps) >= 4
        step_traces = {s.trace_id for s in steps}
        # each step's sidecar calls continue its trace in the other two processes, under client spans
        for service, call in (("pagedserve-executor", "pagedserve.executor.v1.Executor/Execute"),
                              ("pagedserve-block-manager", "pagedserve.block_manager.v1.BlockManager/Step")):
            served = wait_for(lambda s=service, c=call: [x for x in spans.find(s, c) if x.trace_id in step_traces],
                              f"{service} spans in the steps' traces")
            clients = {x.span_id: x for x in spans.find("pagedserve-frontend", call)}
            for span in served:
                assert span.parent_span_id in clients, f"{call} in {service} is not a child of a frontend call"
                parent = clients[span.parent_span_id]
                assert any(parent.parent_span_id == s.span_id for s in steps)
    finally:
        assert pod.stop() is not None and pod.proc.returncode == 0


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_http_request_is_traced_and_its_steps_link_to_it(
    tiny_chat_model_dir: Path, receiver: tuple[Receiver, str], stream: bool
) -> None:
    """The OpenAI-compatible API continues the caller's trace (traceparent header) in FastAPI's server span,
    which carries the request's usage (a stream's too: its body is sent inside that span) and which the
    steps link to."""
    spans, endpoint = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    http_port = free_port()
    pod = Pod(tiny_chat_model_dir, "--num-blocks", "64", "--http-port", str(http_port), env=env)
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": stream}
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        with urllib.request.urlopen(request, timeout=60) as response:
            payload = response.read().decode()
        first = json.loads(payload.split("data: ", 1)[1].split("\n", 1)[0] if stream else payload)
        request_id = first["id"].removeprefix("cmpl-")

        (served,) = wait_for(lambda: spans.find("pagedserve-frontend", "POST /v1/completions"), "the HTTP span")
        assert served.trace_id.hex() == TRACE_ID and served.parent_span_id.hex() == PARENT_ID
        assert served.kind == 2  # SERVER
        attributes = {a.key: a.value for a in served.attributes}
        assert attributes["pagedserve.request_id"].string_value == request_id
        assert attributes["gen_ai.usage.output_tokens"].int_value == 4
        assert attributes["http.route"].string_value == "/v1/completions"
        assert attributes["http.response.status_code"].int_value == 200
        assert [e.name for e in served.events] == (["first_token"] if stream else [])
        steps = wait_for(lambda: [s for s in spans.find("pagedserve-frontend", "engine.step")
                                  if any(link.span_id == served.span_id for link in s.links)], "linked steps")
        assert len(steps) >= 4  # the prefill and three decodes at least
    finally:
        assert pod.stop() is not None and pod.proc.returncode == 0
