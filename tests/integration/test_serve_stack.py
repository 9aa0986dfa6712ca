"""The whole pod: `pagedserve serve` starts block manager, executor and frontend as three processes, and
clients talk to it over real gRPC on loopback. The model is tiny and random but real, with SmolLM2's
real tokenizer and chat template, so text goes through every layer."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import free_port, wait_for
from stack_testing import PROMPTS, Pod

from pagedserve.operator.scrape import parse_pod_metrics
from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc


@pytest.fixture(scope="module", params=["--overlap", "--no-overlap"])
def pod(tiny_chat_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Pod]:
    """The pod every test here runs against, with overlapped steps (the default) and in lock step."""
    pod = Pod(tiny_chat_model_dir, "--num-blocks", "256", "--max-num-batched-tokens", "64",
              "--metrics-port", str(free_port()), request.param)
    yield pod
    output = pod.stop()
    assert pod.proc.returncode == 0, output


def test_streaming_text_equals_the_decoded_tokens(pod: Pod, tiny_chat_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    chunks, texts = pod.generate(PROMPTS[0], max_tokens=24, ignore_eos=True)
    token_ids = [t for c in chunks for t in c.token_ids]
    # a chunk per step, the last with the finish and the usage (no message of its own: the request's end came with
    # its last step); steps the client fell behind on (a loaded host) arrive joined in one chunk
    assert len(token_ids) == 24 and 1 <= len(chunks) <= 24 and all(c.token_ids for c in chunks)
    assert texts[0] == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert chunks[-1].finish_reason == pb.LENGTH and all(c.finish_reason == 0 for c in chunks[:-1])
    assert chunks[-1].HasField("usage") and not any(c.HasField("usage") for c in chunks[:-1])
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0])) and usage.completion_tokens == 24
    assert 0 < usage.ttft_ms <= usage.e2e_ms
    # the gaps between the 24 tokens, and their mean as the time per output token
    assert len(usage.itl_ms) == 23 and all(gap >= 0 for gap in usage.itl_ms)
    assert usage.tpot_ms == pytest.approx(sum(usage.itl_ms) / 23, rel=1e-6)
    complete = pod.stub.Complete(pb.GenerateRequest(text=PROMPTS[0], params=pb.GenerationParameters(
        max_tokens=24, ignore_eos=True)))
    assert complete.choices[0].text == texts[0] and list(complete.choices[0].token_ids) == token_ids
    pod.wait_idle()


def test_chat_template_and_tokenize(pod: Pod) -> None:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hello!")])
    ids = pod.stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids
    text_ids = pod.stub.Tokenize(pb.TokenizeRequest(text="Hello!")).token_ids
    assert len(ids) > len(text_ids) + 4  # the template's system prompt and role markers
    response = pod.stub.Complete(pb.GenerateRequest(chat=chat, params=pb.GenerationParameters(max_tokens=5)))
    assert response.usage.prompt_tokens == len(ids)
    by_ids = pod.stub.Complete(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                                  params=pb.GenerationParameters(max_tokens=5)))
    assert list(by_ids.choices[0].token_ids) == list(response.choices[0].token_ids)
    models = pod.stub.ListModels(pb.ListModelsRequest()).models
    assert models[0].num_blocks == 256 and models[0].block_size == 4
    assert (models[0].dtype, models[0].kv_cache_dtype) == ("float32", "float32")


def test_parallel_samples_and_seeds(pod: Pod) -> None:
    params = {"max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": True}
    _, texts = pod.generate(PROMPTS[1], **params)
    _, again = pod.generate(PROMPTS[1], **params)
    assert texts == again and len(texts) == 3 and len(set(texts.values())) == 3
    _, other_seed = pod.generate(PROMPTS[1], **{**params, "seed": 8})
    assert other_seed != texts
    _, single = pod.generate(PROMPTS[1], max_tokens=12, temperature=1.0, seed=7 + 2, ignore_eos=True)
    assert single[0] == texts[2]  # sample i draws with seed + i
    # without a seed the engine picks one and reports it: sending it back draws the same samples
    picked, drawn = pod.generate(PROMPTS[1], **{**params, "seed": None})
    assert picked[-1].usage.seed != 0
    _, redrawn = pod.generate(PROMPTS[1], **{**params, "seed": picked[-1].usage.seed})
    assert redrawn == drawn
    pod.wait_idle()


def test_stop_strings_end_the_text_before_them(pod: Pod) -> None:
    _, texts = pod.generate(PROMPTS[2], max_tokens=30, ignore_eos=True)
    full = texts[0]
    stop = full[10:14]
    chunks, stopped = pod.generate(PROMPTS[2], max_tokens=30, ignore_eos=True, stop=[stop])
    assert stopped[0] == full[: full.index(stop)]
    # the usage alone after it: the stop string ended the sample before the engine ended the request, and the last
    # chunk does not wait for the engine
    assert chunks[-2].finish_reason == pb.STOP and chunks[-1].HasField("usage") and not chunks[-1].token_ids
    pod.wait_idle()


def test_prefix_hit_output_equals_cold_output(pod: Pod) -> None:
    prompt = PROMPTS[4]
    cold, cold_text = pod.generate(prompt, max_tokens=10, ignore_eos=True)
    warm, warm_text = pod.generate(prompt, max_tokens=10, ignore_eos=True)
    assert cold[-1].usage.cached_prompt_tokens == 0 and warm[-1].usage.cached_prompt_tokens > 0
    assert warm_text == cold_text
    assert pod.status().prefix_hit_rate > 0


def test_cancellation_and_deadline_free_blocks_at_once(pod: Pod) -> None:
    request = pb.GenerateRequest(text=PROMPTS[3], params=pb.GenerationParameters(max_tokens=400, ignore_eos=True))
    call = pod.stub.Generate(request)
    for _ in range(3):
        next(call)
    assert pod.status().num_used_blocks > 0
    call.cancel()
    pod.wait_idle()
    with pytest.raises(grpc.RpcError) as info:
        list(pod.stub.Generate(request, timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    pod.wait_idle()


BAD = [
    ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty"),
    ({"text": "hi", "params": pb.GenerationParameters(max_tokens=0)}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"text": "hi", "params": pb.GenerationParameters(top_p=1.5)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ({"text": "hi", "params": pb.GenerationParameters(n=100)}, grpc.StatusCode.INVALID_ARGUMENT, "n: must be"),
    ({"text": "hi " * 600}, grpc.StatusCode.INVALID_ARGUMENT, "exceed the context"),
    ({"text": "hi", "params": pb.GenerationParameters(max_tokens=500, n=16)}, grpc.StatusCode.RESOURCE_EXHAUSTED,
     "KV blocks"),
    ({"token_ids": pb.TokenIds(ids=[10**6])}, grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "prompt: set one of"),
    ({"text": "hi", "model": "gpt-5"}, grpc.StatusCode.INVALID_ARGUMENT, "model: 'gpt-5' is not served"),
    ({"chat": pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])}, grpc.StatusCode.INVALID_ARGUMENT,
     "chat.messages[0].role"),
    ({"text": "hi", "params": pb.GenerationParameters(stop=[""])}, grpc.StatusCode.INVALID_ARGUMENT, "stop"),
]


@pytest.mark.parametrize(("fields", "code", "message"), BAD)
def test_bad_requests_get_the_right_code_and_the_server_keeps_serving(
    pod: Pod, fields: dict[str, object], code: grpc.StatusCode, message: str
) -> None:
    for call in (lambda r: list(pod.stub.Generate(r, timeout=30)), lambda r: pod.stub.Complete(r, timeout=30)):
        with pytest.raises(grpc.RpcError) as info:
            call(pb.GenerateRequest(**fields))  # type: ignore[arg-type]
        assert info.value.code() == code and message in info.value.details(), info.value.details()
    assert pod.generate("still there?", max_tokens=2)[0][-1].usage.completion_tokens >= 1


def test_health_reflection_and_client_commands(pod: Pod) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(pod.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request])))
        assert "pagedserve.inference.v1.Inference" in {s.name for s in reply.list_services_response.service}
    env = dict(os.environ)
    cli = [sys.executable, "-m", "pagedserve"]
    status = subprocess.run([*cli, "status", "--address", pod.address, "--json"], capture_output=True, text=True,
                            check=True, env=env, timeout=120)
    import json

    fields = json.loads(status.stdout)
    for key in ("num_running", "num_waiting", "num_used_blocks", "num_cached_blocks", "num_free_blocks",
                "num_total_blocks"):
        assert key in fields
    assert fields["num_total_blocks"] == 256
    out = subprocess.run([*cli, "generate", "--address", pod.address, "--max-tokens", "8", PROMPTS[0]],
                         capture_output=True, text=True, check=True, env=env, timeout=120)
    assert out.stdout.strip() == pod.generate(PROMPTS[0], max_tokens=8)[1][0].strip()
    bad = subprocess.run([*cli, "generate", "--address", pod.address, "--max-tokens", "0", "x"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_budget_keeps_greedy_output(tiny_chat_model_dir: Path, pod: Pod, mode: str) -> None:
    expected = [pod.generate(p, max_tokens=40, ignore_eos=True)[1][0] for p in PROMPTS]
    # 24 blocks of 4 tokens: the longest request alone needs 18, all five together about 75; and the other
    # way of stepping than `pod`'s, so that overlapped and serial steps are compared too
    other = "--no-overlap" if "--overlap" in pod.extra else "--overlap"
    small = Pod(tiny_chat_model_dir, "--num-blocks", "24", "--preemption-mode", mode, "--cpu-swap-mib", "1", other)
    failure: grpc.RpcError | None = None
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: small.generate(p, max_tokens=40, ignore_eos=True)[1][0], PROMPTS))
        status = small.wait_idle()
    except grpc.RpcError as exc:
        failure = exc
    output = small.stop()  # the pod's log, with its components' (a failed step's traceback)
    assert failure is None, f"{failure}\n{output}"
    assert results == expected, output
    assert small.proc.returncode == 0 and "Traceback" not in output, output
    preemptions = status.num_preemptions_swap if mode == "swap" else status.num_preemptions_recompute
    assert preemptions > 0


def test_serve_passes_on_its_childrens_logs_under_their_names(pod: Pod) -> None:
    """`serve`'s own output holds each component's log lines, named (a traceback in the frontend must reach the
    operator's log, not stay in a pipe that only a crash prints)."""
    output = "".join(pod.output)
    for name, service in (("executor", "Executor"), ("block-manager", "BlockManager"), ("frontend", "Inference")):
        assert re.search(rf"^{name} \| .* serving pagedserve\.[a-z_]+\.v1\.{service} on ", output, re.M), output


def test_serve_refuses_swap_without_a_swap_pool_before_loading_anything() -> None:
    run = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--preemption-mode", "swap"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "needs a CPU swap pool" in run.stderr and "--cpu-swap-mib" in run.stderr
    assert "starting" not in run.stderr


def test_a_frontend_waiting_for_its_sidecars_stops_at_sigterm(tmp_path: Path) -> None:
    missing = f"unix:{tmp_path}/nothing.sock"  # sidecars that never come: it would wait --sidecar-timeout
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "frontend", "--block-manager", missing,
                             "--executor", missing, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()  # up, and in its warm-up
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # not after the 300 s wait for the sidecars
    finally:
        proc.kill()
        proc.wait()


def test_a_frontend_whose_http_port_is_taken_says_so_and_stops_its_grpc_server(tmp_path: Path) -> None:
    missing = f"unix:{tmp_path}/nothing.sock"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        http = f"127.0.0.1:{taken.getsockname()[1]}"
        run = subprocess.run([sys.executable, "-m", "pagedserve", "frontend", "--block-manager", missing, "--executor",
                              missing, "--listen", "127.0.0.1:0", "--http-listen", http],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and f"cannot listen on http://{http}: Address already in use" in run.stderr, run.stderr
    assert "Event loop is closed" not in run.stderr  # its gRPC server, already up, was stopped before the exit


def test_a_frontend_refuses_a_limit_below_one() -> None:
    run = subprocess.run([sys.executable, "-m", "pagedserve", "frontend", "--block-manager", "unix:/nonexistent",
                          "--executor", "unix:/nonexistent", "--max-waiting-requests", "0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--max-waiting-requests: must be >= 1, got 0" in run.stderr, run.stderr


Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Scrape:
    """The pod's /metrics, parsed by Prometheus' own text parser: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_endpoint_exports_load_and_goodput(pod: Pod) -> None:
    address = f"127.0.0.1:{pod.proc.args[pod.proc.args.index('--metrics-port') + 1]}"  # type: ignore[index,union-attr]
    before = scrape(address)
    assert before[("pagedserve_ready", ())] == 1
    pod.generate(PROMPTS[1], max_tokens=6, ignore_eos=True)
    status = pod.wait_idle()
    after = scrape(address)
    assert after[("pagedserve_requests_finished_total", ())] == before[("pagedserve_requests_finished_total", ())] + 1
    assert after[("pagedserve_requests_finished_total", ())] == status.num_requests_finished
    blocks = {state: after[("pagedserve_kv_blocks", (("state", state),))] for state in ("used", "cached", "free")}
    assert blocks == {"used": status.num_used_blocks, "cached": status.num_cached_blocks,
                      "free": status.num_free_blocks - status.num_cached_blocks}
    assert sum(blocks.values()) == after[("pagedserve_kv_blocks_capacity", ())] == 256
    assert after[("pagedserve_kv_cache_info", (("block_size", "4"), ("dtype", "float32")))] == 1
    assert blocks["cached"] > 0  # the prompt's full blocks stay cached after the request
    assert after[("pagedserve_kv_block_pressure", ())] == 0 and after[("pagedserve_running_seqs", ())] == 0
    assert after[("pagedserve_generation_tokens_per_second", ())] > 0
    assert after[("pagedserve_time_to_first_token_window_seconds", (("quantile", "0.5"),))] > 0
    assert after[("pagedserve_time_to_first_token_slo_seconds", ())] == 2.0
    for mode in ("recompute", "swap"):
        assert ("pagedserve_preemptions_total", (("mode", mode),)) in after
    assert after[("pagedserve_admissions_held_by_reserve_total", ())] == 0  # 256 blocks: never short of room
    assert after[("pagedserve_requests_refused_total", ())] == 0
    assert after[("pagedserve_finished_requests_per_second", ())] == status.finished_rps > 0
    # what the operator reads from the same text (operator/scrape.py)
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        seen = parse_pod_metrics(reply.read().decode())
    assert seen is not None and seen.total_blocks == 256 and seen.used_blocks == status.num_used_blocks == 0
    assert seen.finished_rps == status.finished_rps and seen.goodput_rps == status.goodput_rps
    assert seen.waiting_requests == 0 and seen.preemptions_total == 0


REQUEST_HISTOGRAMS = ("request_queue_time", "time_to_first_token", "e2e_request_latency")


def request_reason(chunks: list[pb.GenerateResponse]) -> str:
    """The request's finish reason as the exporter counts it: abort, else length, else stop, over its samples."""
    reasons = {c.finish_reason for c in chunks if c.finish_reason}
    return "abort" if pb.ABORT in reasons else "length" if pb.LENGTH in reasons else "stop"


def increase(before: Scrape, after: Scrape, name: str, *labels: tuple[str, str]) -> float:
    return after[(name, labels)] - before[(name, labels)]


def test_metrics_histograms_and_counters_add_up_to_what_the_requests_returned(pod: Pod) -> None:
    """N requests through the pod: every request histogram counts N more, with the latencies each usage reported;
    the finish-reason, token and prefix-cache counters grow by what the responses say; a cancel counts as abort."""
    address = f"127.0.0.1:{pod.proc.args[pod.proc.args.index('--metrics-port') + 1]}"  # type: ignore[index,union-attr]
    pod.wait_idle()
    before = scrape(address)
    runs = [pod.generate(PROMPTS[4], max_tokens=5, ignore_eos=True)[0],
            pod.generate(PROMPTS[4], max_tokens=5, ignore_eos=True)[0],  # its prompt's blocks now cached
            pod.generate(PROMPTS[2], max_tokens=4, n=2, temperature=1.0, seed=3, ignore_eos=True)[0],
            pod.generate(PROMPTS[3], max_tokens=6)[0]]  # stop or length: whatever the model says
    pod.wait_idle()
    after = scrape(address)

    def grew(name: str, *labels: tuple[str, str]) -> float:
        return increase(before, after, name, *labels)

    usages = [chunks[-1].usage for chunks in runs]
    first_sample = [sum(len(c.token_ids) for c in chunks if c.index == 0) for chunks in runs]
    for name, seconds in zip(REQUEST_HISTOGRAMS, ("queue_ms", "ttft_ms", "e2e_ms"), strict=True):
        assert grew(f"pagedserve_{name}_seconds_count") == len(runs)
        assert grew(f"pagedserve_{name}_seconds_bucket", ("le", "+Inf")) == len(runs)
        assert grew(f"pagedserve_{name}_seconds_sum") == pytest.approx(
            sum(getattr(u, seconds) for u in usages) / 1000, rel=1e-6, abs=1e-9)
    assert grew("pagedserve_inter_token_latency_seconds_count") == sum(n - 1 for n in first_sample)
    assert grew("pagedserve_time_per_output_token_seconds_count") == sum(n > 1 for n in first_sample)
    ttft = {float(dict(labels)["le"]): value for (name, labels), value in after.items()
            if name == "pagedserve_time_to_first_token_seconds_bucket"}
    buckets = [ttft[le] for le in sorted(ttft)]
    assert buckets == sorted(buckets) and len(buckets) == 23  # cumulative, 22 bounds and +Inf
    reasons = [request_reason(chunks) for chunks in runs]
    for reason in ("stop", "length", "abort", "error"):
        assert grew("pagedserve_requests_ended_total", ("finish_reason", reason)) == reasons.count(reason)
    assert grew("pagedserve_requests_finished_total") == len(runs)
    assert grew("pagedserve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("pagedserve_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    # one lookup per request; the n=2 one's first sample is admitted without its last prompt token (each fork
    # computes that token itself)
    assert grew("pagedserve_prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages) - 1
    assert grew("pagedserve_prefix_cache_hits_total") == sum(u.cached_prompt_tokens for u in usages)
    assert usages[1].cached_prompt_tokens > 0
    assert after[("pagedserve_prefix_cache_hits_total", ())] / after[("pagedserve_prefix_cache_queries_total", ())] \
        == pytest.approx(after[("pagedserve_prefix_cache_hit_rate", ())])

    call = pod.stub.Generate(pb.GenerateRequest(text=PROMPTS[0], params=pb.GenerationParameters(
        max_tokens=400, ignore_eos=True)))
    next(call)
    call.cancel()
    pod.wait_idle()
    cancelled = scrape(address)
    assert increase(after, cancelled, "pagedserve_requests_ended_total", ("finish_reason", "abort")) == 1
    for name in ("time_to_first_token", "e2e_request_latency"):  # it had its first token before it ended
        assert increase(after, cancelled, f"pagedserve_{name}_seconds_count") == 1
    assert increase(after, cancelled, "pagedserve_requests_finished_total") == 0
    assert increase(after, cancelled, "pagedserve_generation_tokens_total") >= 1


def test_probe_endpoints_follow_the_engine(pod: Pod) -> None:
    """The kubelet's probes: /readyz and /healthz answer 200 while the engine runs; anything else is /metrics."""
    address = f"127.0.0.1:{pod.proc.args[pod.proc.args.index('--metrics-port') + 1]}"  # type: ignore[index,union-attr]
    for path in ("/readyz", "/healthz"):
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as reply:
            assert reply.status == 200 and reply.read() == b"ok\n"
    with urllib.request.urlopen(f"http://{address}/anything", timeout=10) as reply:
        assert b"pagedserve_ready 1.0" in reply.read()


def test_a_full_waiting_queue_refuses_new_requests_at_once(tiny_chat_model_dir: Path) -> None:
    """One sequence may run and one request may wait: a third request is refused with RESOURCE_EXHAUSTED, and
    the server takes requests again once the queue drains."""
    metrics = f"127.0.0.1:{free_port()}"
    busy = Pod(tiny_chat_model_dir, "--num-blocks", "256", "--max-num-seqs", "1", "--max-waiting-requests", "1",
               "--metrics-port", metrics.rsplit(":", 1)[1])
    try:
        long = pb.GenerateRequest(text=PROMPTS[0], params=pb.GenerationParameters(max_tokens=400, ignore_eos=True))
        running = busy.stub.Generate(long)
        next(running)  # admitted before the second request exists: the two cannot swap places
        waiting = busy.stub.Generate(long)
        wait_for(lambda: busy.status().num_waiting == 1, "the second request waiting")
        with pytest.raises(grpc.RpcError) as info:
            busy.generate(PROMPTS[1], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 waiting request(s)" in info.value.details() and "--max-waiting-requests 1" in info.value.details()
        assert scrape(metrics)[("pagedserve_requests_refused_total", ())] == busy.status().num_requests_refused == 1
        running.cancel()
        waiting.cancel()
        busy.wait_idle()
        assert busy.generate(PROMPTS[1], max_tokens=2, ignore_eos=True)[0][-1].usage.completion_tokens == 2
    finally:
        assert busy.stop() is not None and busy.proc.returncode == 0


def test_logprobs_and_chat_client(pod: Pod) -> None:
    chunks, _ = pod.generate(PROMPTS[0], max_tokens=4, logprobs=2, ignore_eos=True)
    entries = []
    for chunk in chunks:  # a chunk carries every token that was ready when it was sent: one or more
        entries += zip(chunk.logprobs, chunk.token_ids, strict=True)
    assert len(entries) == 4
    for entry, token_id in entries:
        assert entry.token_id == token_id and len(entry.top_token_ids) == 2
        assert entry.logprob <= 0 and entry.top_logprobs[0] >= entry.top_logprobs[1]
        assert entry.top_token_ids[0] == entry.token_id  # greedy: the chosen token is the most likely
    assert not pod.generate(PROMPTS[0], max_tokens=2)[0][0].logprobs  # only when asked
    chat = subprocess.run([sys.executable, "-m", "pagedserve", "chat", "--address", pod.address, "--max-tokens", "5"],
                          input="Hello!\nAnd again?\n", capture_output=True, text=True, timeout=120, check=True)
    assert len([line for line in chat.stdout.splitlines() if line.strip()]) == 2  # one reply per message


def stack_args(model: Path, *extra: str) -> argparse.Namespace:
    from pagedserve.services.frontend.stack import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", str(model), "--port", str(free_port()), "--device", "cpu", "--block-size",
                              "4", *extra])


def test_serve_stops_when_a_component_dies_and_restarts_are_off(tiny_chat_model_dir: Path) -> None:
    from pagedserve.services.frontend.stack import Stack, watch

    args = stack_args(tiny_chat_model_dir, "--num-blocks", "32", "--max-restarts", "0")
    stack = Stack(args.max_restarts)
    try:
        stack.start(args)
        stack.services["executor"].proc.kill()  # a process this test started (through the stack)
        assert watch(stack, f"{args.host}:{args.port}", interval=0.1) == 1
    finally:
        stack.stop()
    assert all(s.proc.poll() is not None for s in stack.services.values())


def test_serve_starts_a_dead_sidecar_again_and_the_streams_go_on(tiny_chat_model_dir: Path) -> None:
    from pagedserve.services.frontend.stack import Stack, watch

    args = stack_args(tiny_chat_model_dir, "--num-blocks", "256")
    stack = Stack(args.max_restarts)
    stack.start(args)
    watcher = threading.Thread(target=watch, args=(stack, stack.frontend_local, 0.05))
    watcher.start()
    chunks = [0]

    def stream(stub: pb_grpc.InferenceStub, prompt: str) -> list[int]:
        params = pb.GenerationParameters(max_tokens=150, ignore_eos=True)
        tokens = []
        for chunk in stub.Generate(pb.GenerateRequest(text=prompt, params=params), timeout=300):
            tokens += chunk.token_ids
            chunks[0] += 1
        return tokens

    def after_progress(count: int) -> None:
        deadline = time.monotonic() + 120
        while chunks[0] < count:
            assert time.monotonic() < deadline, "the streams made no progress"
            time.sleep(0.005)

    try:
        with grpc.insecure_channel(f"{args.host}:{args.port}") as channel, ThreadPoolExecutor(len(PROMPTS)) as pool:
            stub = pb_grpc.InferenceStub(channel)
            expected = [stream(stub, p) for p in PROMPTS]
            futures = [pool.submit(stream, stub, p) for p in PROMPTS]
            for name in ("executor", "block-manager"):  # processes this test started, through the stack
                after_progress(chunks[0] + len(PROMPTS))
                killed = stack.services[name]
                killed.proc.kill()
            assert [f.result() for f in futures] == expected
            assert killed is not stack.services["block-manager"] and stack.services["block-manager"].proc.poll() is None
            assert sorted(stack.deaths) == ["block-manager", "executor"]
    finally:
        stack.stopping = True
        watcher.join(timeout=60)
        stack.stop()


def test_every_dashboard_query_uses_only_exported_metrics(pod: Pod) -> None:
    """The chart's Grafana dashboard: each metric name in each PromQL expression is on a live /metrics (the
    router's, `pagedserve_router_*`, are checked against the router's: tests/router/test_dashboard.py)."""
    address = f"127.0.0.1:{pod.proc.args[pod.proc.args.index('--metrics-port') + 1]}"  # type: ignore[index,union-attr]
    exported = {name for name, _ in scrape(address)}
    dashboard = Path(__file__).resolve().parents[2] / "charts/pagedserve/files/dashboards/pagedserve.json"
    expressions = [t["expr"] for panel in json.loads(dashboard.read_text())["panels"] for t in panel.get("targets", [])]
    used = {name for expr in expressions for name in re.findall(r"\bpagedserve_(?!router_)[a-z0-9_]+", expr)}
    assert len(expressions) >= 10 and len(used) >= 15
    assert used <= exported, f"not exported: {sorted(used - exported)}"
