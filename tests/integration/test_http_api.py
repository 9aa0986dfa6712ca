"""The OpenAI-compatible HTTP API through a real pod (`pagedserve serve --http-port`), with the official `openai`
client (sync and async, streaming and not, chat and completion) and with plain HTTP for the error shapes: the
same engine as gRPC (greedy and seeded text equal), the same keys, tenants and stream limits, and a client
that leaves frees its blocks at once.

One pod serves the whole module: two tenants, four streams each, a 64 KiB body limit. `bench serve --openai-url`
runs against it too, and `bench serve --peer-url` takes it as the peer."""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from polling import free_port
from stack_testing import PROMPTS, Pod

from pagedserve.protos import inference_pb2 as pb

KEY_A, KEY_B = "alpha-key-0123456789abcdef", "beta-key-0123456789abcdef"
A = [("authorization", f"Bearer {KEY_A}")]
MAX_BODY = 64 * 1024
MAX_STREAMS = 4
LONG_PROMPT = "A prompt long enough to fill several KV blocks of four tokens, sent twice by one tenant. " * 4


@pytest.fixture(scope="module")
def pod(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY_A} alpha\n{KEY_B} beta\n")
    http_port = free_port()
    pod = Pod(tiny_chat_model_dir, "--num-blocks", "256", "--http-port", str(http_port), "--api-keys-file", str(keys),
              "--max-streams-per-tenant", str(MAX_STREAMS), "--max-message-bytes", str(MAX_BODY), metadata=A)
    pod.http = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    yield pod
    output = pod.stop()
    assert pod.proc.returncode == 0, output
    assert f"OpenAI-compatible HTTP API on http://127.0.0.1:{http_port}/v1" in output, output
    assert "Traceback" not in output, output


def client(pod: Pod, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pod.http}/v1", api_key=key, max_retries=0, timeout=120)  # type: ignore[attr-defined]


def model(pod: Pod) -> str:
    return str(pod.stub.ListModels(pb.ListModelsRequest(), metadata=A).models[0].name)


