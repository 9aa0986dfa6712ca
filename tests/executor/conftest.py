"""Model tests run on the CPU in fp32 against transformers, offline.

One torch thread: on a shared two-core machine OpenMP's spinning workers make small matmuls an order of
magnitude slower as soon as another process holds a core (measured: 6 ms vs 0.5 ms for 9x576x1536).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
