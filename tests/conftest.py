"""Shared fixtures. Real service processes come from pagedserve.services.common.processes."""

import os
from pathlib import Path

import pytest
import torch
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
