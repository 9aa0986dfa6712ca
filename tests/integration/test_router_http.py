"""`pagedserve router --http-listen` in front of two real pods that serve HTTP (`pagedserve serve --http-port`, the
tiny chat model, a small KV cache), all real processes on loopback, under mutual TLS on both sides of the router
(HTTPS to the pods with the router's pod certificate), API keys and the fleet's shared cache-salt secret (the
secrets and certificates of test_router.py): the official `openai` client's answers through the router equal the
pod's own, a stream arrives event by event while the pod still generates, the pod's errors pass through as the
pod wrote them, the router refuses a bad key itself, kv-aware follows a prefix with its prediction equal to the
pod's reported cached tokens, a client that leaves mid-stream frees the pod's blocks, no pod to route to is a 503
that says why, the caller's trace continues into the pod (a real OTLP receiver), and a request queued at a pod that
is killed is answered by the other. Each pod runs one sequence at a time (`--max-num-seqs 1`), so a request can be
held before its answer by a long one ahead of it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import ssl
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from polling import free_port, wait_for
from stack_testing import Pod
from test_router import (
    KEY_A,
    KEY_B,
    SYSTEM_PROMPTS,
    A,
    Receiver,
    certs_in,
    kill_pod,
    metric,
    receiver,
    router_pods,
    secrets_dir,
    tls_flags,
)

from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.services.common.processes import ServiceProcess, start_service, stop_service, wait_serving

__all__ = ["receiver", "secrets_dir"]  # test_router.py's fixtures, used here

BAD_KEY = "not-a-listed-key-0123456789"


class HttpPod(Pod):
    """A pod with its HTTPS API on `http_port` too."""

    def __init__(self, model: Path, secrets_dir: Path, env: dict[str, str]) -> None:
        self.http_port = free_port()
        super().__init__(model, "--num-blocks", "256", "--max-num-seqs", "1", "--http-port", str(self.http_port),
                         "--api-keys-file", str(secrets_dir / "api-keys"), "--cache-salt-secret-file",
                         str(secrets_dir / "salt-secret"), *tls_flags(secrets_dir), metadata=A, env=env,
                         credentials=certs_in(secrets_dir).client())
        self.url = f"https://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="module")
def pods(tiny_chat_model_dir: Path, secrets_dir: Path, receiver: tuple[Receiver, dict[str, str]]
         ) -> Iterator[list[HttpPod]]:
    with ThreadPoolExecutor(2) as starting:  # the two model loads overlap
        started = list(starting.map(lambda _: HttpPod(tiny_chat_model_dir, secrets_dir, receiver[1]), range(2)))
    yield started
    for pod in started:
        if pod.proc.poll() is None:  # the last test kills one
            output = pod.stop()
            assert pod.proc.returncode == 0, output


def client_tls(secrets_dir: Path) -> ssl.SSLContext:
    """The test client's side of mutual TLS: the CA, and the client certificate the router and pods ask for."""
    certs = certs_in(secrets_dir)
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    return context


