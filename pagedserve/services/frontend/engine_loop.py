"""The engine on its own thread, and the bridge to the asyncio API.

The engine and scheduler are touched only by the engine thread: the API thread sends it commands
(add, abort, finish a sample) and receives each request's outputs on an asyncio queue. A step that fails
(an executor or block-manager error) fails the requests in flight with that error and frees their blocks;
the loop goes on. A step that finds a sidecar lost (recovery.py) fails nothing: every request waits to be
recomputed while the loop re-synchronises the sidecars, and goes on where it was once they answer; only past
`recovery_timeout` (or when a sidecar comes back with another cache) are requests failed, UNAVAILABLE. The
waiting queue is bounded: past `max_waiting_requests` a new request is refused with
OutOfCapacity (RESOURCE_EXHAUSTED) at once, rather than queued behind work it cannot overtake.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from ..common.errors import NotReady, OutOfCapacity
from ..common.tracing import tracer, tracing_enabled
from .engine import Engine
from .metrics import ServingMetrics
from .recovery import CacheMismatch, SidecarSync, SidecarUnanswered, is_sidecar_loss
from .request import GenerationParams, StepOutput

log = logging.getLogger(__name__)

Event = StepOutput | BaseException | None  # None: the request is over
RESYNC_INTERVAL = 0.5  # seconds between attempts to re-synchronise lost sidecars
PROBE_INTERVAL = 1.0  # seconds between an idle engine's checks that both sidecars are there


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event]
    span: trace.SpanContext  # the request's Generate span: each step it is part of links to it
    final_only: bool = False  # wants only the request's end (a unary call reads its outputs from the request)
    held: list[StepOutput] = field(default_factory=list)  # outputs not posted yet (the stream interval)
    started: bool = False  # its first output was posted

    def due(self, output: StepOutput, interval: int) -> list[tuple[_Subscriber, Event]]:
        """The outputs to post now: the first at once, then every `interval` steps (the caller joins them into
        one chunk); those of the request's last step are taken by `take_held`."""
        self.held.append(output)
        if self.started and len(self.held) < interval:
            return []
        self.started = True
        return self.take_held()

    def take_held(self) -> list[tuple[_Subscriber, Event]]:
        held, self.held = self.held, []
        return [(self, output) for output in held]


