"""Pyramid and adaptive layer budgets make layers return different numbers of keys, while
transformers builds one mask from the first layer's sizes: each layer gets its own exact mask.

Checked where a wrong mask would show: eager decoding (its mask is always built) against sdpa
decoding (which needs none for an unpadded batch), a second multi-token chunk after the trim, and
a left-padded batch against each row alone. Without the per-layer masks these crash with a size
mismatch or attend to the wrong keys.
"""

from __future__ import annotations

import pytest
import torch
from helpers import generated_logits, left_padded
from test_h2o import peaked
from tiny_models import random_ids, tiny_llama

from hf_kvpolicies import H2OCache, KNormCache, SnapKVCache

CACHES = {
    "h2o-pyramid": lambda m: H2OCache(m, heavy=5, recent=5, layer_budgets="pyramid"),
    "knorm-pyramid": lambda m: KNormCache(m, budget=10, recent=2, layer_budgets="pyramid"),
    "snapkv-adaptive": lambda m: SnapKVCache(m, budget=10, window=3, kernel=3, layer_budgets="adaptive"),
}


def model_for(implementation: str):
    model = peaked(tiny_llama(num_hidden_layers=4), factor=8.0)
    model.set_attn_implementation(implementation)
    return model


@torch.no_grad()
def chunked_logits(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Prefill 20 tokens, decode 10 one at a time, then a 12-token chunk, then 4 more steps."""
    out = [model(ids[:, :20], cache=cache).logits]
    for t in range(20, 30):
        out.append(model(ids[:, t : t + 1], cache=cache).logits)
    out.append(model(ids[:, 30:42], cache=cache).logits)
    for t in range(42, 46):
        out.append(model(ids[:, t : t + 1], cache=cache).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", sorted(CACHES))
def test_layers_of_different_sizes_give_eager_the_logits_of_sdpa(name, one_thread):
    ids = random_ids(1, 46, seed=4)
    eager, sdpa = model_for("eager"), model_for("sdpa")
    cache = CACHES[name](eager)
    logits = chunked_logits(eager, cache, ids)
    sizes = {layer.retention.kept for layer in cache.layers}
    assert len(sizes) > 1 or name.endswith("adaptive")  # pyramid: the layers really differ
    torch.testing.assert_close(logits, chunked_logits(sdpa, CACHES[name](sdpa), ids), atol=2e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["h2o-pyramid", "knorm-pyramid"])
def test_layers_of_different_sizes_keep_padded_rows_as_alone(name, implementation, one_thread):
    """A left-padded batch of three gives each row its logits alone, pyramid budgets. (Adaptive
    budgets are shared by the rows of a batch, so a row's layer sizes depend on its batch.) KNorm
    generates a loop of one token here: its copies tie in key norm, and only exact ties (scores
    rounded, :mod:`hf_kvpolicies.policies.knorm`) keep the batch from breaking them otherwise
    than the row alone (it differed by ~3e-3 in logits before)."""
    model = model_for(implementation)
    rows = [random_ids(1, n, seed=s) for n, s in [(24, 1), (17, 2), (11, 3)]]
    ids, mask = left_padded(rows)
    together = CACHES[name](model)
    logits = generated_logits(model, ids, together, 24, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = CACHES[name](model)
        torch.testing.assert_close(logits[i : i + 1], generated_logits(model, row, alone, 24), atol=2e-5, rtol=0)
        pads = ids.shape[1] - row.shape[1]
        for a, b in zip(alone.layers, together.layers):
            theirs = a.retention.kept_positions()[0]
            assert torch.equal(b.retention.kept_positions()[i][:, -theirs.shape[-1] :] - pads, theirs)