def post(pod: Pod, path: str, body: bytes | dict[str, Any], key: str | None = KEY_A) -> tuple[int, dict[str, Any]]:
    """A plain HTTP POST (no client library): the status and the JSON answer, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{pod.http}{path}", data=data, headers=headers)  # type: ignore[attr-defined]
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_completion_and_chat_with_the_openai_client(pod: Pod) -> None:
    c = client(pod)
    assert [m.id for m in c.models.list()] == [model(pod)]
    done = c.completions.create(model=model(pod), prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                extra_body={"ignore_eos": True})
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    assert done.choices[0].finish_reason == "length" and done.choices[0].text
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert done.usage.total_tokens == done.usage.prompt_tokens + 8
    chat = c.chat.completions.create(model=model(pod), messages=[{"role": "user", "content": "Hello!"}],
                                     max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    tokenized = pod.stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(
        role="user", content="Hello!")])), metadata=A).token_ids
    assert chat.usage is not None and chat.usage.prompt_tokens == len(tokenized)
    pod.wait_idle()


def test_greedy_text_over_http_equals_grpc(pod: Pod) -> None:
    c = client(pod)
    for prompt in PROMPTS[:3]:
        chunks, texts = pod.generate(prompt, max_tokens=16, ignore_eos=True)
        over_http = c.completions.create(model=model(pod), prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert over_http.choices[0].text == texts[0]
        assert over_http.usage is not None and over_http.usage.completion_tokens == chunks[-1].usage.completion_tokens
        streamed = c.completions.create(model=model(pod), prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == texts[0]
    chat = pb.Chat(messages=[pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user",
                                                                                                content="Hi")])
    over_grpc = pod.stub.Complete(pb.GenerateRequest(chat=chat, params=pb.GenerationParameters(
        max_tokens=12, ignore_eos=True)), metadata=A)
    over_http_chat = c.chat.completions.create(
        model=model(pod), messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert over_http_chat.choices[0].message.content == over_grpc.choices[0].text
    pod.wait_idle()


def test_parallel_samples_seeds_and_stop_strings_as_on_grpc(pod: Pod) -> None:
    c = client(pod)
    _, grpc_texts = pod.generate(PROMPTS[1], max_tokens=10, temperature=1.0, seed=7, n=3, ignore_eos=True)
    sampled = c.completions.create(model=model(pod), prompt=PROMPTS[1], max_tokens=10, temperature=1.0, seed=7, n=3,
                                   extra_body={"ignore_eos": True})
    assert {choice.index: choice.text for choice in sampled.choices} == grpc_texts  # sample i draws with seed + i
    assert len(set(grpc_texts.values())) == 3
    full = c.completions.create(model=model(pod), prompt=PROMPTS[2], max_tokens=30, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:14]
    for stops in (stop, [stop, "never appears"]):
        stopped = c.completions.create(model=model(pod), prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=stops,
                                       extra_body={"ignore_eos": True})
        assert stopped.choices[0].text == full[: full.index(stop)] and stopped.choices[0].finish_reason == "stop"
    pod.wait_idle()


def test_usage_reports_cached_tokens_of_a_repeated_long_prompt(pod: Pod) -> None:
    c = client(pod)
    prompt = f"{uuid.uuid4().hex} {LONG_PROMPT}"  # cold, whatever ran before
    cold = c.completions.create(model=model(pod), prompt=prompt, max_tokens=4, temperature=0)
    warm = c.completions.create(model=model(pod), prompt=prompt, max_tokens=4, temperature=0)
    assert cold.usage is not None and warm.usage is not None
    assert cold.usage.prompt_tokens_details is not None and warm.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < warm.usage.prompt_tokens_details.cached_tokens < warm.usage.prompt_tokens
    assert warm.choices[0].text == cold.choices[0].text
    other_tenant = client(pod, KEY_B).completions.create(model=model(pod), prompt=prompt, max_tokens=4, temperature=0)
    assert other_tenant.usage is not None and other_tenant.usage.prompt_tokens_details is not None
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0  # tenants own their cache, as on gRPC


def test_an_x_cache_salt_header_splits_the_tenant_s_cache_over_http(pod: Pod) -> None:
    """The header reaches the salt as gRPC's metadata does: the same salt hits, another one (or none) misses,
    and another tenant's call with the same salt misses too."""
    prompt = f"{uuid.uuid4().hex} {LONG_PROMPT}"  # cold, whatever ran before

    def cached(salt: str | None, key: str = KEY_A) -> int:
        headers = {"x-cache-salt": salt} if salt is not None else {}
        done = client(pod, key).completions.create(model=model(pod), prompt=prompt, max_tokens=4, temperature=0,
                                                   extra_headers=headers)
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        return done.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("team-1") == 0
    assert cached("team-1") > 0
    assert cached("team-2") == 0 and cached(None) == 0
    assert cached("team-1", KEY_B) == 0
    pod.wait_idle()