class Router:
    """A running router: its HTTPS base URL, and a gRPC stub for its Status (the router's view of the pods)."""

    def __init__(self, service: ServiceProcess, url: str, stub: pb_grpc.InferenceStub, metrics_port: int,
                 tls: ssl.SSLContext) -> None:
        self.service, self.url, self.stub, self.metrics_port, self.tls = service, url, stub, metrics_port, tls

    def openai(self, url: str | None = None, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url or self.url}/v1", api_key=key, max_retries=0, timeout=120,
                             http_client=openai.DefaultHttpxClient(verify=self.tls))

    def connection(self, url: str | None = None) -> http.client.HTTPSConnection:
        host, port = (url or self.url).removeprefix("https://").rsplit(":", 1)
        return http.client.HTTPSConnection(host, int(port), context=self.tls, timeout=120)

    def post(self, path: str, body: dict[str, Any], key: str = KEY_A, url: str | None = None
             ) -> tuple[int, dict[str, str], bytes]:
        """A plain HTTPS POST: the status, the headers and the answer's bytes, errors included."""
        connection = self.connection(url)
        try:
            connection.request("POST", path, json.dumps(body), {"authorization": f"Bearer {key}",
                                                                "content-type": "application/json"})
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def get(self, path: str) -> tuple[int, bytes]:
        connection = self.connection()
        try:
            connection.request("GET", path, headers={"authorization": f"Bearer {KEY_A}"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


@contextmanager
def router(pods: list[HttpPod], model: Path, secrets_dir: Path, policy: str = "kv-aware",
           endpoints: str | None = None, until_serving: bool = True, extra: tuple[str, ...] = ()) -> Iterator[Router]:
    certs = certs_in(secrets_dir)
    http_port, metrics_port = free_port(), free_port()
    args = ["router", "--endpoints", ",".join(p.address for p in pods) if endpoints is None else endpoints,
            "--model", str(model), "--policy", policy, "--http-listen", f"127.0.0.1:{http_port}",
            "--metrics-port", str(metrics_port), "--api-keys-file", str(secrets_dir / "api-keys"),
            "--cache-salt-secret-file", str(secrets_dir / "salt-secret"), "--pod-api-key-file",
            str(secrets_dir / "router-key"), *tls_flags(secrets_dir), "--pod-tls-ca", str(certs.ca),
            "--pod-tls-cert", str(certs.client_cert), "--pod-tls-key", str(certs.client_key), *extra]
    service = start_service(args, timeout=120, until_serving=False)
    try:
        # the HTTP listener starts just after the gRPC one, whose address start_service waited for
        wait_for(lambda: any(f"also listening on https://127.0.0.1:{http_port}" in line for line in service.output),
                 "the router's HTTP listener")
        if until_serving:
            wait_serving(service.address, 120, service.proc, certs.client())
        with grpc.secure_channel(service.address, certs.client()) as channel:
            yield Router(service, f"https://127.0.0.1:{http_port}", pb_grpc.InferenceStub(channel), metrics_port,
                         client_tls(secrets_dir))
    finally:
        assert stop_service(service) == 0, "".join(service.output)
    assert "Traceback" not in "".join(service.output), "".join(service.output)


def metrics_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def model_name(pod: HttpPod) -> str:
    return str(pod.stub.ListModels(pb.ListModelsRequest(), metadata=A).models[0].name)


def events(body: bytes) -> list[bytes]:
    return [event.removeprefix(b"data: ") for event in body.split(b"\n\n") if event]


def test_answers_through_the_router_equal_the_pods_own(pods: list[HttpPod], tiny_chat_model_dir: Path,
                                                       secrets_dir: Path) -> None:
    """The openai client, through the router and straight to a pod: the same greedy text, the same models list."""
    name = model_name(pods[0])
    for pod in pods:  # what tells the router where a pod serves HTTP
        assert pod.stub.ListModels(pb.ListModelsRequest(), metadata=A).models[0].http_port == pod.http_port
    params: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Tell me about Rome."}]
    with router(pods, tiny_chat_model_dir, secrets_dir, "round-robin") as routed:
        direct = routed.openai(pods[0].url)
        through = routed.openai()
        raw = through.completions.with_raw_response.create(model=name, prompt="Once upon a time,", **params)
        completion = raw.parse()
        assert raw.headers["x-pagedserve-pod"] in {pod.address for pod in pods}
        assert raw.headers["x-pagedserve-predicted-cached-tokens"] == "0"
        assert completion.choices[0].text == direct.completions.create(
            model=name, prompt="Once upon a time,", **params).choices[0].text
        chat = through.chat.completions.create(model=name, messages=messages, **params)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == direct.chat.completions.create(
            model=name, messages=messages, **params).choices[0].message.content  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.completion_tokens == 12
        assert [m.id for m in through.models.list()] == [m.id for m in direct.models.list()] == [name]
        status, health = routed.get("/health")
        assert status == 200 and json.loads(health) == {"status": "serving"}
    for pod in pods:
        pod.wait_idle()


def test_a_stream_arrives_event_by_event(pods: list[HttpPod], tiny_chat_model_dir: Path, secrets_dir: Path) -> None:
    """The first events reach the client while the pod is still generating (nothing buffered at the router), and
    the whole stream is the pod's: its text equals a direct stream's, its usage event counted by the router."""
    body = {"prompt": "Count to a hundred:", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with router(pods, tiny_chat_model_dir, secrets_dir, "round-robin") as routed:
        connection = routed.connection()
        connection.request("POST", "/v1/completions", json.dumps(body), {"authorization": f"Bearer {KEY_A}"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("content-type", "").startswith("text/event-stream")
        pod = next(p for p in pods if p.address == response.getheader("x-pagedserve-pod"))
        first = [response.readline() for _ in range(4)]  # two events, each a data line and a blank one
        assert first[0].startswith(b"data: {") and first[2].startswith(b"data: {"), first
        assert pod.status().num_running == 1  # still generating: the events were not held back until the end
        rest = response.read()
        connection.close()
        streamed = events(b"".join(first) + rest)
        assert streamed[-1] == b"[DONE]" and len(streamed) >= 10
        chunks = [json.loads(event) for event in streamed[:-1]]
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 64
        wait_for(lambda: metric(routed.metrics_port, "pagedserve_router_prompt_tokens_total") == usage["prompt_tokens"],
                 "the stream's usage counted at the router")
        status, _, direct = routed.post("/v1/completions", body, url=pod.url)
        assert status == 200
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == "".join(json.loads(e)["choices"][0]["text"] for e in events(direct)[:-1]
                               if json.loads(e)["choices"])
    pod.wait_idle()


def test_the_pods_errors_pass_through_and_the_router_checks_keys(pods: list[HttpPod], tiny_chat_model_dir: Path,
                                                                 secrets_dir: Path) -> None:
    with router(pods, tiny_chat_model_dir, secrets_dir, "round-robin") as routed:
        image = {"role": "user", "content": [{"type": "image_url"}]}
        for path, bad in (("/v1/completions", {"prompt": "hi", "n": 99}),
                          ("/v1/completions", {"prompt": "hi", "presence_penalty": 1.0}),
                          ("/v1/chat/completions", {"messages": [image]}),
                          ("/v1/completions", {"prompt": "hi", "model": "another-model"})):
            status, headers, answer = routed.post(path, bad)
            direct_status, _, direct_answer = routed.post(path, bad, url=pods[0].url)
            assert status == direct_status and status in (400, 404), answer
            assert json.loads(answer) == json.loads(direct_answer) and headers["x-pagedserve-pod"]
        with pytest.raises(openai.BadRequestError, match="n: "):
            routed.openai().completions.create(model="", prompt="hi", n=99)
        status, headers, answer = routed.post("/v1/completions", {"prompt": "hi"}, key=BAD_KEY)
        assert status == 401 and "x-pagedserve-pod" not in headers  # refused here: no pod saw it
        assert json.loads(answer)["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            routed.openai(key=BAD_KEY).models.list()
        status, _, answer = routed.post("/v1/completions", {"prompt": "x" * (5 << 20)})
        assert status == 413 and "larger than this server's limit" in json.loads(answer)["error"]["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_kv_aware_follows_the_prefix_and_predicts_the_pods_hits(pods: list[HttpPod], tiny_chat_model_dir: Path,
                                                               secrets_dir: Path, chat: bool) -> None:
    def send(question: str, key: str = KEY_A) -> tuple[str, int, int]:
        system = SYSTEM_PROMPTS[2 if chat else 1].replace("history", "HTTP history")  # no other test's prefix
        body: dict[str, Any] = ({"messages": [{"role": "system", "content": system},
                                              {"role": "user", "content": question}]} if chat
                                else {"prompt": system + question})
        status, headers, answer = routed.post("/v1/chat/completions" if chat else "/v1/completions",
                                              {**body, "max_tokens": 2}, key=key)
        assert status == 200, answer
        cached = json.loads(answer)["usage"]["prompt_tokens_details"]["cached_tokens"]
        return headers["x-pagedserve-pod"], int(headers["x-pagedserve-predicted-cached-tokens"]), cached

    with router(pods, tiny_chat_model_dir, secrets_dir) as routed:
        cached_before = {pod: view["cached_blocks"] for pod, view in router_pods(routed.stub).items()}
        holder, predicted, cached = send("Who founded the city?")
        assert predicted == cached == 0
        wait_for(lambda: router_pods(routed.stub)[holder]["cached_blocks"] >= cached_before[holder] + 15,
                 "the holder's blocks at the router")
        pod, predicted, cached = send("When did it fall?")
        assert pod == holder and cached >= 60 and predicted == cached
        _, predicted, cached = send("When did it fall?", key=KEY_B)  # another tenant: no hit, and the router knows
        assert predicted == cached == 0
        assert metric(routed.metrics_port, "pagedserve_router_predicted_cached_tokens_total") == metric(
            routed.metrics_port, "pagedserve_router_reported_cached_tokens_total") > 0


def test_a_client_that_leaves_mid_stream_frees_the_pods_blocks(pods: list[HttpPod], tiny_chat_model_dir: Path,
                                                               secrets_dir: Path) -> None:
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with router(pods, tiny_chat_model_dir, secrets_dir, "round-robin") as routed:
        finished = {pod.address: pod.status().num_requests_finished for pod in pods}
        connection = routed.connection()
        connection.request("POST", "/v1/completions", json.dumps(body), {"authorization": f"Bearer {KEY_A}"})
        response = connection.getresponse()
        pod = next(p for p in pods if p.address == response.getheader("x-pagedserve-pod"))
        assert response.readline().startswith(b"data: {")
        assert pod.status().num_used_blocks > 0
        assert connection.sock is not None
        connection.sock.close()
        connection.close()
        idle = pod.wait_idle()  # no running sequence, no block held
        assert idle.num_running == idle.num_used_blocks == 0
        assert pod.status().num_requests_finished == finished[pod.address]  # aborted, never finished
        cancelled = f'pagedserve_router_requests_total{{code="CANCELLED",pod="{pod.address}"}} 1.0'
        wait_for(lambda: cancelled in metrics_text(routed.metrics_port), "the router's request ended, cancelled")
        assert router_pods(routed.stub)[pod.address]["in_flight"] == 0


def test_the_pods_certificate_is_checked_against_the_server_name_given(pods: list[HttpPod], tiny_chat_model_dir: Path,
                                                                       secrets_dir: Path) -> None:
    """`--pod-tls-server-name` replaces the dialled address in the check of the pods' certificate, over gRPC and
    HTTPS: the name it lists (localhost) is served; a name it does not list leaves every pod unreachable."""
    name = model_name(pods[0])
    with router(pods, tiny_chat_model_dir, secrets_dir, extra=("--pod-tls-server-name", "localhost")) as routed:
        assert routed.openai().completions.create(model=name, prompt="Hello", max_tokens=2).usage is not None
    with router(pods, tiny_chat_model_dir, secrets_dir, until_serving=False,
                extra=("--pod-tls-server-name", "not-the-pods.example")) as routed:
        wait_for(lambda: all(p["phase"] == "down" for p in router_pods(routed.stub).values()),
                 "every pod down for the router")
        assert all("Hostname Verification Check failed" in p["reason"]
                   for p in router_pods(routed.stub).values()), router_pods(routed.stub)
        status, body = routed.get("/health")
        assert status == 503, body


def test_no_pod_to_route_to_is_a_503_that_says_why(pods: list[HttpPod], tiny_chat_model_dir: Path,
                                                   secrets_dir: Path) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    with router([], tiny_chat_model_dir, secrets_dir, endpoints=nowhere, until_serving=False) as routed:
        status, health = routed.get("/health")
        assert status == 503 and json.loads(health)["reason"].startswith(f"no pod to route to: {nowhere} ")
        status, _, answer = routed.post("/v1/completions", {"prompt": "Hello?"})
        error = json.loads(answer)["error"]
        assert status == 503 and error["message"].startswith(f"no pod to route to: {nowhere} ")
        assert error["type"] == "server_error"
        with pytest.raises(openai.InternalServerError, match="no pod to route to"):
            routed.openai().models.list()
    plain = Pod(tiny_chat_model_dir, "--num-blocks", "32", "--api-keys-file", str(secrets_dir / "api-keys"),
                "--cache-salt-secret-file", str(secrets_dir / "salt-secret"), *tls_flags(secrets_dir), metadata=A,
                credentials=certs_in(secrets_dir).client())  # gRPC only: no --http-port
    try:
        assert plain.stub.ListModels(pb.ListModelsRequest(), metadata=A).models[0].http_port == 0
        with router([plain], tiny_chat_model_dir, secrets_dir) as routed:
            status, _, answer = routed.post("/v1/completions", {"prompt": "Hello?"})
            assert status == 503
            assert json.loads(answer)["error"]["message"] == (
                f"no pod to route to: no routable pod serves the HTTP API ({plain.address}: started without "
                "--http-listen)")
            assert routed.get("/health")[0] == 503
    finally:
        output = plain.stop()
        assert plain.proc.returncode == 0, output


def test_the_callers_trace_continues_through_the_router_into_the_pod(
        pods: list[HttpPod], tiny_chat_model_dir: Path, secrets_dir: Path, receiver: tuple[Receiver, dict[str, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    spans, env = receiver
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the router's process exports its spans too
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    with router(pods, tiny_chat_model_dir, secrets_dir, "round-robin") as routed:
        connection = routed.connection()
        connection.request("POST", "/v1/completions", json.dumps({"prompt": "Trace me.", "max_tokens": 2}),
                           {"authorization": f"Bearer {KEY_A}", "traceparent": f"00-{trace_id}-{parent_id}-01"})
        assert connection.getresponse().status == 200
        connection.close()
    (served,) = wait_for(lambda: spans.find("pagedserve-router", "POST /v1/completions", trace_id),
                         "the router's HTTP span")
    assert served.parent_span_id.hex() == parent_id  # the caller's span
    (forwarded,) = spans.find("pagedserve-router", "route POST /v1/completions", trace_id)
    assert forwarded.parent_span_id == served.span_id
    (at_pod,) = wait_for(lambda: spans.find("pagedserve-frontend", "POST /v1/completions", trace_id),
                         "the pod's HTTP span")
    assert at_pod.parent_span_id == forwarded.span_id


def test_a_request_waiting_at_a_killed_pod_is_retried_elsewhere(pods: list[HttpPod], tiny_chat_model_dir: Path,
                                                                secrets_dir: Path) -> None:
    """Runs last: it kills a pod of the module's fleet. The request is queued there (each pod's one sequence slot
    is taken by a long request sent straight to it), so the pod's connection drops before any byte of its answer."""
    with router(pods, tiny_chat_model_dir, secrets_dir, "least-load") as routed:
        def occupy(pod: HttpPod) -> None:
            with contextlib.suppress(grpc.RpcError):  # the victim's own stream dies with it
                pod.generate("Count slowly to a thousand:", max_tokens=440, ignore_eos=True)

        occupying = [threading.Thread(target=occupy, args=(pod,)) for pod in pods]
        for thread in occupying:
            thread.start()
        wait_for(lambda: all(pod.status().num_running == 1 for pod in pods), "both pods busy")
        result: dict[str, Any] = {}
        waiting = threading.Thread(target=lambda: result.update(answer=routed.post(
            "/v1/completions", {"prompt": "A question that waits:", "max_tokens": 4})))
        waiting.start()
        victim_address = wait_for(lambda: next((address for address, view in router_pods(routed.stub).items()
                                                if view["in_flight"] == 1), None), "the request at a pod")
        victim = next(pod for pod in pods if pod.address == victim_address)
        wait_for(lambda: victim.status().num_waiting == 1, "the request queued at the pod")  # before its answer
        kill_pod(victim)
        waiting.join(timeout=120)
        status, headers, answer = result["answer"]
        survivor = next(pod for pod in pods if pod is not victim)
        assert status == 200 and headers["x-pagedserve-pod"] == survivor.address, answer
        assert json.loads(answer)["usage"]["completion_tokens"] == 4
        assert metric(routed.metrics_port, "pagedserve_router_retries_total") == 1
        for thread in occupying:
            thread.join(timeout=120)
