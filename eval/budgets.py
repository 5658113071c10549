"""Budget sweeps: each policy spec at each total budget (``--budgets``) or kept fraction (``--ratios``).

A policy class says how a budget maps onto its keywords (``PolicyCache.budget_parameters``);
``None`` means it keeps every token (full, FP8), and it runs once. A spec that already sets a
keyword that sizes the budget (``PolicyCache.budget_keys``) keeps its own parameters and runs
once as well; keywords that only shape it (SnapKV's ``kernel``) override the budget's. Nothing
here knows a policy by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_kvpolicies import parse_spec
from hf_kvpolicies.specs import policy_constructor


@dataclass(frozen=True)
class PolicyRun:
    """One policy of the sweep: the spec as given, and the budget or ratio to build it at."""

    policy: str
    budget: int | None = None
    ratio: float | None = None

    @property
    def family(self) -> str:
        """The policy's name, with its storage where it is not native (``window int4``): a
        retention in another storage is a family of its own, with its own look and lines."""
        name, parameters = parse_spec(self.policy)
        storage = str(parameters.get("storage", "native")).partition(":")[0]
        return name if storage == "native" else f"{name} {storage}"

    @property
    def label(self) -> str:
        """The row's name: the spec, and the budget or ratio it was swept at."""
        if self.budget is not None:
            return f"{self.policy} @{self.budget}"
        if self.ratio is not None:
            return f"{self.policy} @{self.ratio:g}x"
        return self.policy

    def budget_for(self, context: int) -> int | None:
        """The total budget for a context of ``context`` tokens (a ratio is of the context)."""
        if self.ratio is not None:
            return max(1, round(self.ratio * context))
        return self.budget

    def spec(self, context: int) -> str:
        """The spec to build: the given one with the budget's keywords added."""
        budget = self.budget_for(context)
        if budget is None:
            return self.policy
        name, given = parse_spec(self.policy)
        items = [f"{key}={value}" for key, value in budget_keywords(name, budget).items() if key not in given]
        items += [part for part in self.policy.partition(":")[2].split(",") if part.strip()]
        return f"{name}:{','.join(items)}"


def budget_keywords(name: str, budget: int) -> dict | None:
    constructor = policy_constructor(name)
    return getattr(constructor, "budget_parameters", lambda budget: None)(budget)


def sweeps_budget(spec: str) -> bool:
    """Whether a budget applies to ``spec``: its class maps budgets, and it sets none of the keys that size it."""
    name, given = parse_spec(spec)
    keywords = budget_keywords(name, 1)
    if keywords is None:
        return False
    sizing = getattr(policy_constructor(name), "budget_keys", None) or tuple(keywords)
    return not set(sizing) & set(given)


def expand(policies: list[str], budgets: tuple[int, ...] = (), ratios: tuple[float, ...] = ()) -> list[PolicyRun]:
    """Every spec at every budget and ratio where one applies; the others once."""
    runs = []
    for spec in policies:
        if sweeps_budget(spec) and (budgets or ratios):
            runs += [PolicyRun(spec, budget=budget) for budget in budgets]
            runs += [PolicyRun(spec, ratio=ratio) for ratio in ratios]
        else:
            runs.append(PolicyRun(spec))
    return runs
