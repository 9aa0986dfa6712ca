"""Seedable synthetic workloads shaped like ShareGPT conversations.

ShareGPT's length distributions (vLLM paper, fig. 11): input mean ~161 tokens, output mean ~338, both
with a heavy right tail. Lognormals with those means reproduce the shape; prompt + output is capped.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def sharegpt_like(
    num_requests: int,
    seed: int = 0,
    input_mean: float = 161.0,
    output_mean: float = 338.0,
    max_total: int = 2048,
    scale: float = 1.0,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
) -> list[RequestSpec]:
    """Lengths scaled by `scale`; arrivals Poisson at request_rate (gamma with shape `burstiness` < 1 is
    burstier), or all at t=0 when the rate is infinite."""
    rng = random.Random(seed)
    specs, now = [], 0.0
    for _ in range(num_requests):
        prompt = max(1, round(_lognormal(rng, input_mean, 1.0) * scale))
        output = max(1, round(_lognormal(rng, output_mean, 0.9) * scale))
        cap = round(max_total * scale)
        prompt = min(prompt, cap - 1)
        output = min(output, cap - prompt)
        if math.isfinite(request_rate):
            now += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        specs.append(RequestSpec(prompt, output, now))
    return specs
