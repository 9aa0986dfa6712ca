"""`pagedserve router` in front of two real pods (`pagedserve serve`, the tiny chat model, a small KV cache), all
real processes on loopback, under mutual TLS on both sides of the router, API keys and the fleet's shared
cache-salt secret: requests spread over one client channel, the prefix followed to the pod that holds it with the
router's prediction equal to the pod's reported `Usage.cached_prompt_tokens`, streams passed through, the caller's
trace continued through the router into the pod (a real OTLP receiver), cancellation and deadlines, a pod of
another cache identity refused, a pod killed mid-request, and a fleet with no pod. Each pod runs one sequence at
a time (`--max-num-seqs 1`), so a request can be held before its first token by a long one ahead of it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from polling import free_port, wait_for
from stack_testing import Pod
from tls_testing import Certs, make_certs

from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.services.common.processes import ServiceProcess, start_service, stop_service, wait_serving

KEY_A, KEY_B, ROUTER_KEY = "alpha-key-0123456789abcdef", "beta-key-0123456789abcdef", "router-key-0123456789abcdef"
A, B = (("authorization", f"Bearer {KEY_A}"),), (("x-api-key", KEY_B),)
SYSTEM_PROMPTS = [f"{topic} history desk. You answer every question about the history of {topic} in full sentences, "
                  "citing the sources you know, in no more than three paragraphs, and you say so when the sources "
                  "disagree or when nothing is known for certain. Dates are given in the common era, names as the "
                  "standard reference works spell them, and places with their modern names beside the ancient ones. "
                  for topic in ("Rome", "Carthage", "Byzantium")]  # ~90 tokens: 20-odd blocks of 4


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("router-secrets")
    (path / "api-keys").write_text(f"{KEY_A} alpha\n{KEY_B} beta\n{ROUTER_KEY} router\n")
    (path / "salt-secret").write_bytes(os.urandom(32))
    (path / "router-key").write_text(ROUTER_KEY + "\n")
    (path / "certs").mkdir()
    make_certs(path / "certs")
    return path


def certs_in(secrets_dir: Path) -> Certs:
    """The test CA's certificates (tls_testing.make_certs' files): the pods and the router serve mutual TLS."""
    folder = secrets_dir / "certs"
    return Certs(*(folder / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                              "stranger.pem", "stranger.key")))


def tls_flags(secrets_dir: Path) -> list[str]:
    certs = certs_in(secrets_dir)
    return ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca)]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: the spans every process of the module exports."""

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

    def find(self, service: str, name: str, trace_id: str) -> list[Any]:
        with self.lock:
            return [s for svc, s in self.spans if svc == service and s.name == name and s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, dict[str, str]]]:
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
                     "OTEL_BSP_SCHEDULE_DELAY": "200"}
    server.stop(None)


@pytest.fixture(scope="module")
def pods(tiny_chat_model_dir: Path, secrets_dir: Path, receiver: tuple[Receiver, dict[str, str]]
         ) -> Iterator[list[Pod]]:
    flags = ["--num-blocks", "256", "--max-num-seqs", "1", "--api-keys-file", str(secrets_dir / "api-keys"),
             "--cache-salt-secret-file", str(secrets_dir / "salt-secret"), *tls_flags(secrets_dir)]
    credentials = certs_in(secrets_dir).client()
    with ThreadPoolExecutor(2) as starting:  # the two model loads overlap
        started = list(starting.map(lambda _: Pod(tiny_chat_model_dir, *flags, metadata=A, env=receiver[1],
                                                  credentials=credentials), range(2)))
    yield started
    for pod in started:
        if pod.proc.poll() is None:
            output = pod.stop()
            assert pod.proc.returncode == 0, output


@contextmanager
def router(pods: list[Pod], model: Path | None, secrets_dir: Path, policy: str = "kv-aware",
           endpoints: str | None = None, until_serving: bool = True
           ) -> Iterator[tuple[ServiceProcess, pb_grpc.InferenceStub, int]]:
    """`model` None: the router learns its tokenizer from the pods. Mutual TLS on both sides of the router."""
    certs = certs_in(secrets_dir)
    metrics_port = free_port()
    args = ["router", "--endpoints", ",".join(p.address for p in pods) if endpoints is None else endpoints,
            *(["--model", str(model)] if model else []), "--policy", policy, "--metrics-port", str(metrics_port),
            "--api-keys-file", str(secrets_dir / "api-keys"), "--cache-salt-secret-file",
            str(secrets_dir / "salt-secret"), "--pod-api-key-file", str(secrets_dir / "router-key"),
            *tls_flags(secrets_dir), "--pod-tls-ca", str(certs.ca), "--pod-tls-cert", str(certs.client_cert),
            "--pod-tls-key", str(certs.client_key)]
    service = start_service(args, timeout=120, until_serving=False)
    try:
        if until_serving:
            wait_serving(service.address, 120, service.proc, certs.client())
        with grpc.secure_channel(service.address, certs.client()) as channel:  # one connection for every call
            yield service, pb_grpc.InferenceStub(channel), metrics_port
    finally:
        assert stop_service(service) == 0, "".join(service.output)


