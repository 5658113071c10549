"""Catching device->host reads on the CPU, where every tensor is a CPU tensor.

A value is *device-side* when it lives where the model lives: the model's parameters and
buffers, its inputs, and everything computed from them or created with an explicit ``device=``
(``torch.full(..., device=keys.device)``); host bookkeeping is what the library builds without a
device (``torch.arange(n)``, plain ints). :class:`HostSyncGuard` tracks that mark through every
aten op (a ``TorchDispatchMode``; the output of an op with a marked input is marked) and, while
``strict``, records each read of a marked tensor's value made from hf-kvpolicies code: the ops
that need the value on the host (``_local_scalar_dense`` behind ``int``/``bool``/``.item()``,
``equal``, ``nonzero``) and the Python methods that copy to the host without dispatching on a
CPU tensor (``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``). On a GPU each of them
would stall the launch queue. Integer storage reads through its PyTorch operations here, the path a
GPU runs (its CPU kernels write tensors the guard could not follow).
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hf_kvpolicies
from hf_kvpolicies.storage.cpu_kernels import portable

MARK = "_on_device"
LIBRARY = str(Path(hf_kvpolicies.__file__).parent)
READ_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.nonzero.default,
}
FACTORIES = ("arange", "full", "zeros", "ones", "empty", "tensor", "eye", "zeros_like", "ones_like", "full_like")
HOST_COPIES = ("tolist", "cpu", "numpy")


def mark(tensor: torch.Tensor) -> torch.Tensor:
    setattr(tensor, MARK, True)
    return tensor


def is_marked(value: object) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, MARK, False)


class HostSyncGuard(TorchDispatchMode):
    """Marks device-side tensors; records reads of their values from library code while ``strict``."""

    def __init__(self) -> None:
        super().__init__()
        self.strict = False
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        marked = any(is_marked(leaf) for leaf in tree_leaves((args, kwargs)))
        if marked and func in READ_OPS:
            self.record(str(func))
        out = func(*args, **kwargs)
        if marked:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    mark(leaf)
        return out

    def record(self, what: str) -> None:
        if not self.strict:
            return
        frames = [frame for frame in traceback.extract_stack() if frame.filename.startswith(LIBRARY)]
        if frames:
            where = frames[-1]
            self.reads.append(f"{what} at {Path(where.filename).name}:{where.lineno} ({where.line})")


@contextmanager
def guarded(model: torch.nn.Module, monkeypatch):
    """A :class:`HostSyncGuard` active for the block, with ``model``'s parameters and buffers marked."""
    guard = HostSyncGuard()
    for tensor in (*model.parameters(), *model.buffers()):
        mark(tensor)
    for name in FACTORIES:
        monkeypatch.setattr(torch, name, _device_factory(getattr(torch, name)))
    for name in HOST_COPIES:
        monkeypatch.setattr(torch.Tensor, name, _host_copy(guard, getattr(torch.Tensor, name), name))
    monkeypatch.setattr(torch.Tensor, "to", _to(guard, torch.Tensor.to))
    with guard, portable():
        yield guard


def _device_factory(factory):
    def create(*args, **kwargs):
        out = factory(*args, **kwargs)
        return mark(out) if kwargs.get("device") is not None else out

    return create


def _host_copy(guard: HostSyncGuard, method, name: str):
    def copy(self, *args, **kwargs):
        if not is_marked(self):
            return method(self, *args, **kwargs)
        guard.record(f".{name}()")
        return _on_host(method(self, *args, **kwargs))

    return copy


def _on_host(value):
    """What a copy to the host returns: on the CPU the same tensor, here an unmarked copy."""
    if not isinstance(value, torch.Tensor):
        return value
    copy = value.clone()
    setattr(copy, MARK, False)
    return copy


def _to(guard: HostSyncGuard, method):
    """``.to("cpu")`` reads a marked tensor back to the host; ``.to(some_tensor.device)`` moves a
    host tensor to where the model lives (the library's idiom), so its result is marked."""

    def to(self, *args, **kwargs):
        target = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        out = method(self, *args, **kwargs)
        if isinstance(target, str) and target == "cpu" and is_marked(self):
            guard.record(".to('cpu')")
            return _on_host(out)
        if isinstance(target, torch.device) and not is_marked(out):
            out = mark(out.view(out.shape))  # a new tensor object sharing the storage, as a copy to the device would be
        return out

    return to
