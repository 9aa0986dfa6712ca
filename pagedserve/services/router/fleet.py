"""The router's fleet: the pods it routes to, what it has heard from each, and its own requests in flight there.

Bookkeeping only (no gRPC, no clock of its own: every call is given `now`), so that the rules are tested without a
process. The watchers (watcher.py) tell it what each pod says; the servicer asks it for a pod per request
(`choose`) and tells it when the request ends (`finish`).

A pod is *routable* from the first snapshot of its event stream (its identity accepted, its stream working) for as
long as its calls do not fail: `in sync`, or `resyncing` (a gap: subscribing again over a live connection). The
chooser ranks a routable pod without a recent load report after every fresh one (stale is unknown, never idle:
load.py). A pod whose call failed is `down` and gets no request until it has answered again; a pod whose cache
identity differs from the fleet's is `refused` with the fields named: the router could not predict its prefix hits,
and a request retried there would be answered by another model. The fleet is *available* (gRPC health SERVING)
while at least one pod is routable.

The pods are `--endpoints`, fixed, or Kubernetes' (endpoint_slices.py), which come and go: `add_pod`, `remove_pod`,
and `drain` for a pod that is not ready or terminating (no new request goes there; those in flight finish).

The fleet's identity is the first accepted pod's: pods are checked against it, not against each other.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from ..common.cache_identity import CacheIdentity
from ..common.errors import NotReady
from ..common.kv_events import KvEventBatch, KvSnapshot
from .choice import Choice, Chooser
from .load import InFlight, LoadReport, PodState, faded
from .pod_index import PodIndex
from .prompt_blocks import PromptBlocks

NO_POD = "no pod to route to"


class PodPhase(enum.Enum):
    CONNECTING = "connecting"  # not reached yet, or identified and waiting for the first snapshot
    IN_SYNC = "in sync"
    RESYNCING = "resyncing"  # a gap in its batches: subscribing again
    DOWN = "down"  # its last call failed
    REFUSED = "refused"  # another cache identity than the fleet's


@dataclass(frozen=True)
class Ticket:
    """One request this router sent to a pod, until it ends."""

    pod: str
    number: int
    sent_at: float
    new_tokens: int  # its prompt tokens less the cached ones the router predicted


@dataclass
class PodRecord:
    address: str
    phase: PodPhase = PodPhase.CONNECTING
    reason: str = ""  # why it is down, refused or resyncing
    model: str = ""
    load: LoadReport | None = None
    in_flight: dict[int, Ticket] = field(default_factory=dict)
    draining: bool = False  # not ready or terminating (Kubernetes says): no new request
    recent: tuple[float, float] = (0.0, 0.0)  # this router's requests sent there, faded (load.faded), and when

    @property
    def routable(self) -> bool:
        return self.phase in (PodPhase.IN_SYNC, PodPhase.RESYNCING) and not self.draining


class Fleet:
    """`on_availability(bool)` is called when the fleet gains its first routable pod or loses its last one."""

    def __init__(self, addresses: Sequence[str], chooser: Chooser,
                 on_availability: Callable[[bool], None] | None = None,
                 no_pods: str = "the router has no endpoints (--endpoints is empty)") -> None:
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"endpoints must be distinct, got {list(addresses)}")
        self.chooser = chooser
        self.no_pods = no_pods  # why no pod is known: the UNAVAILABLE message's reason
        self.index = PodIndex()
        self.pods = {address: PodRecord(address) for address in addresses}
        for address in addresses:
            self.index.add_pod(address)
        self.identity: CacheIdentity | None = None  # the first accepted pod's
        self._on_availability = on_availability
        self._available = False
        self._numbers = itertools.count(1)

    # ---- the pods that come and go (endpoint_slices.py) ----------------------------------------------------

    def add_pod(self, pod: str) -> bool:
        """A new pod (True), or a known one taking requests again (False): routable once its watcher is in sync."""
        record = self.pods.get(pod)
        if record is not None:
            self.drain(pod, False)
            return False
        self.pods[pod] = PodRecord(pod)
        self.index.add_pod(pod)
        return True

    def drain(self, pod: str, draining: bool = True) -> None:
        """No new request for the pod (or again, with False); its requests in flight are not touched."""
        record = self.pods.get(pod)
        if record is not None and record.draining != draining:
            record.draining = draining
            self._set(pod, record.phase, record.reason)

    def remove_pod(self, pod: str) -> None:
        """The pod left the fleet; its requests in flight end on their own (`finish` forgets them)."""
        if self.pods.pop(pod, None) is not None:
            self.index.remove_pod(pod)
            self._notify()

    # ---- what the watchers report ----------------------------------------------------------------------

    def identify(self, pod: str, model: str, identity: CacheIdentity | None) -> str:
        """Checks the pod's cache identity (from ListModels) against the fleet's; "" when accepted, else the
        refusal (the pod is then `refused`). The first pod accepted sets the fleet's identity."""
        record = self.pods[pod]
        record.model = model
        if identity is None:
            refusal = "its ListModels gives no cache identity (a pod older than this router?)"
        elif self.identity is None:
            self.identity, refusal = identity, ""
        else:
            differences = self.identity.differences(identity)
            refusal = "" if not differences else "another cache identity than the fleet's: " + "; ".join(differences)
        if refusal:
            self.index.mark_out_of_sync(pod)
            self._set(pod, PodPhase.REFUSED, refusal)
        elif record.phase in (PodPhase.DOWN, PodPhase.REFUSED):
            self._set(pod, PodPhase.CONNECTING)
        return refusal

    def apply(self, pod: str, message: KvSnapshot | KvEventBatch, load: LoadReport | None, now: float) -> bool:
        """A message of the pod's event stream. False when the pod must be subscribed again (a gap, or a batch
        before any snapshot): the pod is then `resyncing`."""
        record = self.pods[pod]
        if load is not None:
            record.load = load
        if isinstance(message, KvSnapshot):
            self.index.apply_snapshot(pod, message, now)
            self._set(pod, PodPhase.IN_SYNC)
            return True
        if self.index.apply_batch(pod, message, now):
            return True
        if record.routable:  # a batch before any snapshot (against the contract) makes no pod routable
            self._set(pod, PodPhase.RESYNCING, f"a gap before batch {message.sequence} of epoch {message.epoch}")
        return False

    def down(self, pod: str, reason: str) -> None:
        """The pod's call failed (or its stream went silent): no request until it answers again."""
        if pod not in self.pods:  # removed while its call failed
            return
        self.index.mark_out_of_sync(pod)
        self._set(pod, PodPhase.DOWN, reason)

    # ---- what the servicer asks ------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return any(record.routable for record in self.pods.values())

    def routable(self, exclude: Collection[str] = ()) -> list[str]:
        return [address for address, record in self.pods.items() if record.routable and address not in exclude]

    def choose(self, prompt: PromptBlocks, now: float, exclude: Collection[str] = ()) -> Choice:
        """The pod for this request among the routable ones (less `exclude`); NotReady naming why when none is."""
        names = self.routable(exclude)
        if not names:
            raise NotReady(self.why_none(exclude))
        depths = self.index.longest_prefixes(prompt.block_hashes)
        return self.chooser.choose(prompt, [self._state(name, depths[name], now) for name in names], now)

    def send(self, pod: str, new_tokens: int, now: float) -> Ticket:
        ticket = Ticket(pod, next(self._numbers), now, new_tokens)
        record = self.pods[pod]
        record.in_flight[ticket.number] = ticket
        count, at = record.recent
        record.recent = (faded(count, now - at) + 1.0, now)
        return ticket

    def finish(self, ticket: Ticket) -> None:
        record = self.pods.get(ticket.pod)  # None: the pod was removed meanwhile
        if record is not None:
            record.in_flight.pop(ticket.number, None)

    def in_flight(self, pod: str, now: float | None = None) -> InFlight:
        """This router's requests at the pod, the part sent after its last load report, and (given `now`) all it
        sent there lately (load.py)."""
        record = self.pods[pod]
        count, at = record.recent
        tickets = record.in_flight.values()
        reported_at = record.load.reported_at if record.load is not None else float("-inf")
        unreported = [t for t in tickets if t.sent_at >= reported_at]
        return InFlight(len(tickets), sum(t.new_tokens for t in tickets), len(unreported),
                        sum(t.new_tokens for t in unreported), 0.0 if now is None else faded(count, now - at))

    def why_none(self, exclude: Collection[str] = ()) -> str:
        """Why no pod can take a request, naming each pod's state: the UNAVAILABLE message."""
        if not self.pods:
            return f"{NO_POD}: {self.no_pods}"
        parts = []
        for address, record in self.pods.items():
            if address in exclude:
                parts.append(f"{address} failed this request")
            elif record.draining:
                parts.append(f"{address} draining (not ready or terminating)")
            elif record.phase == PodPhase.CONNECTING:
                parts.append(f"{address} not in sync yet")
            else:
                parts.append(f"{address} {record.phase.value}" + (f" ({record.reason})" if record.reason else ""))
        return f"{NO_POD}: " + "; ".join(parts)

    # ---- helpers ---------------------------------------------------------------------------------------

    def _state(self, pod: str, cached_blocks: int, now: float) -> PodState:
        record = self.pods[pod]
        return PodState(pod, cached_blocks, record.load, self.index.heard_at(pod), self.in_flight(pod, now))

    def _set(self, pod: str, phase: PodPhase, reason: str = "") -> None:
        record = self.pods[pod]
        record.phase, record.reason = phase, reason
        self._notify()

    def _notify(self) -> None:
        available = self.available
        if available != self._available:
            self._available = available
            if self._on_availability is not None:
                self._on_availability(available)