def test_async_streams_with_n_and_usage(pod: Pod) -> None:
    async def run() -> tuple[dict[int, str], Any, dict[int, str]]:
        c = openai.AsyncOpenAI(base_url=f"{pod.http}/v1", api_key=KEY_A, max_retries=0)  # type: ignore[attr-defined]
        texts: dict[int, str] = {}
        usage = None
        finish: dict[int, str] = {}
        stream = await c.chat.completions.create(
            model=model(pod), messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8, n=2,
            temperature=1.0, seed=3, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
        await c.close()
        return texts, usage, finish

    texts, usage, finish = asyncio.run(run())
    assert set(texts) == {0, 1} and all(texts.values()) and finish == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 16
    pod.wait_idle()


def test_logprobs_in_both_shapes(pod: Pod) -> None:
    c = client(pod)
    done = c.completions.create(model=model(pod), prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2,
                                extra_body={"ignore_eos": True})
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == 4 and "".join(logprobs.tokens) == done.choices[0].text
    assert logprobs.top_logprobs is not None and all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    greedy_first = max(logprobs.top_logprobs[0].values())
    assert logprobs.token_logprobs[0] == pytest.approx(greedy_first)  # greedy: the chosen token is the top one
    chat = c.chat.completions.create(model=model(pod), messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                     logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(bytes(t.bytes or []).decode() == t.token for t in content)


def test_errors_raise_the_openai_client_s_exceptions(pod: Pod) -> None:
    c = client(pod)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=model(pod), prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="presence_penalty: not supported"):
        c.chat.completions.create(model=model(pod), messages=[{"role": "user", "content": "hi"}], presence_penalty=1)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        c.completions.create(model="gpt-5", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        client(pod, "not-a-key-0123456789").completions.create(model=model(pod), prompt="hi")
    with pytest.raises(openai.BadRequestError, match="KV blocks"):  # can never fit: 400, not a retryable 429
        c.completions.create(model=model(pod), prompt="hi", max_tokens=500, n=3)
    with pytest.raises(openai.BadRequestError, match="stop"):  # raised before the stream starts: a status, not an event
        next(iter(c.completions.create(model=model(pod), prompt="hi", stop=[""], stream=True)))


PLAIN_ERRORS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-5"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), PLAIN_ERRORS)
def test_plain_http_errors_have_openai_s_shape_and_status(
    pod: Pod, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    got, answer = post(pod, path, body)
    assert got == status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["param"] == param and answer["error"]["message"].startswith(param), answer
    assert "Traceback" not in answer["error"]["message"]


def test_keys_bodies_paths_and_health_over_plain_http(pod: Pod) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    for key in (None, "not-a-key-0123456789", KEY_A[:-1]):
        status, answer = post(pod, "/v1/completions", body, key)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer
        assert "Traceback" not in json.dumps(answer)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{pod.http}/v1/models", timeout=30)  # type: ignore[attr-defined]
    assert info.value.code == 401
    assert post(pod, "/v1/completions", b"{not json")[0] == 400
    status, answer = post(pod, "/v1/completions", {"prompt": "x" * MAX_BODY})
    assert status == 413 and "limit" in answer["error"]["message"], answer
    status, answer = post(pod, "/v1/nowhere", body)
    assert status == 404 and set(answer["error"]) == {"message", "type", "param", "code"}
    with urllib.request.urlopen(f"{pod.http}/health", timeout=30) as health:  # type: ignore[attr-defined]
        assert health.status == 200 and json.loads(health.read()) == {"status": "serving"}
    assert post(pod, "/v1/completions", body, KEY_B)[0] == 200


def test_the_stream_limit_counts_both_doors(pod: Pod) -> None:
    """gRPC streams of tenant alpha fill its limit: its HTTP request is refused (429), beta's is not."""
    request = pb.GenerateRequest(text=PROMPTS[3], params=pb.GenerationParameters(max_tokens=200, ignore_eos=True))
    calls = [pod.stub.Generate(request, metadata=A) for _ in range(MAX_STREAMS)]
    for call in calls:
        next(call)
    with pytest.raises(openai.RateLimitError, match="requests in flight"):
        client(pod).completions.create(model=model(pod), prompt="hi", max_tokens=2)
    status, answer = post(pod, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded", answer
    assert client(pod, KEY_B).completions.create(model=model(pod), prompt="hi", max_tokens=2).choices
    for call in calls:
        call.cancel()
    pod.wait_idle()
    assert client(pod).completions.create(model=model(pod), prompt="hi", max_tokens=2).choices


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks_at_once(pod: Pod, stream: bool) -> None:
    """Two samples of 480 tokens take seconds on this model; the client leaves early: the request is aborted
    (never counted as finished) and the pod is back at 0 used blocks."""
    finished = pod.status().num_requests_finished
    connection = http.client.HTTPConnection(pod.http.removeprefix("http://"), timeout=60)  # type: ignore[attr-defined]
    body = {"prompt": PROMPTS[3], "max_tokens": 480, "n": 2, "ignore_eos": True, "stream": stream}
    connection.request("POST", "/v1/completions", json.dumps(body), {"authorization": f"Bearer {KEY_A}"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("content-type", "").startswith("text/event-stream")
        events = [response.readline() for _ in range(4)]
        assert all(e.startswith(b"data: {") for e in events[::2]), events
    else:
        deadline = time.monotonic() + 30
        while pod.status().num_running == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    assert pod.status().num_used_blocks > 0
    assert connection.sock is not None
    connection.sock.close()
    connection.close()
    pod.wait_idle()
    assert pod.status().num_requests_finished == finished
    status = pod.status()
    assert status.num_used_blocks == 0 and status.num_running == 0


def test_grpc_still_refuses_without_a_key(pod: Pod) -> None:
    """The HTTP door changed nothing on the gRPC one: the same key store guards both."""
    with pytest.raises(grpc.RpcError) as info:
        pod.stub.Complete(pb.GenerateRequest(text="hi"), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_bench_serve_against_the_pod_s_http_port(pod: Pod, tiny_chat_model_dir: Path) -> None:
    """`bench serve --openai-url` on a tiny workload: every key, every request completed in full (no stack of
    its own: the pod's HTTP port). Latencies are only checked for presence (timing)."""
    cmd = [sys.executable, "-m", "pagedserve", "bench", "serve", "--json", "--openai-url", pod.http,  # type: ignore[attr-defined]
           "--api-key", KEY_A, "--model", str(tiny_chat_model_dir), "--num-requests", str(MAX_STREAMS),
           "--scale", "0.05", "--request-rate", "20", "--prefix-prompts", "3", "--prefix-prompt-len", "48",
           "--prefix-max-tokens", "4"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for key in ("throughput_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "e2e_ms_p50",
                "e2e_ms_p99", "goodput_rps", "slo_attainment", "prefill_tokens_saved_frac", "num_requests",
                "num_completed", "num_short", "completion_tokens", "output_tokens", "served_model", "wall_s"):
        assert key in result, key
    assert result["num_completed"] == result["num_requests"] == MAX_STREAMS and result["num_short"] == 0
    assert result["completion_tokens"] == result["output_tokens"] and result["served_model"] == model(pod)
    assert result["throughput_tok_s"] > 0 and 0 < result["ttft_ms_p50"] <= result["e2e_ms_p99"]
    assert result["prefill_tokens_saved_frac"] > 0  # one tenant, a shared first half: cached tokens in the usage
    pod.wait_idle()


def test_bench_serve_peer_url_compares_both_doors_with_the_peer(pod: Pod, tiny_chat_model_dir: Path) -> None:
    """`bench serve --peer-url`: its own stack over HTTP and gRPC against a running OpenAI server (this pod as the
    peer), each concurrency level, two rounds: every request completed in full on every side, ratios per round."""
    cmd = [sys.executable, "-m", "pagedserve", "bench", "serve", "--json", "--peer-url", pod.http,  # type: ignore[attr-defined]
           "--api-key", KEY_A, "--model", str(tiny_chat_model_dir), "--num-requests", "5", "--input-len", "24",
           "--output-len", "6", "--max-concurrency", f"1,{MAX_STREAMS - 1}", "--repeats", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["peer"] == pod.http and result["max_concurrency"] == [1, MAX_STREAMS - 1]  # type: ignore[attr-defined]
    assert set(result["sides"]) == {"pagedserve_http", "pagedserve_grpc", "peer_http"}
    for side in result["sides"].values():
        for level in ("c1", f"c{MAX_STREAMS - 1}"):
            keys = side[level]
            assert keys["completion_tokens"] == 5 * 6, keys
            assert keys["throughput_tok_s"] > 0 and 0 < keys["ttft_ms_p50"] <= keys["e2e_ms_p50"] * 1.0001
    for ours in ("pagedserve_http", "pagedserve_grpc"):  # the CPU of the pod it started, per process; none for a URL
        keys = result["sides"][ours]["c1"]
        assert keys["frontend_cpu_ms_per_token"] > 0 and keys["executor_cpu_ms_per_token"] > 0, keys
        assert "block_manager_cpu_ms_per_token" in keys and "supervisor_cpu_ms_per_token" in keys
    assert not any(key.endswith("_cpu_ms_per_token") for key in result["sides"]["peer_http"]["c1"])
    for ours in ("pagedserve_http", "pagedserve_grpc"):
        rounds = result[f"{ours}_vs_peer_c1_rounds"]  # two rounds, each its own ratio; the key their median
        assert len(rounds) == 2 and min(rounds) <= result[f"{ours}_vs_peer_c1"]["throughput"] <= max(rounds)
    pod.wait_idle()
