"""Memory along a stream: the cache's own footprint, and the peak memory the process paid.

Three figures, because they answer different questions: :func:`held_bytes` is the keys and values
of the tokens kept (the figure to compare policies on, whatever the allocation);
``get_memory_footprint()`` is the bytes allocated (every tensor the cache holds, spare capacity
and bookkeeping included: what the user pays); the peak is
what decoding at the end of the stream really needs above the memory in use before the cache
existed (the cache, dequantised copies, score buffers, a step's activations, allocator slack).
On CUDA the peak is ``max_memory_allocated``; on the CPU it is the highest resident set size
sampled after each forward, the baseline read after ``malloc_trim`` (the process-wide
``ru_maxrss`` would read zero for every policy that follows a larger one, and memory a previous
policy freed would otherwise be reused without showing as growth).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterable
from functools import lru_cache
from itertools import chain

import psutil
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from hf_kvpolicies.cache import PolicyCache


def footprint(cache: Cache) -> int:
    """Bytes held by a cache: ours report it; transformers' caches are summed tensor by tensor
    (tensors held in tuples too: a quantized layer keeps ``(payload, scale)`` pairs; a tensor
    subclass, such as quanto's packed ``WeightQBitsTensor``, by the tensors it holds, since its own
    ``nbytes`` is that of the dequantised shape)."""
    if hasattr(cache, "get_memory_footprint"):
        return cache.get_memory_footprint()
    return sum(t.nbytes for layer in cache.layers for t in _tensors(vars(layer).values()))


def held_bytes(cache: Cache) -> int | None:
    """Bytes of the keys and values of the tokens a cache holds, spare capacity excluded: each
    layer's storage asked for the bytes of the tokens its retention keeps. The figure to take
    ratios on, since allocation policy (a buffer that grows by doubling) is not what a policy
    keeps; ``None`` for caches that are not ours (their footprint is all we can read)."""
    if not isinstance(cache, PolicyCache):
        return None
    return sum(layer.storage.bytes_held(layer.retention.held_slots) for layer in cache.layers)


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            found.extend(_tensors(getattr(value, name) for name in value.__tensor_flatten__()[0]))
        elif isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(_tensors(value))
    return found


Devices = torch.device | Iterable[torch.device]


def model_devices(model: PreTrainedModel) -> tuple[torch.device, ...]:
    """The devices that hold a model's weights: several with ``device_map="auto"``, where
    ``model.device`` names only the first."""
    return tuple(dict.fromkeys(tensor.device for tensor in chain(model.parameters(), model.buffers()))) or (model.device,)


def _device_tuple(devices: Devices) -> tuple[torch.device, ...]:
    """``devices`` as a tuple (one device, or an iterable read once)."""
    return (devices,) if isinstance(devices, torch.device) else tuple(devices)


def cuda_indices(devices: Devices) -> list[int]:
    """The CUDA devices among ``devices``, by index. Only these are read: touching another GPU
    would open a CUDA context on it (hundreds of MiB), in every process of a multi-GPU launch."""
    devices = _device_tuple(devices)
    if not any(device.type == "cuda" for device in devices) or not torch.cuda.is_available():
        return []
    return sorted({torch.cuda.current_device() if d.index is None else d.index for d in devices if d.type == "cuda"})


def memory_in_use(devices: Devices) -> int:
    """Bytes in use now: allocated on the GPUs among ``devices`` (see :func:`model_devices`), or,
    where there are none, this process's resident set once the heap has handed freed memory back
    (so that what an earlier run freed hides no growth)."""
    gpus = cuda_indices(devices)
    if gpus:
        return sum(torch.cuda.memory_allocated(gpu) for gpu in gpus)
    _trim_heap()
    return _rss()


def _rss() -> int:
    return psutil.Process().memory_info().rss


@lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: return free heap pages to the OS (nothing elsewhere)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class PeakMemory:
    """Peak memory over a block, above ``since`` (default: the memory in use as the block starts).

    CUDA: ``max_memory_allocated`` summed over the GPUs among ``devices`` (all that hold a model
    spread with ``device_map="auto"``: pass :func:`model_devices`); the statistics are this
    process's own, so the other processes of a launch do not add to them. CPU: the highest RSS
    seen by :meth:`sample` (call it after each forward) or at the block's ends.
    """

    def __init__(self, devices: Devices, since: int | None = None) -> None:
        self.devices = _device_tuple(devices)
        self._gpus = cuda_indices(self.devices)
        self.cuda = bool(self._gpus)
        self.source = "cuda max_memory_allocated" if self.cuda else "sampled RSS"
        self._since = since
        self._start = 0
        self._peak = 0

    def __enter__(self) -> PeakMemory:
        for gpu in self._gpus:
            torch.cuda.synchronize(gpu)
            torch.cuda.reset_peak_memory_stats(gpu)
        now = memory_in_use(self.devices)
        self._start = now if self._since is None else self._since
        self._peak = now
        return self

    def sample(self) -> None:
        if not self.cuda:
            self._peak = max(self._peak, _rss())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            for gpu in self._gpus:
                torch.cuda.synchronize(gpu)
            self._peak = sum(torch.cuda.max_memory_allocated(gpu) for gpu in self._gpus)
        else:
            self.sample()

    @property
    def growth(self) -> int:
        """Bytes above ``since`` at the peak."""
        return max(0, self._peak - self._start)


@torch.no_grad()
def decode_peak(model: PreTrainedModel, cache: Cache, token: torch.Tensor, steps: int, since: int) -> PeakMemory:
    """Peak memory over ``steps`` greedy decode steps continuing ``cache`` from ``token``, above
    ``since`` (the memory in use before the cache existed): the cache plus what a step needs.

    Measured while decoding, one token per forward, so that every policy is measured alike
    whatever its stream was fed with (a chunked forward's activations would dwarf the cache).
    """
    with PeakMemory(model_devices(model), since=since) as peak:
        token = token.to(model.device)
        for _ in range(steps):
            logits = model(token, cache=cache, use_cache=True).logits
            peak.sample()
            token = logits[:, -1:].argmax(-1)
    return peak


class MemoryTrace:
    """Footprint of ``cache`` every ``stride`` tokens along a stream.

    Pass :meth:`observe` as the stream's observer; it is called after each forward.
    """

    def __init__(self, cache: Cache, stride: int = 1) -> None:
        self.cache = cache
        self.stride = stride
        self.positions: list[int] = []
        self.bytes: list[int] = []
        """Bytes allocated (:func:`footprint`) at each position."""
        self.held: list[int | None] = []
        """Bytes of the tokens held (:func:`held_bytes`) at each position."""

    def observe(self, tokens: int) -> None:
        if not self.positions or tokens - self.positions[-1] >= self.stride:
            self._sample(tokens)

    def finish(self, tokens: int) -> None:
        """Record the final figures whatever the stride."""
        if not self.positions or self.positions[-1] != tokens:
            self._sample(tokens)

    def _sample(self, tokens: int) -> None:
        self.positions.append(tokens)
        self.bytes.append(footprint(self.cache))
        self.held.append(held_bytes(self.cache))