def generate(stub: pb_grpc.InferenceStub, prompt: str, metadata: Any = A, **params: Any
             ) -> tuple[list[pb.GenerateResponse], dict[str, str]]:
    call = stub.Generate(pb.GenerateRequest(text=prompt, params=pb.GenerationParameters(**params)), timeout=120,
                         metadata=metadata)
    chunks = list(call)
    return chunks, dict(call.trailing_metadata())


def router_pods(stub: pb_grpc.InferenceStub) -> dict[str, dict[str, Any]]:
    _, call = stub.Status.with_call(pb.StatusRequest(), metadata=A, timeout=10)
    return {view["pod"]: view for view in json.loads(dict(call.trailing_metadata())["pagedserve-router-pods"])}


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_one_client_channel_spreads_requests(pods: list[Pod], tiny_chat_model_dir: Path, secrets_dir: Path) -> None:
    for policy in ("round-robin", "least-load"):
        finished = [pod.status().num_requests_finished for pod in pods]
        with router(pods, tiny_chat_model_dir, secrets_dir, policy) as (_, stub, _):
            served = [generate(stub, f"Question {i}: what is {i} plus {i}?", max_tokens=4)[1]["pagedserve-pod"]
                      for i in range(6)]
        if policy == "round-robin":
            assert served[0::2] == [served[0]] * 3 and served[1::2] == [served[1]] * 3 and served[0] != served[1]
        for pod, before in zip(pods, finished, strict=True):  # each pod served what the router says it sent
            assert served.count(pod.address) >= 1, (policy, served)
            assert pod.status().num_requests_finished - before == served.count(pod.address)


def test_kv_aware_follows_the_prefix_and_predicts_the_pods_hits(pods: list[Pod], tiny_chat_model_dir: Path,
                                                               secrets_dir: Path) -> None:
    with router(pods, tiny_chat_model_dir, secrets_dir) as (_, stub, metrics_port):
        for system in SYSTEM_PROMPTS:
            cached_before = {pod: view["cached_blocks"] for pod, view in router_pods(stub).items()}
            first_chunks, first = generate(stub, system + "Who founded the city?", max_tokens=4)
            assert first_chunks[-1].usage.cached_prompt_tokens == int(first["pagedserve-predicted-cached-tokens"]) == 0
            holder = first["pagedserve-pod"]
            # the pod's events reach the router: its view of the holder grows by the prompt's blocks
            grown = cached_before[holder] + 15
            wait_for(lambda h=holder, n=grown: router_pods(stub)[h]["cached_blocks"] >= n,
                     "the holder's blocks at the router")
            chunks, second = generate(stub, system + "When did it fall?", max_tokens=4)
            usage = chunks[-1].usage
            assert second["pagedserve-pod"] == holder
            assert usage.cached_prompt_tokens >= 60  # most of the shared system prompt
            assert int(second["pagedserve-predicted-cached-tokens"]) == usage.cached_prompt_tokens
            # another tenant's namespace: the same text is no hit, and the router knows it
            other_chunks, other = generate(stub, system + "When did it fall?", metadata=B, max_tokens=4)
            assert other_chunks[-1].usage.cached_prompt_tokens == 0 == int(other["pagedserve-predicted-cached-tokens"])
        predicted = metric(metrics_port, "pagedserve_router_predicted_cached_tokens_total")
        assert predicted == metric(metrics_port, "pagedserve_router_reported_cached_tokens_total") > 0
        assert 0 < metric(metrics_port, "pagedserve_router_prefix_hit_rate") < 1
        assert metric(metrics_port, "pagedserve_router_decision_seconds_count") == 9


