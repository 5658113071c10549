"""Re-rotation by the model's own RoPE: rotating a key rotated at ``p`` by ``d`` gives exactly the
key the model itself rotates at ``p + d``, for every rotary variant that allows it; the others
are refused with a clear error."""

from __future__ import annotations

import sys

import pytest
import torch
from tiny_models import COMMON, tiny_gemma3, tiny_llama, tiny_qwen3
from transformers import AutoConfig, AutoModelForCausalLM

from hf_kvpolicies import SinkCache
from hf_kvpolicies.rope import rotary_of

SMALL = {**COMMON, "num_hidden_layers": 1}


def tiny(model_type: str, **overrides):
    config = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


VARIANTS = {
    "llama default": lambda: tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama linear": lambda: tiny_llama(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3": lambda: tiny_llama(
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        }
    ),
    "yarn (attention scaling)": lambda: tiny_llama(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    ),
    "qwen3": tiny_qwen3,
    "gemma3 full layers": tiny_gemma3,
    "gpt-neox partial rotary": lambda: tiny(
        "gpt_neox", rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    ),
    "glm interleaved + partial": lambda: tiny("glm"),
    "cohere interleaved": lambda: tiny("cohere"),
}


def model_rotation(model, keys: torch.Tensor, positions: torch.Tensor, layer_type: str) -> torch.Tensor:
    """``keys`` rotated at ``positions`` (``[batch, n]``) by the model's own module and functions."""
    rotary = model.base_model.rotary_emb
    extra = (layer_type,) if isinstance(rotary.rope_type, dict) else ()
    cos, sin = rotary(keys, positions, *extra)
    return sys.modules[type(rotary).__module__].apply_rotary_pos_emb(keys, keys, cos, sin)[1]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rotation_by_d_equals_the_model_rotating_at_p_plus_d(name):
    model = VARIANTS[name]()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, 5, head_dim, generator=generator)
    positions = torch.arange(5).expand(3, 5)
    stored = model_rotation(model, keys, positions, "full_attention")
    rotary = rotary_of(model, "full_attention")
    for offset in (1, 17, 300):
        expected = model_rotation(model, keys, positions + offset, "full_attention")
        torch.testing.assert_close(rotary.rotate(stored, offset), expected, atol=2e-5, rtol=1e-5)
    per_row = torch.tensor([0, 9, 250])
    expected = model_rotation(model, keys, positions + per_row[:, None], "full_attention")
    torch.testing.assert_close(rotary.rotate(stored, per_row), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cos_sin_of_a_device_offset_rotate_as_the_model_does(name):
    """What a static sink step applies: ``keys * cos + turned(keys) * sin`` from a 0-d offset."""
    model = VARIANTS[name]()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    keys = torch.randn(3, 2, 5, head_dim, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(5).expand(3, 5)
    stored = model_rotation(model, keys, positions, "full_attention")
    rotary = rotary_of(model, "full_attention")
    rotary.prepare_cos_sin(stored.device, head_dim)
    turned = rotary.turned(stored)
    for offset in (0, 17, 300):
        cos, sin = rotary.cos_sin(torch.tensor(offset), head_dim)
        expected = model_rotation(model, keys, positions + offset, "full_attention")
        torch.testing.assert_close(stored * cos + turned * sin, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_mean_rotation_over_a_window_is_the_mean_of_the_models_rotations(name):
    """``m . (R^T k)`` equals the mean over the window of the model's own rotation of ``m``, dotted
    with ``k``: layout, partial rotary and attention scaling (YaRN) included, per row's window."""
    model = VARIANTS[name]()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(1)
    means, keys = torch.randn(3, 2, 1, head_dim, generator=generator), torch.randn(3, 2, 5, head_dim, generator=generator)
    start, count = torch.tensor([0, 7, 300]), 40
    positions = start[:, None] + torch.arange(count)
    rotated = model_rotation(model, means.expand(3, 2, count, head_dim), positions, "full_attention").mean(dim=2)
    expected = torch.einsum("bhd,bhkd->bhk", rotated, keys)
    got = torch.einsum("bhd,bhkd->bhk", means[:, :, 0], rotary_of(model).mean_rotation_transposed(keys, start, count))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_frequencies_follow_theta_head_dim_and_partial_rotary():
    llama = rotary_of(VARIANTS["llama default"]())
    head_dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    expected = 500000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(llama.inv_freq, expected, atol=0, rtol=1e-6)
    neox = rotary_of(VARIANTS["gpt-neox partial rotary"]())
    assert neox.rotary_dim == head_dim // 4 and not neox.interleaved
    assert rotary_of(VARIANTS["cohere interleaved"]()).interleaved


def test_gemma3_layer_types_have_their_own_frequencies():
    model = tiny_gemma3(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    })
    full, local = rotary_of(model, "full_attention"), rotary_of(model, "sliding_attention")
    assert full.inv_freq[1] < local.inv_freq[1]
    torch.testing.assert_close(full.inv_freq, model.model.rotary_emb.full_attention_inv_freq.double())


def test_large_offsets_keep_float64_angles():
    rotary = rotary_of(tiny_llama())
    keys = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    once = rotary.rotate(keys, 123_457)
    twice = rotary.rotate(rotary.rotate(keys, 100_000), 23_457)
    torch.testing.assert_close(once, twice, atol=1e-9, rtol=0)
    torch.testing.assert_close(once.norm(), keys.norm())  # a pure rotation: no attention scaling


REFUSED = {
    "dynamic NTK": (
        lambda: tiny_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        "frequencies change with the sequence length",
    ),
    "longrope": (
        lambda: tiny(
            "phi3",
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8, "original_max_position_embeddings": 128,
            },
        ),
        "frequencies change with the sequence length",
    ),
    "no RoPE (GPT-2)": (lambda: tiny("gpt2", n_embd=64, n_layer=1, n_head=4), "no rotary position embedding"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_positions_cache_is_refused_clearly_and_absolute_works(name):
    make, message = REFUSED[name]
    model = make()
    with pytest.raises(ValueError, match=message) as error:
        SinkCache(model, sink_tokens=2, window=4)
    assert "positions='absolute'" in str(error.value)
    cache = SinkCache(model, sink_tokens=2, window=4, positions="absolute")
    ids = torch.randint(3, COMMON["vocab_size"], (1, 12))
    with torch.no_grad():
        for t in range(12):
            model(ids[:, t : t + 1], cache=cache)
    assert cache.get_seq_length() == 12 and cache.kept_tokens() == 6
    # no sinks: nothing to re-rotate, so positions='cache' needs no RoPE
    assert SinkCache(model, sink_tokens=0, window=4).kept_tokens() == 0
