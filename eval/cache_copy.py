"""A copy of a cache that shares the model: where each of several questions asked of one
compressed context starts from (the ``multiquery`` protocol).

A bounded cache cannot be rolled back to the end of the context (``crop`` refuses: eviction loses
what a rollback needs), and prefilling the context again per question costs a forward over the
whole context (and KVzip's reconstruction pass) each time. A deep copy of the cache as the context
left it costs a copy of what it holds: its storage and its retention's state (positions, scores,
counters). What a cache refers to of the model (the dispatcher's hooks, the modules KVzip replays
the context through, the config) is the model's own, shared by the copy, never copied.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers.cache_utils import Cache


def copy_cache(cache: Cache, model: nn.Module) -> Cache:
    """A deep copy of ``cache`` (storage and retention state) that refers to ``model`` itself:
    every module of the model and whatever the modules hold is shared."""
    modules = list(model.modules())
    held = [value for module in modules for value in vars(module).values()]  # the dispatcher sits on the decoder
    shared = [*modules, *model.parameters(), *model.buffers(), *held]
    return copy.deepcopy(cache, {id(item): item for item in shared})
