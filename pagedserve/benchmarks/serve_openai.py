"""`pagedserve bench serve --openai-url URL`: bench serve's workload against any OpenAI-compatible server
(pagedserve's own HTTP port, vLLM, SGLang, ...), so that side-by-side runs use one client.

The main pass and the shared-prefix pass of serve.py, each request a streamed `/v1/completions` call: the prompt
is the workload's token ids decoded with `--model`'s tokenizer (the server tokenizes the text again, so its
prompt lengths can differ by a token or so), `max_tokens` the workload's, greedy, with `ignore_eos` (an
extension vLLM and SGLang honour too) and `stream_options.include_usage`. Times are taken as on gRPC: TTFT at
the first event with text, TPOT from the first to the last such event over the usage's completion tokens,
end to end at `[DONE]`. A server that ends a request early is not an error: `num_short` counts such requests.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import statistics
import time
import urllib.parse
import urllib.request
from typing import Any

from ..services.executor.model.registry import resolve_model
from ..services.executor.model.tokenizer import load_tokenizer
from .serve_passes import PASSAGE, Outcome, main_pass, progress, shared_prefix_pass, workload


def base_url(url: str) -> str:
    """http://HOST:PORT or http://HOST:PORT/v1 (as OpenAI's clients take it): always the /v1 form."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


class OpenAIClient:
    """The serve.py Client's `generate`, over HTTP: one connection per request, as one client thread each."""

    def __init__(self, url: str, tokenizer: Any, api_key: str | None, model: str | None) -> None:
        self.url = urllib.parse.urlsplit(base_url(url))
        self.tokenizer, self.api_key = tokenizer, api_key
        self.run_id = secrets.token_hex(4)  # in every label: a rerun against the same server starts cold
        self.model = model or self._models()[0]
        self.num_short = 0

    def _headers(self, label: str) -> dict[str, str]:
        return {"content-type": "application/json", "authorization": f"Bearer {self.api_key or label}"}

    def _models(self) -> list[str]:
        request = urllib.request.Request(f"{base_url(self.url.geturl())}/models", headers=self._headers(self.run_id))
        with urllib.request.urlopen(request, timeout=60) as response:
            return [m["id"] for m in json.loads(response.read())["data"]]

    def _connection(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.url.scheme == "https" else http.client.HTTPConnection
        return kind(self.url.netloc, timeout=1800)

    def generate(self, ids: list[int], max_tokens: int, api_key: str, n: int = 1, seed: int = 0) -> Outcome:
        body = {"model": self.model, "prompt": self.tokenizer.decode(ids), "max_tokens": max_tokens, "n": n,
                "seed": seed, "temperature": 1.0 if n > 1 else 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        connection = self._connection()
        outcome = Outcome(time.monotonic())
        num_events, usage, done = 0, None, False
        try:
            connection.request("POST", f"{self.url.path}/completions", json.dumps(body),
                               self._headers(f"{self.run_id}-{api_key}"))
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
            for line in response:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"error in the stream: {event['error']}")
                if any(choice.get("text") for choice in event.get("choices") or ()):
                    outcome.last = time.monotonic()
                    outcome.first = outcome.first or outcome.last
                    num_events += 1
                usage = event.get("usage") or usage
        finally:
            connection.close()
        outcome.end = time.monotonic()
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
        outcome.num_tokens = usage["completion_tokens"] if usage else num_events
        if usage:
            outcome.prompt_tokens = usage["prompt_tokens"]
            outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if outcome.num_tokens < max_tokens * n:
            self.num_short += 1
        return outcome


def run_openai(args: argparse.Namespace) -> dict[str, Any]:
    wall_start, load_start = time.monotonic(), round(os.getloadavg()[0], 2)
    tokenizer = load_tokenizer(resolve_model(args.model))
    client = OpenAIClient(args.openai_url, tokenizer, args.api_key, args.openai_model)
    passage = list(tokenizer.encode(PASSAGE, add_special_tokens=False))
    specs, prompts = workload(args, passage)
    progress("target", {"url": base_url(args.openai_url), "model": client.model})
    start = time.monotonic()
    result, outcomes = main_pass(client, args, prompts, specs)
    main_s = time.monotonic() - start
    progress("main pass", result)
    start = time.monotonic()
    result.update(progress("shared-prefix pass", shared_prefix_pass(client, args, passage)))
    result.update(
        openai_url=base_url(args.openai_url), served_model=client.model, model=args.model,
        num_requests=len(specs), num_completed=len(outcomes), num_short=client.num_short,
        completion_tokens=sum(o.num_tokens for o in outcomes), output_tokens=sum(s.output_len for s in specs),
        request_rate=args.request_rate, burstiness=args.burstiness, scale=args.scale,
        input_mean=round(statistics.mean(s.prompt_len for s in specs), 1),
        output_mean=round(statistics.mean(s.output_len for s in specs), 1),
        ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms, wall_s=round(time.monotonic() - wall_start, 1),
        phase_s={"main": round(main_s, 1), "shared prefix": round(time.monotonic() - start, 1)},
        load_avg_1m={"start": load_start, "end": round(os.getloadavg()[0], 2)},
    )
    return result