def _post(posts: list[tuple[_Subscriber, Event]]) -> None:
    """Hands events to their requests' event loops: one wake-up per loop and step, not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
    for subscriber, event in posts:
        by_loop.setdefault(subscriber.loop, []).append((subscriber.queue, event))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for queue_, event in items:
        queue_.put_nowait(event)


class EngineLoop:
    def __init__(
        self, engine: Engine, metrics: ServingMetrics, max_waiting_requests: int, sidecars: SidecarSync | None = None,
        recovery_timeout: float = 120.0, on_availability: Callable[[bool], None] = lambda available: None,
        stream_interval: int = 1,
    ) -> None:
        """With `sidecars`, a lost sidecar is waited for (see the module); `on_availability` hears of each
        loss and return, on the engine thread (the server's health status follows it). A streaming request's
        outputs are posted every `stream_interval` steps after its first (fewer, larger chunks)."""
        self.engine, self.metrics, self.max_waiting_requests = engine, metrics, max_waiting_requests
        self.stream_interval = stream_interval
        self.sidecars, self.recovery_timeout, self.on_availability = sidecars, recovery_timeout, on_availability
        self.num_refused = 0  # requests refused because the queue was full
        self.down_since: float | None = None  # when a sidecar was lost (None: both answer)
        self.refusing = ""  # why new requests are refused at once while down (too long, another cache)
        self.num_recoveries = 0
        self._num_generated = 0  # the scheduler's count of tokens recorded, as of the last step delivered
        self._next_resync = 0.0
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._subscribers: dict[str, _Subscriber] = {}
        self.status: dict[str, Any] = self._status()  # replaced whole after each step: safe to read anywhere
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once the engine thread has died (the pod's liveness probe)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- called from the API's event loop ------------------------------------------------------------

    def submit(
        self, request_id: str, prompt: list[int], params: GenerationParams, tenant_salt: bytes,
        final_only: bool = False,
    ) -> asyncio.Queue[Event]:
        """Validates now (raising InvalidRequest or OutOfCapacity), then queues the request. With final_only,
        only its last output and the end come back (no wake-up per step for a caller that waits for all)."""
        if self.refusing:
            raise NotReady(self.refusing)
        self.engine.check(prompt, params)
        events: asyncio.Queue[Event] = asyncio.Queue()
        subscriber = _Subscriber(asyncio.get_running_loop(), events, trace.get_current_span().get_span_context(),
                                 final_only)
        arrival = time.monotonic()  # now: the engine thread takes the request only after the step in progress
        self._call(lambda: self._add(request_id, prompt, params, tenant_salt, subscriber, arrival))
        return events

    def abort(self, request_id: str) -> None:
        self._call(lambda: self._abort(request_id))

    def finish_sample(self, request_id: str, index: int) -> None:
        """A stop string ended sample `index`: free its sequence now."""
        self._call(lambda: self._finish_sample(request_id, index))

    # ---- the engine thread ---------------------------------------------------------------------------

    def _call(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            if not self._commands.empty():
                while not self._commands.empty():
                    self._command(self._commands.get())
                self.status = self._status()
            if self.down_since is not None:
                self.resync()
                continue
            if not self.engine.has_work:
                if not self._wake.wait(timeout=PROBE_INTERVAL):
                    self._probe()
                self._wake.clear()
                continue
            try:
                outputs = self._step()
            except Exception as exc:
                self._deliver(self.engine.take_undelivered())
                loss = self._as_loss(exc)
                if loss is not None:
                    self.lose_sidecar(loss)
                else:
                    log.exception("engine step failed: failing the requests in flight")
                    self._fail_all(exc)
                continue
            self._deliver(outputs)
            self.status = self._status()

    def _command(self, command: Callable[[], None]) -> None:
        try:
            command()
        except Exception as exc:  # an abort's frees could not be sent: the block manager is lost too
            loss = self._as_loss(exc) if self.down_since is None else exc
            if loss is None:
                log.exception("engine command failed")
            elif self.down_since is None:
                self.lose_sidecar(loss)

    def _step(self) -> list[StepOutput]:
        if not tracing_enabled():
            return self.engine.step()
        # One trace per step (its Execute and Step calls are its children), linked to the requests in flight.
        links = [trace.Link(s.span) for s in self._subscribers.values() if s.span.is_valid]
        with tracer().start_as_current_span("engine.step", links=links) as span:
            outputs = self.engine.step()
            span.set_attribute("pagedserve.num_running", self.engine.num_running)
            return outputs

    def _add(self, request_id: str, prompt: list[int], params: GenerationParams, salt: bytes,
             subscriber: _Subscriber, arrival: float) -> None:
        try:
            waiting = self._num_waiting_requests()
            if waiting >= self.max_waiting_requests:
                self.num_refused += 1
                raise OutOfCapacity(f"the server is at capacity: {waiting} waiting request(s), the bound of its queue"
                                    f" (--max-waiting-requests {self.max_waiting_requests}); retry later")
            # checked in `submit`
            request = self.engine.enqueue(request_id, prompt, params, salt, subscriber.final_only)
            request.metrics.arrival = arrival
        except Exception as exc:
            subscriber.loop.call_soon_threadsafe(subscriber.queue.put_nowait, exc)
            return
        self._subscribers[request_id] = subscriber

    def _abort(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)
        self._end(request_id)

    def _end(self, request_id: str, failed: bool = False) -> None:
        """Aborts a request still in the engine and counts how it ended (`failed`: an error, not a cancel)."""
        request = self.engine.request(request_id)
        try:
            self.engine.abort(request_id)
        finally:
            if request is not None:
                self.metrics.record_ended(request, failed)

    def _finish_sample(self, request_id: str, index: int) -> None:
        request = self.engine.finish_sample(request_id, index)
        if request is not None and request.finished:
            _post(self._close(request_id, request))

    def _deliver(self, outputs: list[StepOutput]) -> None:
        posts: list[tuple[_Subscriber, Event]] = []
        # one record per step, not per request: the window holds a minute of them
        generated = self.engine.num_generated  # counted by the engine: a final-only request has no output per step
        self.metrics.record_tokens(generated - self._num_generated)
        self._num_generated = generated
        for output in outputs:
            request = output.request
            subscriber = self._subscribers.get(request.request_id)
            finished = request.finished
            if subscriber is not None and (finished or not subscriber.final_only):
                posts += subscriber.due(output, self.stream_interval)
            if finished:
                posts += self._close(request.request_id, request)
        _post(posts)

    def _close(self, request_id: str, request: Any) -> list[tuple[_Subscriber, Event]]:
        """Records the finished request; returns the end of its stream to post."""
        self.metrics.record_ended(request)
        subscriber = self._subscribers.pop(request_id, None)
        return [*subscriber.take_held(), (subscriber, None)] if subscriber is not None else []

    def _fail_requests(self, exc: BaseException) -> None:
        """Ends every request in the engine, each caller answered with `exc`."""
        for request_id in self.engine.request_ids():
            subscriber = self._subscribers.pop(request_id, None)
            try:
                self._end(request_id, failed=True)
            except Exception:
                log.exception("could not abort %s", request_id)
            if subscriber is not None:  # the tokens it was given come first
                _post([*subscriber.take_held(), (subscriber, exc)])

    def _fail_all(self, exc: Exception) -> None:
        self._fail_requests(exc)
        try:  # the failed steps may have left KV half written that the prefix cache already points at
            self.engine.reset_block_manager()
        except Exception:
            log.exception("could not reset the block manager after a failed step")
        self.status = self._status()

    def _as_loss(self, exc: Exception) -> Exception | None:
        """The failure as a lost sidecar, or None when it is a bad step. A block manager that restarted between
        two calls answers the next with an error about sequences it never knew: asked, it is another process."""
        if self.sidecars is None:
            return None
        if is_sidecar_loss(exc):
            return exc
        try:
            self.sidecars.check_block_manager()
        except Exception as check:
            return check if is_sidecar_loss(check) else None
        return None

    def _probe(self) -> None:
        if self.sidecars is None:
            return
        try:
            self.sidecars.probe()
        except Exception as exc:
            if is_sidecar_loss(exc):
                self.lose_sidecar(exc)
            else:
                log.exception("probing the sidecars failed")

    def lose_sidecar(self, exc: Exception) -> None:
        """A sidecar is gone (`exc` says how): the steps in flight are void, and every request waits, to be
        recomputed once both answer again (`resync`). On the engine thread."""
        self.engine.restart()
        self.down_since, self._next_resync = time.monotonic(), 0.0
        reason = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
        log.warning("lost a sidecar (%s): %d request(s) wait to be recomputed", reason,
                    len(self.engine.request_ids()))
        self.on_availability(False)
        self.status = self._status()

    def resync(self) -> None:
        """One attempt (at most every RESYNC_INTERVAL) to re-synchronise the sidecars after `lose_sidecar`; else
        waits for commands. Once both answer, the requests resume. On the engine thread."""
        assert self.sidecars is not None and self.down_since is not None
        now = time.monotonic()
        if now < self._next_resync:
            self._wake.wait(timeout=self._next_resync - now)
            self._wake.clear()
            return
        self._next_resync = now + RESYNC_INTERVAL
        try:
            stats = self.sidecars.sync()
        except CacheMismatch as exc:
            if self.refusing != str(exc):
                log.error("%s", exc)
            self._refuse(str(exc))
            return
        except grpc.RpcError as exc:
            if now - self.down_since > self.recovery_timeout:
                who = f"the {exc.sidecar}" if isinstance(exc, SidecarUnanswered) else "a sidecar"
                self._refuse(f"{who} has not answered for {now - self.down_since:.0f} s"
                             f" (--recovery-timeout {self.recovery_timeout:g}): {exc.code().name}")
            return
        self.engine.resume(stats)
        log.warning("sidecars back after %.1f s: resuming %d request(s)", now - self.down_since,
                    len(self.engine.request_ids()))
        self.down_since, self.refusing = None, ""
        self.num_recoveries += 1
        self.on_availability(True)
        self.status = self._status()

    def _refuse(self, reason: str) -> None:
        """Fails every request with UNAVAILABLE and refuses new ones until the sidecars are back."""
        self.refusing = reason
        self._fail_requests(NotReady(reason))  # nothing is held in the block manager: only local state goes
        self.status = self._status()

    def _num_waiting_requests(self) -> int:
        """Requests with a sequence waiting for admission: new ones, and preempted ones to be recomputed."""
        return self.engine.num_waiting_requests()

    def _status(self) -> dict[str, Any]:
        return {
            **self.engine.status(),
            "num_refused": self.num_refused,
            "available": self.down_since is None,
            "num_recoveries": self.num_recoveries,
        }
