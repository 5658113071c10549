"""Decode latency at a given context length, timed the same way for every policy."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so a timer measures it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timer(device: torch.device, into: list[float]):
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    into.append(time.perf_counter() - start)


@torch.no_grad()
def prefill(model: PreTrainedModel, ids: torch.Tensor, cache: Cache, chunk: int = 1024) -> torch.Tensor:
    """Run ``ids`` through the model into ``cache`` in chunks (bounded activation memory);
    returns the last logits."""
    ids = ids.to(model.device)
    logits = None
    for start in range(0, ids.shape[1], chunk):
        logits = model(ids[:, start : start + chunk], cache=cache, use_cache=True).logits[:, -1]
    return logits


@torch.no_grad()
def decode_latency(
    model: PreTrainedModel,
    make_cache: Callable[[], Cache],
    ids: torch.Tensor,
    context: int,
    steps: int = 16,
    warmup: int = 2,
) -> dict[str, float]:
    """ms per decoded token once ``context`` tokens are in the cache: median and p90 over ``steps``."""
    cache = make_cache()
    prefill(model, ids[:, :context], cache)
    device = model.device
    token = ids[:, context : context + 1].to(device)
    times: list[float] = []
    for step in range(warmup + steps):
        sample: list[float] = []
        with timer(device, sample):
            logits = model(token, cache=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        if step >= warmup:
            times.append(sample[0] * 1000)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],
        "context": context,
        "steps": steps,
    }
