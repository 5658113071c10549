"""Memory along a stream: the cache's own footprint, and the peak memory the process paid.

Two figures, because they answer different questions: ``get_memory_footprint()`` is exact and
deterministic (the bytes of every tensor the cache holds, capacity included), the peak device
memory is what a run really needed (activations and allocator slack included). On CUDA the
peak is ``max_memory_allocated`` above the allocation at the start; on the CPU it is the
highest resident set size sampled after each forward, above the RSS at the start (the
process-wide ``ru_maxrss`` would read zero for every policy that follows a larger one).
"""

from __future__ import annotations

import psutil
import torch
from transformers.cache_utils import Cache


def footprint(cache: Cache) -> int:
    """Bytes held by a cache: ours report it; transformers' caches are summed tensor by tensor
    (tensors held in tuples too: a quantized layer keeps ``(payload, scale)`` pairs)."""
    if hasattr(cache, "get_memory_footprint"):
        return cache.get_memory_footprint()
    return sum(t.nbytes for layer in cache.layers for t in _tensors(vars(layer).values()))


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(_tensors(value))
    return found


class PeakMemory:
    """Peak memory growth over a block: CUDA's allocator statistics, or sampled RSS on the CPU.

    On CUDA the figure sums each visible GPU's peak (a model spread with ``device_map="auto"``);
    the statistics are this process's own, so the other processes of a launch do not add to them.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.source = "cuda max_memory_allocated" if self.cuda else "sampled RSS"
        self._gpus = range(torch.cuda.device_count()) if self.cuda else range(0)
        self._process = psutil.Process()
        self._start = 0
        self._peak = 0

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            self._start = 0
            for gpu in self._gpus:
                torch.cuda.synchronize(gpu)
                torch.cuda.reset_peak_memory_stats(gpu)
                self._start += torch.cuda.memory_allocated(gpu)
        else:
            self._start = self._peak = self._process.memory_info().rss
        return self

    def sample(self) -> None:
        if not self.cuda:
            self._peak = max(self._peak, self._process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        if self.cuda:
            for gpu in self._gpus:
                torch.cuda.synchronize(gpu)
            self._peak = sum(torch.cuda.max_memory_allocated(gpu) for gpu in self._gpus)
        else:
            self.sample()

    @property
    def growth(self) -> int:
        """Bytes above the start of the block at the peak."""
        return max(0, self._peak - self._start)


class MemoryTrace:
    """Footprint of ``cache`` every ``stride`` tokens along a stream, and the peak memory.

    Pass :meth:`observe` as the stream's observer; it is called after each forward.
    """

    def __init__(self, cache: Cache, device: torch.device, stride: int = 1) -> None:
        self.cache = cache
        self.stride = stride
        self.peak = PeakMemory(device)
        self.positions: list[int] = []
        self.bytes: list[int] = []

    def __enter__(self) -> MemoryTrace:
        self.peak.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.peak.__exit__(*exc)

    def observe(self, tokens: int) -> None:
        self.peak.sample()
        if not self.positions or tokens - self.positions[-1] >= self.stride:
            self.positions.append(tokens)
            self.bytes.append(footprint(self.cache))

    def finish(self, tokens: int) -> None:
        """Record the final footprint whatever the stride."""
        if not self.positions or self.positions[-1] != tokens:
            self.positions.append(tokens)
            self.bytes.append(footprint(self.cache))
