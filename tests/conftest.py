"""Shared fixtures. Real service processes come from pagedserve.services.common.processes."""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from tiny_model import save_tiny_chat_llama, save_tiny_llama

# Triton's interpreter must be chosen before anything imports triton (the executor tests import the
# kernels too): on a machine without a GPU every Triton kernel in the test session runs interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama"))


# CI runs a fixed set of examples (reproducible, so a red CI is a real regression); local runs explore.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
