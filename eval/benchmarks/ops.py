"""Operations a decode step launches, per policy x storage (``python -m eval.benchmarks.ops``).

On a GPU, small-batch decoding runs eager and is bound by kernel launches: every aten operation a
cache adds to a layer's decode step is paid in every layer, at every token. This counts the aten
operations dispatched by one eager decode step (a ``TorchDispatchMode`` counter) after a prompt
of ``--context`` tokens, for ``DynamicCache`` and every registered policy at ``--budget`` in each
storage, and the operations each adds per layer. A count does not depend on the machine, so a
CPU run shows the launch budget a GPU will pay. Beside every operation dispatched, the table gives
the kernels among them: the operations that are not views (:data:`VIEWS` make none, though each
still costs the dispatcher's time on the host).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

from hf_kvpolicies import available_policies, available_storages, from_spec
from hf_kvpolicies.specs import parse_spec, policy_constructor
from hf_kvpolicies.storage.cpu_kernels import portable

from ..budgets import expand


VIEWS = frozenset({
    "view", "_unsafe_view", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "t", "permute",
    "alias", "detach", "as_strided", "reshape", "split", "unbind", "lift_fresh",
})
"""Operations that make a view: no kernel, no memory traffic."""


class OperationCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active, by name (``counts``).

    ``layer``: only those dispatched while that module runs (its forward hooks open and close the
    count; :meth:`close` removes them). ``views``: whether operations that only make a view
    (:data:`VIEWS`) count. While it counts, integer storage reads through PyTorch operations
    (:func:`~hf_kvpolicies.storage.cpu_kernels.portable`): the count is of the path every device
    runs, whether or not this machine built the CPU kernels.
    """

    def __init__(self, layer: torch.nn.Module | None = None, views: bool = True) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.views = views
        self.inside = layer is None
        self.hooks = [] if layer is None else [
            layer.register_forward_pre_hook(lambda *args: setattr(self, "inside", True)),
            layer.register_forward_hook(lambda *args: setattr(self, "inside", False)),
        ]

    def __enter__(self) -> OperationCounter:
        self._portable = portable()
        self._portable.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._portable.__exit__(*exc)

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    @property
    def kernels(self) -> int:
        """The operations counted that are not views (each a kernel launch on a GPU)."""
        return sum(n for name, n in self.counts.items() if name not in VIEWS)

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.inside and (self.views or name not in VIEWS):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def operations_per_step(model: PreTrainedModel, cache: Cache, ids: torch.Tensor, context: int) -> tuple[int, int]:
    """Aten operations, and the kernels among them, of one eager decode step after ``context``
    prompt tokens and one decode step (so that the counted step is a steady one: a bounded policy
    is full and evicting)."""
    model(ids[:, :context], cache=cache, use_cache=True)
    model(ids[:, context : context + 1], cache=cache, use_cache=True)
    with OperationCounter() as counter:
        model(ids[:, context + 1 : context + 2], cache=cache, use_cache=True)
    return counter.count, counter.kernels


@dataclass(frozen=True)
class Count:
    label: str
    operations: int
    kernels: int
    """The operations that are not views."""


def contenders(budget: int, policies: list[str] | None = None) -> list[tuple[str, Callable[[PreTrainedModel], Cache]]]:
    """DynamicCache, then every policy (a name or a spec, ``snapkv:chunk=16``) at ``budget`` (as the
    sweep builds it) in every storage it takes, or in the one its spec names."""
    made: list[tuple[str, Callable[[PreTrainedModel], Cache]]] = [
        ("DynamicCache", lambda model: DynamicCache(config=model.config))
    ]
    for policy in policies or available_policies():
        name, keywords = parse_spec(policy)
        takes_storage = "storage" in inspect.signature(policy_constructor(name)).parameters
        storages = available_storages() if takes_storage and "storage" not in keywords else ["native"]
        for storage in storages:
            spec = policy if storage == "native" else f"{policy}{',' if keywords else ':'}storage={storage}"
            [run] = expand([spec], (budget,))
            built = run.spec(budget)
            made.append((built, lambda model, built=built: from_spec(model, built)))
    return made


def count(model: PreTrainedModel, ids: torch.Tensor, context: int, budget: int, policies: list[str] | None = None) -> list[Count]:
    rows = []
    for label, make in contenders(budget, policies):
        try:
            cache = make(model)
        except ValueError:  # a policy that cannot serve this model (it says why at construction)
            continue
        rows.append(Count(label, *operations_per_step(model, cache, ids, context)))
    return rows


def table(rows: list[Count], layers: int, context: int) -> str:
    """Markdown: operations per step, the ratio to DynamicCache and what each adds per layer; the
    same for the kernels among them."""
    base, kernels = rows[0].operations, rows[0].kernels
    lines = [
        f"| cache ({context}-token context) | ops / step | vs DynamicCache | added per layer | kernels / step | kernels added per layer |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.label} | {row.operations:,} | {row.operations / base:.2f}x | {(row.operations - base) / layers:+.1f} "
            f"| {row.kernels:,} | {(row.kernels - kernels) / layers:+.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from hf_kvpolicies.models import load_model

    from ..data import embedded_text, tokenize

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--policies", nargs="*", help="registered policy names or specs, e.g. snapkv:chunk=16 (default: all, each in every storage)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    ids = tokenize(tokenizer, embedded_text(), args.context + 2)
    print(table(count(model, ids, args.context, args.budget, args.policies), model.config.num_hidden_layers, args.context))
    print(f"\nmodel {args.model}, budget {args.budget}, eager decode step, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
