"""Two `pagedserve router` replicas (kv-aware) before the same two real pods route by the same state: the pods' KV
events, which each replica follows on its own. A prefix placed on a pod through one replica is followed there
through the other, with that replica's predicted cached tokens equal to what the pod reports in `Usage`; both
replicas' Status views list, per pod, the blocks the pod's own snapshot holds; and a replica restarted mid-way
rebuilds the same view from the pods' snapshots and routes the prefix to the same pod again.

The fleet and the router processes are test_router.py's (mutual TLS on both sides, API keys, the shared
cache-salt secret): its module-scoped fixtures give this module two pods of its own."""

from __future__ import annotations

import json
from pathlib import Path

import test_router
from polling import wait_for
from stack_testing import Pod
from test_router import SYSTEM_PROMPTS, A, generate, metric, router, router_pods

from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.protos import kv_events_pb2 as kv_pb

POD, PREDICTED = "pagedserve-pod", "pagedserve-predicted-cached-tokens"
# test_router's module-scoped fixtures (pytest finds them here by their own names): two pods for this module
secrets_dir, receiver, pods = test_router.secrets_dir, test_router.receiver, test_router.pods


def held_by(pod: Pod) -> int:
    """The blocks the pod's prefix cache holds now, from its own snapshot (the first message of a subscription)."""
    call = pod.stub.SubscribeKvEvents(kv_pb.SubscribeKvEventsRequest(), metadata=A, timeout=30)
    try:
        first: kv_pb.KvEventMessage = next(call)
    finally:
        call.cancel()
    assert first.WhichOneof("body") == "snapshot"
    return len(first.snapshot.block_hashes)


def caught_up(stubs: list[pb_grpc.InferenceStub], pods: list[Pod]) -> dict[str, int]:
    """Waits until every router lists, per pod in sync, the blocks the pod's snapshot holds; returns them."""
    def views_agree() -> dict[str, int] | None:
        truth = {pod.address: held_by(pod) for pod in pods}
        for stub in stubs:
            views = router_pods(stub)
            if any(views[a]["phase"] != "in sync" or views[a]["cached_blocks"] != n for a, n in truth.items()):
                return None
        return truth

    return wait_for(views_agree, "the routers' views equal to the pods' snapshots")  # type: ignore[no-any-return]


def totals_agree(stub: pb_grpc.InferenceStub, pods: list[Pod]) -> bool:
    """The router's Status totals against the pods' own Status, the fleet idle: cached blocks (the router's index;
    with nothing running every cached block is free, the pod's count) and free blocks (from the load reports,
    which follow the pod's last request within a heartbeat)."""
    routed = stub.Status(pb.StatusRequest(), metadata=A, timeout=10)
    own = [pod.status() for pod in pods]
    return (routed.num_cached_blocks == sum(s.num_cached_blocks for s in own) > 0
            and routed.num_free_blocks == sum(s.num_free_blocks for s in own)
            and routed.num_total_blocks == sum(s.num_total_blocks for s in own) > 0
            and routed.num_used_blocks == 0)


def follow_through(first: pb_grpc.InferenceStub, second: pb_grpc.InferenceStub, pods: list[Pod], system: str,
                   questions: tuple[str, str]) -> str:
    """A new prefix sent through `first`, then through `second` once both routers caught up: the pod it landed on
    and, at `second`, the prediction equal to the pod's hit. Returns the pod."""
    chunks, placed = generate(first, system + questions[0], max_tokens=4)
    assert chunks[-1].usage.cached_prompt_tokens == int(placed[PREDICTED]) == 0  # a prefix no pod held
    holder = placed[POD]
    assert caught_up([first, second], pods)[holder] >= 15  # the system prompt's blocks, seen by both
    chunks, followed = generate(second, system + questions[1], max_tokens=4)
    usage = chunks[-1].usage
    assert followed[POD] == holder, json.dumps([followed, router_pods(second), router_pods(first)])
    assert usage.cached_prompt_tokens >= 60  # most of the shared system prompt
    assert int(followed[PREDICTED]) == usage.cached_prompt_tokens
    return holder


def test_two_replicas_route_by_the_same_state_and_a_restarted_one_recovers_it(
        pods: list[Pod], tiny_chat_model_dir: Path, secrets_dir: Path) -> None:
    with router(pods, tiny_chat_model_dir, secrets_dir) as (_, stub_a, _):
        with router(pods, tiny_chat_model_dir, secrets_dir) as (_, stub_b, metrics_b):
            holder = follow_through(stub_a, stub_b, pods, SYSTEM_PROMPTS[0],
                                    ("Who founded the city?", "When did it fall?"))
            follow_through(stub_b, stub_a, pods, SYSTEM_PROMPTS[1],  # and the other way round
                           ("Who founded the city?", "When did it fall?"))
            views = caught_up([stub_a, stub_b], pods)
            for stub in (stub_a, stub_b):
                wait_for(lambda s=stub: totals_agree(s, pods), "the router's Status totals equal to the pods'")
                assert stub.Status(pb.StatusRequest(), metadata=A, timeout=10).num_cached_blocks == sum(
                    views.values())
            predicted = metric(metrics_b, "pagedserve_router_predicted_cached_tokens_total")
            assert predicted == metric(metrics_b, "pagedserve_router_reported_cached_tokens_total") > 0
        # B restarted: a new process, its index empty until the pods' snapshots, while A routes on
        chunks, meanwhile = generate(stub_a, SYSTEM_PROMPTS[0] + "Who ruled it last?", max_tokens=4)
        assert meanwhile[POD] == holder
        assert int(meanwhile[PREDICTED]) == chunks[-1].usage.cached_prompt_tokens >= 60
        with router(pods, tiny_chat_model_dir, secrets_dir) as (_, stub_b, metrics_b):
            rebuilt = caught_up([stub_a, stub_b], pods)
            assert rebuilt[holder] >= views[holder]  # the prefix and A's request meanwhile
            chunks, again = generate(stub_b, SYSTEM_PROMPTS[0] + "What was its language?", max_tokens=4)
            assert again[POD] == holder
            assert int(again[PREDICTED]) == chunks[-1].usage.cached_prompt_tokens >= 60
            wait_for(lambda: totals_agree(stub_b, pods), "the restarted router's Status totals equal to the pods'")
