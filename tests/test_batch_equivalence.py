"""A batch gives each row what the row gets alone: every registered policy x storage x layer
budgets x {left-padded rows of different lengths, rows of one length} x {fp32, bf16}.

Rows are over and under the budget, so one batch mixes the prompts a policy trims with the ones
it writes in place, and every layer-budget rule (uniform, pyramid, adaptive: each row ranks its
own layers) meets rows whose scores differ. In bf16 and fp16 the model itself is not
batch-invariant (its matmuls round differently for other shapes, by about 2e-3 on these logits in
bf16), so later steps may part where that noise tips a near-tie (an eviction or a greedy token):
there every row must run (no dtype is refused on the way) and its first answer token, which the
whole prompt forward decides, must agree with itself alone as closely as the full cache's rows do.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from helpers import generated_logits, left_padded
from test_h2o import peaked
from tiny_models import char_tokenizer, random_ids, tiny_llama

from hf_kvpolicies import PolicyCache, available_policies, from_spec, parse_spec
from hf_kvpolicies.policies.scored import LAYER_BUDGETS
from hf_kvpolicies.specs import policy_constructor

BUDGET = 24
STEPS = 12
TOKENIZER = char_tokenizer()
PADDED = (50, 11, 30, 24)
"""Prompt lengths of the padded batch: over the budget, under it, over it, at it."""
UNPADDED = (40, 40, 40, 40)
HALF_SLACK = 4.0
"""A half-precision row's first logits may differ from itself alone by at most this many times the
full cache's largest difference there (the model's own batch noise)."""


CHANNEL_KEYS = "int4:residual=4;group_size=4"
"""Integer storage with keys grouped per channel along slots (small enough to quantise within the
test): each row's groups hold its own tokens, so it is held as alone, and is compared in float64,
where the model's own batch noise cannot tip a code across a rounding boundary."""


def specs(channel_keys: bool = False) -> list[str]:
    """Every registered policy at ``BUDGET`` (each class maps it onto its keywords), under every
    layer-budget rule it takes, in native, fp8 and int4 storage with keys per token (and, with
    ``channel_keys``, per channel)."""
    chosen = []
    for name in available_policies():
        constructor = policy_constructor(name)
        budget = constructor.budget_parameters(BUDGET) or {}
        takes = inspect.signature(constructor).parameters
        rules = [{"layer_budgets": rule} for rule in LAYER_BUDGETS] if "layer_budgets" in takes else [{}]
        storages = [{}, {"storage": "fp8:residual=4"}, {"storage": "int4:key_axis=token;residual=4"}] if "storage" in takes else [{}]
        storages += [{"storage": CHANNEL_KEYS}] if channel_keys and "storage" in takes else []
        for rule in rules:
            for storage in storages:
                items = {**budget, **rule, **storage}
                chosen.append(name + (":" + ",".join(f"{k}={v}" for k, v in items.items()) if items else ""))
    # a budget as a fraction of the prompt is a fraction of each row's own prompt
    chosen += [f"h2o:heavy=0.25,recent=0.25,layer_budgets={rule}" for rule in LAYER_BUDGETS]
    return chosen


def build(model, spec: str) -> PolicyCache:
    name, kwargs = parse_spec(spec)
    if name == "kvzip":
        kwargs["tokenizer"] = TOKENIZER
    return policy_constructor(name)(model, **kwargs)


@functools.cache
def model_in(dtype: torch.dtype):
    return peaked(tiny_llama(), factor=8.0).to(dtype)


def differences(spec: str, lengths: tuple[int, ...], dtype: torch.dtype, steps: int = STEPS) -> list[float]:
    """Each row's largest logit difference from itself alone over ``steps`` generated tokens."""
    model = model_in(dtype)
    rows = [random_ids(1, n, seed=i + 1) for i, n in enumerate(lengths)]
    ids, mask = left_padded(rows)
    batch = generated_logits(model, ids, build(model, spec), steps, attention_mask=mask)
    assert batch.shape == (len(rows), steps, model.config.vocab_size) and torch.isfinite(batch).all()
    return [
        float((batch[i].float() - generated_logits(model, row, build(model, spec), steps)[0].float()).abs().max())
        for i, row in enumerate(rows)
    ]


@pytest.mark.parametrize("lengths", [PADDED, UNPADDED], ids=["padded", "unpadded"])
@pytest.mark.parametrize("spec", specs(channel_keys=True))
def test_each_row_of_a_batch_gets_what_it_gets_alone(spec, lengths, one_thread):
    got = differences(spec, lengths, torch.float64 if CHANNEL_KEYS in spec else torch.float32)
    assert max(got) < 1e-5, got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec", specs())
def test_half_precision_batches_run_and_agree_within_the_models_own_noise(spec, dtype, one_thread):
    noise = max(differences("full", PADDED, dtype, steps=1))
    got = differences(spec, PADDED, dtype, steps=1)  # the first answer token: before any eviction tips
    assert max(got) <= HALF_SLACK * max(noise, 2e-3), (got, noise)
    differences(spec, PADDED, dtype)  # and the whole generation runs in this dtype
