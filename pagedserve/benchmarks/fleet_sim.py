"""`bench fleet --simulate`: the router's own code (services/router: fleet.Fleet, choice.Chooser, pod_index,
prompt_blocks) choosing among simulated pods, to show a policy at a fleet size this machine cannot run.

Each simulated pod is the real `BlockManager` (prefix cache, eviction, admission above the watermark) with its KV
events recorded, as a pod's block manager records them, and a scheduler reduced to what routing moves: FCFS
admission of whole prompts (up to `max_num_seqs` sequences and `max_step_tokens` new prompt tokens a step, the
first admission always fitting), one decode token per running sequence a step. A step lasts

    decode_step_s + new prompt tokens / prefill_tok_s

(calibrated from the real run's pods, or given by flags), and the pod's KV batch with its load (running, waiting,
blocks in use) reaches the router at the end of every step, as a real pod's does; an idle pod sends a heartbeat
when its last report is a second old. Arrivals, the router's in-flight accounting and its choice are the real
router's, at the simulated clock. `pinned` draws a pod per client connection, as a ClusterIP Service does.

Not modelled: chunked prefill, preemption (a decode refused a block waits a step), the network, the router's own
time (see the real run's router_overhead_ms_p50).
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from ..services.block_manager.manager import BlockManager
from ..services.common.kv_events import KvEventBatch, KvEventRecorder
from ..services.router.choice import Chooser
from ..services.router.fleet import Fleet, Ticket
from ..services.router.load import LoadReport
from ..services.router.prompt_blocks import prompt_blocks
from .fleet_workload import FleetRequest, FleetWorkload

HEARTBEAT_S = 1.0  # an idle pod's heartbeat interval (kv_events)
SAMPLED = 7  # the token every simulated step samples: its value changes nothing here


@dataclass(frozen=True)
class StepCosts:
    prefill_tok_s: float
    decode_step_s: float
    max_num_seqs: int = 32
    max_step_tokens: int = 2048


@dataclass
class _Seq:
    number: int
    request: FleetRequest
    namespace: bytes
    ticket: Ticket | None = None
    cached_tokens: int = 0
    new_tokens: int = 0  # computed in the step that admitted it
    tokens_out: int = 0
    prefilled: bool = False
    first_at: float | None = None
    end_at: float | None = None


@dataclass
class _Pod:
    name: str
    manager: BlockManager
    waiting: deque[_Seq] = field(default_factory=deque)
    running: list[_Seq] = field(default_factory=list)
    stepping: list[_Seq] = field(default_factory=list)  # admitted in the step under way
    busy: bool = False
    reported_at: float = 0.0
    events: KvEventRecorder | None = None  # the block manager's, as the pod's sidecar records them

    def batch(self) -> KvEventBatch:
        assert self.events is not None
        return self.events.take_batch()

    def load(self, now: float) -> LoadReport:
        stats = self.manager.stats()
        return LoadReport(len(self.running), len(self.waiting), stats.num_used_blocks, stats.num_total_blocks, now)


@dataclass
class ArmOutcome:
    ttft_s: list[float]
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    duration_s: float  # first arrival to last token
    served: list[str]  # the pod of each request, in arrival order


def namespace(tenant: int) -> bytes:
    """A tenant's cache namespace: distinct per tenant, as the pods' salted namespaces are."""
    return hashlib.blake2b(f"tenant-{tenant}".encode(), digest_size=16).digest()


def simulate(policy: str, workload: FleetWorkload, num_pods: int, num_blocks: int, block_size: int,
             costs: StepCosts, seed: int = 0) -> ArmOutcome:
    """One arm: `policy` is a router policy or `pinned`."""
    pods = {f"pod-{i:03d}": _Pod(f"pod-{i:03d}", BlockManager(num_blocks, block_size)) for i in range(num_pods)}
    fleet = Fleet(list(pods), Chooser(policy if policy != "pinned" else "round-robin", seed=seed))
    for pod in pods.values():
        pod.events = pod.manager.record_kv_events()
        fleet.apply(pod.name, pod.manager.kv_snapshot(), pod.load(0.0), 0.0)
    names = sorted(pods)
    pinned_rng = random.Random(seed)
    pinned = [pinned_rng.choice(names) for _ in range(workload.num_clients)]
    seqs = [_Seq(i, r, namespace(r.tenant)) for i, r in enumerate(workload.requests)]
    served: list[str] = []
    queue: list[tuple[float, int, str, int]] = [(s.request.arrival_s, s.number, "arrive", s.number) for s in seqs]
    heapq.heapify(queue)
    order = len(seqs)

    def start_step(pod: _Pod, now: float) -> None:
        nonlocal order
        decoding = [s for s in pod.running if s.tokens_out < s.request.output_len]
        refused = set(pod.manager.decode([s.number for s in decoding], [SAMPLED] * len(decoding)).refused_seq_ids)
        pod.stepping = [s for s in decoding if s.number not in refused]
        new_tokens = 0
        while pod.waiting and len(pod.running) < costs.max_num_seqs and (
                new_tokens < costs.max_step_tokens or new_tokens == 0):
            seq = pod.waiting[0]
            ids = seq.request.token_ids
            admission = pod.manager.admit(seq.number, ids, seq.namespace, len(ids))
            if not admission.granted:
                break
            pod.waiting.popleft()
            if seq.first_at is None:  # a preempted sequence's second admission is not the request's
                seq.cached_tokens, seq.new_tokens = admission.num_cached_tokens, admission.num_tokens
            new_tokens += admission.num_tokens
            pod.running.append(seq)
            pod.stepping.append(seq)
        if not pod.stepping:  # every decode refused a block and nothing admitted: preempt the newest, recompute
            if not pod.running:
                raise ValueError(f"a prompt of {len(pod.waiting[0].request.token_ids)} tokens does not fit a pod of"
                                 f" {pod.manager.pool.num_blocks} blocks")
            victim = pod.running.pop()
            pod.manager.free(victim.number)
            victim.prefilled = False
            pod.waiting.appendleft(victim)
            start_step(pod, now)
            return
        pod.busy = True
        order += 1
        heapq.heappush(queue, (now + costs.decode_step_s + new_tokens / costs.prefill_tok_s, order, "step", 0))
        ends[order] = pod.name

    ends: dict[int, str] = {}

    def end_step(pod: _Pod, now: float) -> None:
        for seq in pod.stepping:
            if not seq.prefilled:  # its prefill: the prompt's KV is stored, its full blocks join the cache
                pod.manager.commit(seq.number, len(seq.request.token_ids))
                seq.prefilled = True
                seq.first_at = now if seq.first_at is None else seq.first_at
            seq.tokens_out += 1
        done = [s for s in pod.running if s.tokens_out >= s.request.output_len]
        for seq in done:
            pod.manager.free(seq.number)
            pod.running.remove(seq)
            seq.end_at = now
        fleet.apply(pod.name, pod.batch(), pod.load(now), now)
        pod.reported_at = now
        for seq in done:
            if seq.ticket is not None:
                fleet.finish(seq.ticket)
        pod.busy = False
        if pod.running or pod.waiting:
            start_step(pod, now)

    while queue:
        now, number, kind, _ = heapq.heappop(queue)
        if kind == "step":
            end_step(pods[ends.pop(number)], now)
            continue
        seq = seqs[number]
        for pod in pods.values():  # an idle pod's heartbeat keeps its report fresh
            if not pod.busy and now - pod.reported_at >= HEARTBEAT_S:
                fleet.apply(pod.name, pod.batch(), pod.load(now), now)
                pod.reported_at = now
        if policy == "pinned":
            name = pinned[seq.request.client]
        else:
            blocks = prompt_blocks(seq.request.token_ids, seq.namespace, block_size)
            choice = fleet.choose(blocks, now)
            name = choice.pod
            seq.ticket = fleet.send(name, len(seq.request.token_ids) - choice.predicted_cached_tokens, now)
        served.append(name)
        pod = pods[name]
        pod.waiting.append(seq)
        if not pod.busy:
            start_step(pod, now)
    unfinished = [s.number for s in seqs if s.end_at is None]
    assert not unfinished, f"simulated requests never finished: {unfinished[:5]}"
    for pod in pods.values():
        pod.manager.check_integrity()
    first = min(s.request.arrival_s for s in seqs)
    return ArmOutcome(
        ttft_s=[s.first_at - s.request.arrival_s for s in seqs if s.first_at is not None],
        output_tokens=sum(s.tokens_out for s in seqs),
        prompt_tokens=sum(len(s.request.token_ids) for s in seqs),
        cached_tokens=sum(s.cached_tokens for s in seqs),
        duration_s=max(s.end_at for s in seqs if s.end_at is not None) - first,
        served=served,
    )
