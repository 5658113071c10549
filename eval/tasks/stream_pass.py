"""One pass of the stream through a policy's cache, shared by the perplexity and memory tasks of
a unit (both :class:`StreamTask`): the memory figures are those of the stream the perplexity was
measured on."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from hf_kvpolicies.cache import PolicyCache

from ..memory import MemoryTrace, memory_in_use, model_devices
from ..perplexity import streaming_nll
from ..stream import resolve_chunk
from .base import Bench, Task, Unit

STREAM = "stream"
"""The unit both tasks name (:meth:`Task.unit`), so that one process runs them together."""
SAMPLES = 64
"""Points of the memory trace along the stream."""


@dataclass
class StreamPass:
    cache: Cache
    stream: torch.Tensor
    nll: torch.Tensor
    trace: MemoryTrace
    before: int
    """Memory in use before the cache existed (the base of the decode peak)."""
    figures: dict
    """What both tasks' records say: tokens, chunking, elapsed seconds, what the cache kept."""


class StreamTask(Task):
    """A task measured on the pass over the first ``--tokens`` tokens: its params, unit, context
    and stream are those of every such task, so that one process makes one pass for all."""

    def params(self, settings, job):
        return {"tokens": settings.tokens, "chunk_size": settings.chunk_size or "auto"}

    def unit(self, job):
        return STREAM

    def context(self, settings, job):
        return settings.tokens

    def stream_tokens(self, settings):
        return settings.tokens


def stream_pass(bench: Bench, unit: Unit) -> StreamPass:
    """The unit's pass over the first ``--tokens`` tokens, made once however many tasks ask."""
    if STREAM not in unit.shared:
        unit.shared[STREAM] = _measure(bench, unit)
    return unit.shared[STREAM]


def _measure(bench: Bench, unit: Unit) -> StreamPass:
    settings, model = bench.settings, bench.model
    start = time.perf_counter()
    cache = unit.make()
    chunk, approximate = resolve_chunk(cache, model, settings.chunk_size)
    stream = bench.ids[:, : settings.tokens]
    before = memory_in_use(model_devices(model))
    stride, fed = max(1, settings.tokens // SAMPLES), stream.shape[1] - 1
    trace = MemoryTrace(cache, stride)
    # a forward ends at every point the trace samples: chunked or not, it starts at token 1 and keeps its stride
    stops = range(1, fed, stride)
    nll = streaming_nll(model, stream, cache, progress=settings.progress, desc=unit.desc, chunk_size=chunk, observer=trace.observe, stops=stops)
    trace.finish(fed)
    kept = cache.kept_tokens() if isinstance(cache, PolicyCache) else None
    figures = {
        "tokens": stream.shape[1], "chunk_size": chunk, "approximate": approximate, "elapsed_s": time.perf_counter() - start,
        "kept_tokens": kept, "kept_fraction": None if kept is None else kept / (stream.shape[1] - 1),
        "held_bytes": trace.held[-1], "allocated_bytes": trace.bytes[-1],
    }
    return StreamPass(cache, stream, nll, trace, before, figures)

