"""Client channels to our sidecars, and the step streams that carry a frontend's steps to them.

A unary call per step cost the server about twice the CPU of a message on an open stream (~320 against
~160 µs). So each sidecar's steps go over one bidirectional call (`StepStream`), answered in order, which
also keeps grpcio's polling thread alive (it starts one whenever a channel has no call in flight). A stream
has no per-step deadline, so a watchdog thread cancels one whose awaited answer is later than the step
timeout; and no per-call metadata, so each message carries its step's trace context.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import grpc

from .grpc_server import CHANNEL_OPTIONS
from .tracing import client_span, traced_channel

Response = TypeVar("Response")
_END = object()  # ends a call's request iterator: the client half-closes


class StepChannel:
    """An insecure channel to a sidecar; its unary calls are traced when tracing is on."""

    def __init__(self, address: str) -> None:
        self._raw = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.channel = traced_channel(self._raw)

    def stream(self, method: str, response_type: Any, timeout: float) -> StepStream[Any]:
        """A step stream on this channel; `method` is the full name, "/package.Service/Method"."""
        call = self._raw.stream_stream(method, request_serializer=_serialize,
                                       response_deserializer=response_type.FromString)
        return StepStream(call, method.lstrip("/"), timeout)

    def close(self) -> None:
        self.channel.close()


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


class StreamError(grpc.RpcError):
    """A step's answer that never came: the stream timed out (DEADLINE_EXCEEDED) or ended without it
    (UNAVAILABLE). Like grpcio's errors it has code() and details(), so recovery reads it the same way."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class StepStream(Generic[Response]):
    """Steps sent on one bidirectional call and answered in order. Used from one thread (the engine's). The
    call opens at the first send, and again after one failed: a step sent on a failed call gets its error."""

    def __init__(self, method: grpc.StreamStreamMultiCallable, name: str, timeout: float) -> None:
        self.method, self.name, self.timeout = method, name, timeout
        self.call: _Call[Response] | None = None
        self._watchdog: threading.Thread | None = None
        self._closed = threading.Event()

    def send(self, request: Any) -> Pending[Response]:
        """Queues the request on the open call (opening one if there is none) and returns at once."""
        if self.call is None or self.call.failure is not None:
            self.call = _Call(self.method, self.name)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name=f"{self.name} watchdog", daemon=True)
                self._watchdog.start()
        span, request.traceparent = client_span(self.name)
        return self.call.send(request, time.monotonic() + self.timeout, span)

    def reopen(self) -> None:
        """Ends the open call, if any: the next step opens another. After a Reset, whose answer shows the
        sidecar alive, a call to a process that has gone would otherwise fail one more step."""
        if self.call is not None:
            self.call.end()
            self.call = None

    def close(self) -> None:
        self._closed.set()
        self.reopen()

    def _watch(self) -> None:
        """Cancels the call whose awaited answer is overdue; wakes a few times per timeout, never per step."""
        while not self._closed.wait(min(0.5, self.timeout / 4)):
            call = self.call
            if call is not None:
                call.cancel_if_late(time.monotonic())


class Pending(Generic[Response]):
    """A request sent on a step stream, not answered yet."""

    def __init__(self, call: _Call[Response], index: int, deadline: float, span: Any) -> None:
        self.call, self.index, self.deadline, self.span = call, index, deadline, span

    def result(self) -> Response:
        try:
            return self.call.answer(self.index, self.deadline)
        finally:
            if self.span is not None:
                self.span.end()


class _Call(Generic[Response]):
    def __init__(self, method: grpc.StreamStreamMultiCallable, name: str) -> None:
        self.name = name
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.taken = threading.Semaphore(0)
        self.responses: Any = method(self._requests())
        self.sent = self.received = 0
        self.answers: dict[int, Response] = {}
        self.failure: grpc.RpcError | None = None
        self.awaiting: float | None = None  # the deadline of the answer the engine waits for (the watchdog's)
        self.timed_out = False
        self.lock = threading.Lock()  # between the engine's wait and the watchdog

    def send(self, request: Any, deadline: float, span: Any) -> Pending[Response]:
        self.requests.put(request)
        # grpcio reads the requests on a thread of its own, which needs the GIL: without this wait the engine
        # kept it, and the message left only once the engine next blocked (for the block manager: when it
        # wanted the answer). Waiting here lets that thread take it now; it sends it before it gives the GIL up.
        while not self.taken.acquire(timeout=0.1):
            if not self.responses.is_active():  # no thread takes it: its answer will be the call's error
                break
        self.sent += 1
        return Pending(self, self.sent - 1, deadline, span)

    def _requests(self) -> Iterator[Any]:
        while (request := self.requests.get()) is not _END:
            self.taken.release()
            yield request

    def answer(self, index: int, deadline: float) -> Response:
        while index not in self.answers and self.failure is None:
            with self.lock:
                self.awaiting = deadline
            try:
                self.answers[self.received] = next(self.responses)
                self.received += 1
            except StopIteration:
                self._fail(StreamError(grpc.StatusCode.UNAVAILABLE, f"{self.name}: the stream ended unanswered"))
            except grpc.RpcError as exc:
                self._fail(self._late() if self.timed_out else exc)
            finally:
                with self.lock:
                    self.awaiting = None
                    if self.timed_out and self.failure is None:  # cancelled just as the answer came: it stands,
                        self._fail(self._late())  # but the call is gone, and so are the answers still due on it
        if index in self.answers:
            return self.answers.pop(index)
        assert self.failure is not None
        raise self.failure

    def cancel_if_late(self, now: float) -> None:
        with self.lock:
            if self.awaiting is not None and now > self.awaiting:
                self.timed_out = True
                self.responses.cancel()

    def _late(self) -> StreamError:
        return StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.name}: no answer in time")

    def _fail(self, error: grpc.RpcError) -> None:
        self.failure = error
        self.end()

    def end(self) -> None:
        self.requests.put(_END)
        self.responses.cancel()
