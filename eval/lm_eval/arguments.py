"""The hf-kvpolicies model's own arguments (``policy=``, ``protocol=``, ``budget=``), checked before
the model loads (the spec's name, keys and values, the protocol, the budget) and once it has
loaded (what the constructor refuses for this model); each problem is one
:class:`ModelArgumentError` whose message names the fix."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from hf_kvpolicies import parse_spec

from ..budgets import PolicyRun, budget_keywords, sweeps_budget
from ..protocols import PROTOCOLS
from ..sweep import build_policy


class ModelArgumentError(ValueError):
    """A model argument the hf-kvpolicies model cannot take; ``hf-kvpolicies lm-eval`` prints it
    on one line and exits with status 2."""


@dataclass(frozen=True)
class Feeding:
    """How a protocol feeds the tokens before those that are decoded (see :mod:`.scoring`)."""

    streams: bool
    """They go through the budget (in chunks where chunking is exact, else one at a time); else in
    one forward the policy trims after."""
    generate_prefills: bool
    """For generation: ``generate()``'s own first forward takes the whole prompt (else every prompt
    token but the last is fed first, and ``generate()`` feeds the last one as a decode step)."""


FEEDINGS = {
    "prefill": Feeding(streams=False, generate_prefills=True),
    "streamed": Feeding(streams=True, generate_prefills=False),
    "last-token-kept": Feeding(streams=False, generate_prefills=False),
}
"""The protocols lm-eval's requests run under: those that take a prompt as one piece. ``context``
keeps a question apart from its context, which an lm-eval request does not have."""


@dataclass(frozen=True)
class PolicyArguments:
    """The policy run (the spec as given, and ``budget=`` if given) and the protocol."""

    run: PolicyRun
    protocol: str

    @property
    def spec(self) -> str:
        """The spec built: the given one, with the budget's keywords where ``budget=`` is given."""
        return self.run.spec(0)

    @property
    def feeding(self) -> Feeding:
        return FEEDINGS[self.protocol]

    def build(self, model: PreTrainedModel) -> Cache:
        """A fresh cache for ``model``; what its constructor refuses is a :class:`ModelArgumentError`."""
        return build_policy(model, self.spec, f"policy={self.spec!r}", ModelArgumentError)


def check_arguments(policy: object, protocol: object, budget: object, others: dict[str, object]) -> PolicyArguments:
    """The model's own arguments checked before anything loads. ``others`` are the arguments lm-eval
    would hand on to ``from_pretrained``: one that is a key of the policy's spec was cut off it by
    lm-eval's splitting of ``--model_args`` at commas."""
    if not isinstance(policy, str):
        raise ModelArgumentError(f"policy={policy!r} is not a policy spec: write policy=NAME[:key=value,...], e.g. policy=window:window=256")
    try:
        name, _ = parse_spec(policy)
    except ValueError as error:
        raise ModelArgumentError(f"policy={policy!r}: {error}") from error
    for key, value in others.items():
        try:
            parse_spec(f"{name}:{key}={value}")
        except ValueError:
            continue
        raise ModelArgumentError(
            f"policy={policy!r} lost {key}={value} to lm-eval's splitting of --model_args at commas: "
            f"quote the spec, policy=\"{policy},{key}={value}\""
        )
    if protocol not in FEEDINGS:
        choices = ", ".join(FEEDINGS)
        if protocol in PROTOCOLS:
            raise ModelArgumentError(
                f"protocol={protocol!r} keeps a question apart from its context, which lm-eval's requests do not have: choose one of {choices}"
            )
        raise ModelArgumentError(f"unknown protocol={protocol!r}: choose one of {choices}")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ModelArgumentError(f"budget={budget!r} must be an integer >= 1 (tokens kept per layer), e.g. budget=128")
        if not sweeps_budget(policy):
            why = "keeps every token" if budget_keywords(name, 1) is None else "sets its own budget"
            raise ModelArgumentError(f"budget={budget} applies to a bare bounded spec (window, snapkv...); policy={policy!r} {why}: drop budget=")
    return PolicyArguments(PolicyRun(policy, budget=budget), protocol)
