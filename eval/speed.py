"""Prefill time and decode latency at given context lengths, timed the same way for every policy.

Every timing waits for queued GPU work before and after (``synchronize``), and each context
starts with untimed warm-up steps, so the first kernel launches and allocator growth are
not charged to the policy that happens to run first.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm
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
        logits = model(ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    return logits


@torch.no_grad()
def decode_step_times(
    model: PreTrainedModel,
    caches: Sequence[Cache],
    token: torch.Tensor | Sequence[torch.Tensor],
    steps: int,
    warmup: int = 2,
) -> list[list[float]]:
    """ms of each of ``steps`` greedy decode steps (after ``warmup`` untimed ones) for every cache,
    continuing from ``token`` (one for all, or one per cache: caches prefilled to different
    contexts); the caches take turns step by step, so that the drift of a shared machine falls on
    all of them alike and their ratios stay steady."""
    device = model.device
    given = [token] * len(caches) if isinstance(token, torch.Tensor) else list(token)
    if len(given) != len(caches):
        raise ValueError(f"decode_step_times got {len(given)} start tokens for {len(caches)} caches: give one token, or one per cache")
    tokens = [t.to(device) for t in given]
    times: list[list[float]] = [[] for _ in caches]
    for step in range(warmup + steps):
        for index, cache in enumerate(caches):
            sample: list[float] = []
            with timer(device, sample):
                logits = model(tokens[index], cache=cache, use_cache=True).logits
            tokens[index] = logits[:, -1:].argmax(-1)
            if step >= warmup:
                times[index].append(sample[0] * 1000)
    return times


def decode_latency(
    model: PreTrainedModel,
    make_cache: Callable[[], Cache],
    ids: torch.Tensor,
    context: int,
    steps: int = 16,
    warmup: int = 2,
) -> dict[str, float]:
    """ms per decoded token once ``context`` tokens are in the cache: median and p90 over ``steps``,
    the tokens/s that the median gives, and the time of the (chunked) prefill of the context."""
    cache = make_cache()
    prefill_time: list[float] = []
    with timer(model.device, prefill_time):
        prefill(model, ids[:, :context], cache)
    times = sorted(decode_step_times(model, [cache], ids[:, context : context + 1], steps, warmup)[0])
    median = statistics.median(times)
    return {
        "median_ms": median,
        "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],
        "tokens_per_s": 1000 / median,
        "prefill_ms": prefill_time[0] * 1000,
        "context": context,
        "steps": steps,
    }


def speed_profile(
    model: PreTrainedModel,
    make_cache: Callable[[], Cache],
    ids: torch.Tensor,
    contexts: Sequence[int],
    steps: int = 16,
    progress: bool = False,
    desc: str = "speed",
) -> dict[str, list[float]]:
    """:func:`decode_latency` at each context, as lists in context order.

    The smallest context is run once untimed first: a prefill's first shapes cost extra
    (kernel selection, allocator growth) whatever the policy.
    """
    decode_latency(model, make_cache, ids, min(contexts), steps=1, warmup=1)
    figures: dict[str, list[float]] = {"contexts": [], "prefill_ms": [], "median_ms": [], "p90_ms": [], "tokens_per_s": []}
    for context in tqdm(contexts, disable=not progress, desc=desc, leave=False, unit="context"):
        timing = decode_latency(model, make_cache, ids, context, steps=steps)
        figures["contexts"].append(context)
        for key in ("prefill_ms", "median_ms", "p90_ms", "tokens_per_s"):
            figures[key].append(timing[key])
    return figures