def test_streams_pass_through_chunk_by_chunk(pods: list[Pod], tiny_chat_model_dir: Path, secrets_dir: Path) -> None:
    prompt = "Once upon a time, in a land far away,"
    params: dict[str, Any] = {"max_tokens": 32, "ignore_eos": True}
    direct, _ = pods[0].generate(prompt, **params)
    request = pb.GenerateRequest(text=prompt, params=pb.GenerationParameters(**params))
    with router(pods, tiny_chat_model_dir, secrets_dir, "round-robin") as (_, stub, _):
        routed, _ = generate(stub, prompt, **params)
        unary = stub.Complete(request, metadata=A, timeout=60)
        # the rest of the API, answered by a pod
        assert stub.ListModels(pb.ListModelsRequest(), metadata=A).models[0].block_size == 4
        assert list(stub.Tokenize(pb.TokenizeRequest(text=prompt), metadata=A).token_ids) == list(
            pods[1].stub.Tokenize(pb.TokenizeRequest(text=prompt), metadata=A).token_ids)
        # the pod's refusals, code and message as the pod words them
        for bad in (pb.GenerateRequest(), pb.GenerateRequest(text="hi", params=pb.GenerationParameters(n=99))):
            with pytest.raises(grpc.RpcError) as direct_error:
                list(pods[0].stub.Generate(bad, metadata=A, timeout=30))
            with pytest.raises(grpc.RpcError) as routed_error:
                list(stub.Generate(bad, metadata=A, timeout=30))
            assert routed_error.value.code() == direct_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert routed_error.value.details() == direct_error.value.details()
        with pytest.raises(grpc.RpcError) as unauthenticated:  # the router checks keys itself
            stub.Complete(request, metadata=(("x-api-key", "not-a-key-0123456789"),), timeout=30)
        assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
    tokens = [t for c in direct for t in c.token_ids]
    assert [t for c in routed for t in c.token_ids] == tokens == list(unary.choices[0].token_ids)  # greedy
    assert "".join(c.text for c in routed) == "".join(c.text for c in direct) == unary.choices[0].text
    assert len(routed) >= 4 and routed[-1].HasField("usage") and routed[-1].usage.completion_tokens == 32


