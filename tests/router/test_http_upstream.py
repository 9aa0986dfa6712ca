"""What a request forwarded over HTTP carries to the pod and back: the caller's headers less the hop-by-hop ones,
the router's span in place of the caller's trace context, the pod's answer headers less the router's own, and the
pod's HTTP address from its ListModels (through real pods: tests/integration/test_router_http.py)."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from pagedserve.protos import inference_pb2 as pb
from pagedserve.services.router.http_upstream import PodHttp, answer_headers, forwarded_headers

TRACEPARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
CALLER = [("host", "router:8000"), ("authorization", "Bearer k"), ("X-Cache-Salt", "user-7"),
          ("connection", "keep-alive, X-Hop-Only"), ("x-hop-only", "1"), ("content-length", "42"),
          ("transfer-encoding", "chunked"), ("content-type", "application/json"), ("traceparent", TRACEPARENT),
          ("x-request-tag", "kept")]


def test_the_callers_headers_go_through_less_the_hop_by_hop_ones() -> None:
    assert forwarded_headers(CALLER) == [("authorization", "Bearer k"), ("x-cache-salt", "user-7"),
                                         ("content-type", "application/json"), ("traceparent", TRACEPARENT),
                                         ("x-request-tag", "kept")]


def test_with_a_span_its_context_replaces_the_callers() -> None:
    span = TracerProvider().get_tracer("test").start_span("route POST /v1/completions")
    forwarded = dict(forwarded_headers(CALLER, span))
    context = span.get_span_context()
    assert forwarded["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
    assert forwarded["authorization"] == "Bearer k" and "host" not in forwarded


def test_the_pods_answer_headers_less_the_routers_own() -> None:
    pod = [("Content-Type", "text/event-stream; charset=utf-8"), ("Cache-Control", "no-cache"),
           ("Transfer-Encoding", "chunked"), ("Date", "today"), ("Server", "uvicorn"), ("Content-Length", "9")]
    assert answer_headers(pod) == {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}


def test_a_pods_http_address_is_its_grpc_host_and_the_port_it_names() -> None:
    pods = PodHttp()
    pods.on_model("10.0.0.7:50051", pb.ModelInfo(name="m", http_port=8000))
    pods.on_model("[fd00::7]:50051", pb.ModelInfo(name="m", http_port=8001))
    pods.on_model("10.0.0.8:50051", pb.ModelInfo(name="m"))  # serves gRPC only
    assert pods.url("10.0.0.7:50051", "/v1/models") == "http://10.0.0.7:8000/v1/models"
    assert pods.url("[fd00::7]:50051", "/health") == "http://[fd00::7]:8001/health"
    assert [pods.serves_http(p) for p in ("10.0.0.7:50051", "10.0.0.8:50051", "10.0.0.9:50051")] == [
        True, False, False]
