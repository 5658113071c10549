"""Shared fixtures: the tiny models by name, and the embedded real model (loaded once)."""

from __future__ import annotations

import os
import sys

# no test reaches the Hub: fail at once instead of retrying (before huggingface_hub reads it)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import TINY_MODELS  # noqa: E402

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(params=sorted(TINY_MODELS))
def tiny_model(request):
    """Each tiny architecture in turn (Gemma 3 brings MQA and sliding-window layers)."""
    return TINY_MODELS[request.param]()


@pytest.fixture(scope="session")
def embedded():
    """``(model, tokenizer)`` for the embedded SmolLM2-135M."""
    from hf_kvpolicies.models import load_model

    return load_model()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for tests on tiny models: they gain nothing from a second thread, and
    on a shared machine OpenMP's spin-waiting makes two threads many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