def test_the_callers_trace_continues_through_the_router_into_the_pod(
        pods: list[Pod], tiny_chat_model_dir: Path, secrets_dir: Path, receiver: tuple[Receiver, dict[str, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    spans, env = receiver
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the router's process exports its spans too
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    with router(pods, tiny_chat_model_dir, secrets_dir, "round-robin") as (_, stub, _):
        generate(stub, "Trace me.", metadata=(*A, ("traceparent", f"00-{trace_id}-{parent_id}-01")), max_tokens=2)
    method = "pagedserve.inference.v1.Inference/Generate"
    (served,) = wait_for(lambda: spans.find("pagedserve-router", method, trace_id), "the router's Generate span")
    assert served.parent_span_id.hex() == parent_id  # the caller's span
    (forwarded,) = spans.find("pagedserve-router", "route Generate", trace_id)
    assert forwarded.parent_span_id == served.span_id
    (at_pod,) = wait_for(lambda: spans.find("pagedserve-frontend", method, trace_id), "the pod's Generate span")
    assert at_pod.parent_span_id == forwarded.span_id


def test_a_cancelled_or_late_call_frees_the_pods_blocks(pods: list[Pod], tiny_chat_model_dir: Path,
                                               secrets_dir: Path) -> None:
    with router(pods, tiny_chat_model_dir, secrets_dir, "round-robin") as (_, stub, _):
        call = stub.Generate(pb.GenerateRequest(text="Count to a thousand:", params=pb.GenerationParameters(
            max_tokens=400, ignore_eos=True)), metadata=A, timeout=120)
        next(call), next(call)
        running = [pod for pod in pods if pod.status().num_running == 1]
        assert len(running) == 1  # the pod the router chose is generating
        call.cancel()
        idle = running[0].wait_idle()  # no running sequence, no block held: within the step
        assert idle.num_running == idle.num_used_blocks == 0
        # a deadline passes at the pod too: what is left of the caller's goes with the forwarded call
        with pytest.raises(grpc.RpcError) as late:
            list(stub.Generate(pb.GenerateRequest(text="Count to a thousand:", params=pb.GenerationParameters(
                max_tokens=400, ignore_eos=True)), metadata=A, timeout=0.5))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for pod in pods:
            pod.wait_idle()


def test_a_pod_of_another_cache_identity_is_refused_with_the_fields_named(
        pods: list[Pod], tiny_chat_model_dir: Path, secrets_dir: Path) -> None:
    """The fleet's identity is the first accepted pod's: the odd pod starts after the router is in sync. This
    router learns its tokenizer from the pods (no --model): its predictions hold all the same."""
    odd_port = free_port()
    odd_address = f"127.0.0.1:{odd_port}"
    endpoints = f"{pods[0].address},{odd_address}"
    with router(pods, None, secrets_dir, endpoints=endpoints) as (service, stub, _):
        odd = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", "serve", "--model", str(tiny_chat_model_dir), "--port", str(odd_port),
             "--device", "cpu", "--block-size", "8", "--num-blocks", "32", "--api-keys-file",
             str(secrets_dir / "api-keys"), "--cache-salt-secret-file", str(secrets_dir / "salt-secret"),
             *tls_flags(secrets_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_serving(odd_address, 300, odd, certs_in(secrets_dir).client())  # type: ignore[arg-type]
            view = wait_for(lambda: router_pods(stub)[odd_address] if router_pods(stub)[odd_address]["phase"] ==
                            "refused" else None, "the odd pod refused")
            assert view["reason"] == "another cache identity than the fleet's: block_size: 4 here, 8 there"
            assert any(f"pod {odd_address} refused: another cache identity" in line for line in service.output)
            system = SYSTEM_PROMPTS[0].replace("Rome", "Athens")  # a prefix no other test sends
            cached_before = router_pods(stub)[pods[0].address]["cached_blocks"]
            answers = [generate(stub, system + "Which pod, 0?", max_tokens=2)]
            wait_for(lambda: router_pods(stub)[pods[0].address]["cached_blocks"] >= cached_before + 15,
                     "the pod's new blocks at the router")
            answers += [generate(stub, system + f"Which pod, {i}?", max_tokens=2) for i in (1, 2)]
            assert {metadata["pagedserve-pod"] for _, metadata in answers} == {pods[0].address}
            assert [int(metadata["pagedserve-predicted-cached-tokens"]) for _, metadata in answers] == [
                chunks[-1].usage.cached_prompt_tokens for chunks, _ in answers]
            assert answers[-1][0][-1].usage.cached_prompt_tokens >= 60
        finally:
            odd.send_signal(signal.SIGTERM)
            assert odd.wait(timeout=60) == 0


def test_no_pod_to_route_to_is_unavailable_with_the_reason(tiny_chat_model_dir: Path, secrets_dir: Path) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    with router([], tiny_chat_model_dir, secrets_dir, endpoints=nowhere, until_serving=False) as (service, stub, _):
        health = health_pb2_grpc.HealthStub(grpc.secure_channel(service.address, certs_in(secrets_dir).client()))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as plain:  # the router's public side is TLS only
            health_pb2_grpc.HealthStub(grpc.insecure_channel(service.address)).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, "Hello?")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details().startswith(f"no pod to route to: {nowhere} ")
        wait_for(lambda: router_pods(stub)[nowhere]["phase"] == "down", "the router's view of the pod")
        with pytest.raises(grpc.RpcError, match=r"Connection refused|failed to connect"):
            generate(stub, "Hello?")
    with router([], tiny_chat_model_dir, secrets_dir, endpoints="", until_serving=False) as (_, stub, _):
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListModels(pb.ListModelsRequest(), metadata=A, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == "no pod to route to: the router has no endpoints (--endpoints is empty)"


def kill_pod(pod: Pod) -> None:
    """SIGKILL for the pod's supervisor, then for its three processes (the test started them all): the pod's
    connections drop at once, as when its node goes."""
    pid = pod.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    os.kill(pid, signal.SIGKILL)
    for child in children:
        os.kill(int(child), signal.SIGKILL)
    pod.proc.wait(timeout=30)
    pod.channel.close()


def test_a_killed_pod_costs_only_what_it_was_streaming(pods: list[Pod], tiny_chat_model_dir: Path,
                                                      secrets_dir: Path) -> None:
    """Runs last: it kills a pod of the module's fleet."""
    with router(pods, tiny_chat_model_dir, secrets_dir, "least-load") as (_, stub, metrics_port):
        def occupy(pod: Pod) -> None:  # a long request straight to the pod: it holds the pod's only sequence slot
            with contextlib.suppress(grpc.RpcError):  # the victim's own stream dies with it
                pod.generate("Count slowly to a thousand:", max_tokens=440, ignore_eos=True)

        occupying = [threading.Thread(target=occupy, args=(pod,)) for pod in pods]
        for thread in occupying:
            thread.start()
        wait_for(lambda: all(pod.status().num_running == 1 for pod in pods), "both pods busy")
        result: dict[str, Any] = {}

        def queued() -> None:
            result["chunks"], result["metadata"] = generate(stub, "A question that waits:", max_tokens=4)

        waiting = threading.Thread(target=queued)
        waiting.start()
        victim_address = wait_for(lambda: next((address for address, view in router_pods(stub).items()
                                                if view["in_flight"] == 1), None), "the request at a pod")
        victim = next(pod for pod in pods if pod.address == victim_address)
        wait_for(lambda: victim.status().num_waiting == 1, "the request queued at the pod")  # before its first token
        kill_pod(victim)
        waiting.join(timeout=120)
        survivor = next(pod for pod in pods if pod is not victim)
        assert result["metadata"]["pagedserve-pod"] == survivor.address and result["chunks"][-1].usage.prompt_tokens
        assert metric(metrics_port, "pagedserve_router_retries_total") == 1
        wait_for(lambda: router_pods(stub)[victim.address]["phase"] == "down", "the router noticing")
        served = [generate(stub, f"After the loss, question {i}", max_tokens=2)[1]["pagedserve-pod"] for i in range(3)]
        assert served == [survivor.address] * 3
        for thread in occupying:
            thread.join(timeout=120)
