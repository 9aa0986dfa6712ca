"""Shared fixtures. Real service processes come from pagedserve.services.common.processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_model import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
