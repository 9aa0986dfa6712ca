"""The router's public gRPC API (`service Inference`): each request forwarded whole to one pod, chosen per request.

Generate and Complete: the prompt hashed once (request_blocks.py), a pod chosen (fleet.py, choice.py), the request
sent unchanged with the caller's metadata and what is left of its deadline (upstream.py), and the pod's answer
passed through as it comes: chunk by chunk, with the pod's status code and message on failure. The caller leaving
cancels the pod's call (the `finally` below), which frees its blocks there. A call that fails UNAVAILABLE before
any output reached the caller (the pod went away, or is stopping) is sent once more, to another pod; a second
failure, or one with no other pod, is answered as the pod answered it. Each answer's trailing metadata names the
pod that served it and the cached prefix the router predicted there (`pagedserve-pod`,
`pagedserve-predicted-cached-tokens`).

Tokenize and ListModels go to any routable pod (every pod has the fleet's identity); Status is the router's own
view: the fleet's totals from the routable pods' latest load reports (cached blocks from the router's index),
and each pod in the `pagedserve-router-pods` trailing metadata (JSON). The router publishes no KV events of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio

from ...protos import inference_pb2 as pb
from ...protos import inference_pb2_grpc as pb_grpc
from ...protos import kv_events_pb2
from ..common.errors import NotReady
from .choice import Choice
from .fleet import Fleet
from .load import LoadReport
from .request_blocks import RequestHasher
from .telemetry import RouterMetrics
from .upstream import PodChannels, attempt_span, forwarded_metadata

POD_HEADER = "pagedserve-pod"
PREDICTED_HEADER = "pagedserve-predicted-cached-tokens"
PODS_HEADER = "pagedserve-router-pods"
Reply = TypeVar("Reply")


class RouterServicer(pb_grpc.InferenceServicer):
    def __init__(self, fleet: Fleet, channels: PodChannels, hasher: RequestHasher, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet, self.channels, self.hasher, self.metrics, self.clock = fleet, channels, hasher, metrics, clock
        self._turns = itertools.count()  # Tokenize and ListModels: the routable pods in turn

    # ---- Generate and Complete -----------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        route = _Route(self, request, context)
        while True:
            choice = route.next_pod()
            ticket = self.fleet.send(choice.pod, route.new_tokens(choice), self.clock())
            span = attempt_span("Generate", choice.pod)
            call = self.channels.stubs[choice.pod].Generate(request, **route.call_options(span))
            code, usage, answered = "OK", None, False
            try:
                async for chunk in call:
                    answered = True
                    if chunk.HasField("usage"):
                        usage = chunk.usage
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                if not (route.may_retry(exc) and not answered):
                    await context.abort(exc.code(), exc.details() or "")
            except (asyncio.CancelledError, GeneratorExit):
                code = "CANCELLED"  # the caller left: the pod's call is cancelled below
                raise
            finally:
                call.cancel()
                self._ended(choice, code, usage, span)
                self.fleet.finish(ticket)

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        route = _Route(self, request, context)
        while True:
            choice = route.next_pod()
            ticket = self.fleet.send(choice.pod, route.new_tokens(choice), self.clock())
            span = attempt_span("Complete", choice.pod)
            code, usage = "OK", None
            call = self.channels.stubs[choice.pod].Complete(request, **route.call_options(span))
            try:
                response: pb.CompleteResponse = await call
                usage = response.usage if response.HasField("usage") else None
                return response
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                if not route.may_retry(exc):
                    await context.abort(exc.code(), exc.details() or "")
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            finally:
                call.cancel()
                self._ended(choice, code, usage, span)
                self.fleet.finish(ticket)

    def _ended(self, choice: Choice, code: str, usage: pb.Usage | None, span: Any) -> None:
        self.metrics.ended(choice.pod, code, choice.predicted_cached_tokens, usage)
        if span is not None:
            if usage is not None:
                span.set_attribute("pagedserve.cached_prompt_tokens", usage.cached_prompt_tokens)
            span.set_attribute("rpc.grpc.status_code", code)
            span.end()

    # ---- any pod -------------------------------------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        return await self._any_pod(lambda stub, options: stub.Tokenize(request, **options), context)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ListModelsResponse:
        return await self._any_pod(lambda stub, options: stub.ListModels(request, **options), context)

    async def _any_pod(self, send: Callable[[pb_grpc.InferenceStub, dict[str, Any]], Awaitable[Reply]],
                       context: grpc.aio.ServicerContext) -> Reply:
        failed: list[str] = []
        while True:
            pods = self.fleet.routable(exclude=failed)
            if not pods:
                raise NotReady(self.fleet.why_none(failed))
            pod = pods[next(self._turns) % len(pods)]
            options = {"metadata": forwarded_metadata(context.invocation_metadata()),
                       "timeout": context.time_remaining()}
            try:
                return await send(self.channels.stubs[pod], options)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or failed or len(pods) == 1:
                    await context.abort(exc.code(), exc.details() or "")
                failed.append(pod)

    # ---- the router's own ----------------------------------------------------------------------------

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        """The fleet's totals over the routable pods, and every pod's view in the trailing metadata (JSON).

        Sequences and blocks are the sum of the pods' latest load reports; free blocks are each pod's total less
        its used ones (a report carries no free count; a pod's free blocks include its cached ones, as the pod's
        own Status counts them). Cached blocks come from the router's index, since a report does not carry them:
        every block the pods' prefix caches hold as their KV events describe them, in use by a sequence or free
        (a pod's own Status counts the free ones only: the two agree whenever nothing runs)."""
        now = self.clock()
        response = pb.StatusResponse(prefix_hit_rate=self.metrics.prefix_hit_rate)
        pods = []
        for address, record in self.fleet.pods.items():
            cached_blocks = self.fleet.index.num_cached_blocks(address)
            view: dict[str, Any] = {"pod": address, "phase": record.phase.value, "reason": record.reason,
                                    "model": record.model, "in_flight": len(record.in_flight),
                                    "cached_blocks": cached_blocks}
            if record.load is not None:
                load = record.load
                view |= {"num_running": load.num_running, "num_waiting": load.num_waiting,
                         "num_used_blocks": load.num_used_blocks, "num_total_blocks": load.num_total_blocks,
                         "report_age_s": round(now - load.reported_at, 3)}
                if record.routable:
                    _add_report(response, load, cached_blocks)
            pods.append(view)
        if response.num_total_blocks:
            response.block_pressure = response.num_used_blocks / response.num_total_blocks
        context.set_trailing_metadata([(PODS_HEADER, json.dumps(pods))])
        return response

    async def SubscribeKvEvents(self, request: kv_events_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[kv_events_pb2.KvEventMessage]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "a router publishes no KV events: subscribe to the pods it routes to")
        yield kv_events_pb2.KvEventMessage()  # never reached: an async generator, like the method it serves


def _add_report(response: pb.StatusResponse, load: LoadReport, cached_blocks: int) -> None:
    """Adds one routable pod's latest report, and its cached blocks from the router's index, to the totals."""
    response.num_running += load.num_running
    response.num_waiting += load.num_waiting
    response.num_used_blocks += load.num_used_blocks
    response.num_free_blocks += max(0, load.num_total_blocks - load.num_used_blocks)
    response.num_total_blocks += load.num_total_blocks
    response.num_cached_blocks += cached_blocks


class _Route:
    """One request's way through the fleet: its prompt hashed once (timed with the first choice as the decision),
    at most two pods tried, the second only after the first failed UNAVAILABLE."""

    def __init__(self, servicer: RouterServicer, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.servicer, self.context = servicer, context
        self.metadata = context.invocation_metadata()
        self._started = time.perf_counter()
        self.prompt = servicer.hasher.blocks(request, self.metadata, servicer.fleet.identity)
        self.tried: list[str] = []

    def next_pod(self) -> Choice:
        """The first pod, or after a retryable failure another one; NotReady naming why when there is none."""
        servicer = self.servicer
        try:
            choice = servicer.fleet.choose(self.prompt, servicer.clock(), exclude=self.tried)
        except NotReady:
            if not self.tried:
                servicer.metrics.unroutable.inc()
            raise
        if not self.tried:
            servicer.metrics.decision_seconds.observe(time.perf_counter() - self._started)
        else:
            servicer.metrics.retries.inc()
        self.tried.append(choice.pod)
        self.context.set_trailing_metadata([(POD_HEADER, choice.pod),
                                            (PREDICTED_HEADER, str(choice.predicted_cached_tokens))])
        return choice

    def may_retry(self, failure: grpc.aio.AioRpcError) -> bool:
        """Whether the failed attempt may go to another pod: UNAVAILABLE, the first failure, another pod routable."""
        return (failure.code() == grpc.StatusCode.UNAVAILABLE and len(self.tried) == 1
                and bool(self.servicer.fleet.routable(exclude=self.tried)))

    def new_tokens(self, choice: Choice) -> int:
        return max(0, self.prompt.num_tokens - choice.predicted_cached_tokens)

    def call_options(self, span: Any) -> dict[str, Any]:
        return {"metadata": forwarded_metadata(self.metadata, span), "timeout": self.context.time_remaining()}
