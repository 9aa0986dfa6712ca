"""What a forwarded call carries to the pod: the caller's metadata less the hop's own headers, and with tracing on
the router's span in place of the caller's context (through a real pod: tests/integration/test_router.py)."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from pagedserve.services.router.upstream import forwarded_metadata

CALLER = (("authorization", "Bearer k"), ("x-cache-salt", "user-7"), ("user-agent", "grpc-python/1.85"),
          ("grpc-accept-encoding", "gzip"), ("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
          ("x-request-tag", "kept"))


def test_the_callers_metadata_goes_through_less_the_hops() -> None:
    assert forwarded_metadata(CALLER) == [("authorization", "Bearer k"), ("x-cache-salt", "user-7"),
                                          CALLER[4], ("x-request-tag", "kept")]
    assert forwarded_metadata(None) == []


def test_with_a_span_its_context_replaces_the_callers() -> None:
    span = TracerProvider().get_tracer("test").start_span("route Generate")
    forwarded = dict(forwarded_metadata(CALLER, span))
    context = span.get_span_context()
    assert forwarded["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
    assert forwarded["authorization"] == "Bearer k" and "user-agent" not in forwarded
