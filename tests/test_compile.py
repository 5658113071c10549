"""Compiled decoding: every bounded policy (and the pre-sized full caches) has a static decode step.

Each case prefills past the budget eagerly, then decodes 64 greedy tokens (fp32) twice with fresh
caches: eagerly, and through ``torch.compile(model.forward, fullgraph=True)`` with a counting
backend (dynamo traces the whole step; no inductor codegen, so the tests stay fast). The compiled
step must trace at most twice (one recompile) over the 64 steps, and give the same tokens. One
inductor test runs the generated code itself.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import char_tokenizer, random_ids, tiny_gemma3, tiny_llama
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from transformers import CompileConfig

from hf_kvpolicies import (
    ExpectedAttentionCache,
    FP8Cache,
    FullCache,
    H2OCache,
    KeyDiffCache,
    KNormCache,
    KVzipCache,
    SinkCache,
    SlidingWindowCache,
    SnapKVCache,
    TOVACache,
)

PROMPT = 12
STEPS = 64
NOT_STATIC = "cannot take this decode step inside a compiled forward"

POLICIES = {
    "window": lambda model, storage: SlidingWindowCache(model, window=8, storage=storage),
    "sink-cache": lambda model, storage: SinkCache(model, sink_tokens=2, window=8, storage=storage),
    "sink-absolute": lambda model, storage: SinkCache(model, sink_tokens=2, window=8, positions="absolute", storage=storage),
    "full-presized": lambda model, storage: FullCache(model, max_length=PROMPT + STEPS + 1, storage=storage),
    "h2o": lambda model, storage: H2OCache(model, heavy=4, recent=4, storage=storage),
    "snapkv": lambda model, storage: SnapKVCache(model, budget=8, window=3, kernel=3, storage=storage),
    "tova": lambda model, storage: TOVACache(model, budget=8, storage=storage),
    "knorm": lambda model, storage: KNormCache(model, budget=8, recent=2, storage=storage),
    "keydiff": lambda model, storage: KeyDiffCache(model, budget=8, recent=2, storage=storage),
    "expected_attention": lambda model, storage: ExpectedAttentionCache(model, budget=8, sinks=2, storage=storage),
    "snapkv-chunk": lambda model, storage: SnapKVCache(model, budget=8, window=2, kernel=3, chunk=3, storage=storage),
    "kvzip": lambda model, storage: KVzipCache(
        model, budget=8, recent=2, layer_budgets="uniform", head_budgets="uniform", tokenizer=char_tokenizer(), storage=storage
    ),
    # layers of their own sizes, heads that share a pool: each layer's attention gets its own mask
    "h2o-pooled-heads": lambda model, storage: H2OCache(model, heavy=4, recent=4, head_budgets="adaptive", storage=storage),
    "h2o-pyramid": lambda model, storage: H2OCache(model, heavy=4, recent=4, layer_budgets="pyramid", storage=storage),
    "snapkv-adaptive-layers": lambda model, storage: SnapKVCache(
        model, budget=8, window=3, kernel=3, layer_budgets="adaptive", storage=storage
    ),
    "kvzip-defaults": lambda model, storage: KVzipCache(model, budget=8, recent=2, tokenizer=char_tokenizer(), storage=storage),
}


@torch.no_grad()
def decode(model, cache, prompt: torch.Tensor, steps: int, forward=None) -> list[int]:
    """Greedy tokens: an eager prefill, then ``steps`` single-token forwards through ``forward``."""
    forward = forward or model.forward
    token = model(prompt, cache=cache).logits[:, -1:].argmax(-1)
    tokens = []
    for step in range(steps):
        position = torch.full((prompt.shape[0], 1), prompt.shape[1] + step)
        token = forward(input_ids=token, cache=cache, position_ids=position).logits[:, -1:].argmax(-1)
        tokens.append(token)
    return torch.cat(tokens, dim=1).tolist()


def kept_positions(cache) -> list[list[int]]:
    """Per layer, the positions kept (per row and head for scored layouts), from host bookkeeping."""
    kept = []
    for layer in cache.layers:
        layer.host_state()
        retention = layer.retention
        if hasattr(retention, "kept_positions"):
            kept.append(retention.kept_positions().tolist())
        else:
            kept.append(retention.slot_pos[retention.kept_slots()].tolist())
    return kept


INT_STORAGE = "int4:group_size=4;residual=4"
"""An integer storage whose key groups are quantised within the 64 steps (its default residual would
hold most of them natively)."""


STORED_LAYOUTS = ["window", "sink-cache", "full-presized", "h2o", "h2o-pooled-heads", "snapkv-adaptive-layers", "kvzip-defaults"]
"""The write patterns a stored format's static step meets: one shared slot (a ring, an append), the
sinks' keys rewritten, a slot per row and head, pooled heads, layers of their own sizes. Every policy
compiles on native storage; each stored format compiles under each pattern (that every policy's
static step gives its eager logits in every format is tested without compiling, below)."""


@pytest.mark.parametrize(
    "name, storage",
    [(name, "native") for name in sorted(POLICIES)] + [(name, s) for s in ("fp8", INT_STORAGE) for name in STORED_LAYOUTS],
)
def test_compiled_decoding_traces_once_and_matches_eager(name, storage, one_thread):
    model = tiny_llama()
    prompt = random_ids(1, PROMPT, seed=3)
    eager_cache, compiled_cache = POLICIES[name](model, storage), POLICIES[name](model, storage)
    assert eager_cache.is_compileable
    expected = decode(model, eager_cache, prompt, STEPS)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model.forward, fullgraph=True, backend=counter)
    assert decode(model, compiled_cache, prompt, STEPS, compiled) == expected
    assert 1 <= counter.frame_count <= 2  # traced once, recompiled at most once
    assert int(compiled_cache.get_seq_length()) == PROMPT + STEPS
    assert compiled_cache.kept_tokens() == eager_cache.kept_tokens()
    # the host bookkeeping catches up after compiled steps: an eager step continues the stream
    with torch.no_grad():
        for cache in (eager_cache, compiled_cache):
            model(torch.tensor([[5]]), cache=cache)
    assert kept_positions(compiled_cache) == kept_positions(eager_cache)
    if name.startswith(("window", "sink")):  # the ring's host replay keeps what the policy defines
        total, sinks = PROMPT + STEPS + 1, 0 if name == "window" else 2
        assert kept_positions(compiled_cache)[0] == list(range(sinks)) + list(range(total - 8, total))


SLIDING_MODEL_POLICIES = sorted(set(POLICIES) - {"kvzip", "kvzip-defaults"})
"""KVzip refuses models with sliding layers (its replay needs the whole context in every layer)."""


@pytest.mark.parametrize("name", SLIDING_MODEL_POLICIES)
def test_a_model_with_its_own_sliding_layers_compiles(name, one_thread):
    """Gemma 3: the policy on the full-attention layers, transformers' window on the sliding ones
    (rings whose slots, once filled, hold the window's last positions); the compiled step traces
    at most twice (the host counts the sliding mask reads become symbolic after one recompile)."""
    model = tiny_gemma3()
    prompt = random_ids(1, PROMPT, seed=9)
    eager_cache, compiled_cache, host = (POLICIES[name](model, "native") for _ in range(3))
    assert eager_cache.is_compileable
    for layer in host.layers:
        layer.static_allowed = False
    expected = decode(model, eager_cache, prompt, STEPS)
    assert decode(model, host, prompt, STEPS) == expected  # the static steps keep the policy's tokens
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model.forward, fullgraph=True, backend=counter)
    assert decode(model, compiled_cache, prompt, STEPS, compiled) == expected
    assert 1 <= counter.frame_count <= 2
    with torch.no_grad():
        for cache in (eager_cache, compiled_cache):
            model(torch.tensor([[5]]), cache=cache)
    kept = kept_positions(compiled_cache)
    assert kept == kept_positions(eager_cache)
    total = PROMPT + STEPS + 1
    assert kept[0] == list(range(total - 7, total))  # the sliding layers keep the model's window (8 with the query)


def test_a_prompt_within_the_budget_fills_the_buffer_statically(one_thread):
    """Unfilled slots are masked: a window longer than the whole stream equals the pre-sized full cache."""
    model = tiny_llama()
    prompt = random_ids(1, 5, seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    windowed = decode(model, SlidingWindowCache(model, window=40), prompt, 20, compiled)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    assert decode(model, FullCache(model, max_length=40), prompt, 20, compiled) == windowed
    assert decode(model, FullCache(model), prompt, 20) == windowed  # the growing full cache, eagerly


def test_inductor_compiled_window_matches_eager(one_thread):
    model = tiny_llama()
    prompt = random_ids(1, PROMPT, seed=5)
    expected = decode(model, SlidingWindowCache(model, window=8), prompt, 12)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True)
    assert decode(model, SlidingWindowCache(model, window=8), prompt, 12, compiled) == expected


@pytest.mark.parametrize(
    "model_name, storage, heads",
    [("llama", "native", "uniform"), ("llama", "fp8", "uniform"), ("gemma3", "native", "uniform"), ("llama", "native", "adaptive")],
)
def test_generate_with_a_compile_config_compiles_the_decode_step(model_name, storage, heads, one_thread):
    """generate() builds a compiled step's masks eagerly, between steps: Gemma 3's sliding mask
    then reads host counts that the compiled steps kept current; pooled heads' own masks are built
    inside the step."""
    model = tiny_llama() if model_name == "llama" else tiny_gemma3()
    prompt = random_ids(2, PROMPT, seed=6)
    options = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = model.generate(prompt, cache=H2OCache(model, heavy=4, recent=4, head_budgets=heads, storage=storage), **options)
    config = CompileConfig(backend="eager", fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
    torch._dynamo.reset()
    counters.clear()
    got = model.generate(
        prompt, cache=H2OCache(model, heavy=4, recent=4, head_budgets=heads, storage=storage), compile_config=config, **options
    )
    assert torch.equal(got, expected)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2  # the decode step, traced once (a recompile at most)


@pytest.mark.parametrize(
    "model_name, storage", [("llama", "native"), ("llama", "fp8"), ("llama", INT_STORAGE), ("gemma3", "native")]
)
def test_generate_grows_a_full_cache_in_blocks_between_compiled_steps(model_name, storage, one_thread):
    """generate() asks for a compiled step's masks before the step: the cache grows there by whole
    blocks (a prompt of 12 in two blocks of 8, then five growths), each size captured again (with
    dynamic shapes after the first), and the tokens are those of the growing full cache (Gemma 3:
    its full-attention layers grow, its sliding layers keep the model's window)."""
    model = tiny_llama() if model_name == "llama" else tiny_gemma3()
    prompt = random_ids(2, PROMPT, seed=6)
    options = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    expected = model.generate(prompt, cache=FullCache(model, storage=storage), **options)
    config = CompileConfig(backend="eager", fullgraph=True)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    cache = FullCache(model, block=8, storage=storage)
    assert cache.is_compileable
    got = model.generate(prompt, cache=cache, compile_config=config, **options)
    assert torch.equal(got, expected)
    assert int(cache.get_seq_length()) == PROMPT + 39
    grown = {layer.storage.capacity for layer in cache.layers if getattr(layer.retention, "block", None)}
    assert grown == {56}  # 51 tokens in whole blocks
    assert 1 <= counters["stats"]["unique_graphs"] <= 3


def test_a_full_cache_in_blocks_grows_in_eager_steps_and_refuses_to_inside_a_compiled_one(one_thread):
    model = tiny_llama()
    prompt = random_ids(1, PROMPT, seed=5)
    expected = decode(model, FullCache(model), prompt, 30)
    eager = FullCache(model, block=8)
    assert decode(model, eager, prompt, 30) == expected  # its own loop, eager: grows before each step's masks
    assert eager.layers[0].retention.static and eager.layers[0].storage.capacity == 48
    cache = FullCache(model, block=16)  # the prompt fills 12 of 16 slots: 4 steps fit
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    assert decode(model, cache, prompt, 4, compiled) == [expected[0][:4]]
    token = torch.tensor([[expected[0][3]]])
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match="grows only between compiled steps"), torch.no_grad():
        compiled(input_ids=token, cache=cache, position_ids=torch.tensor([[PROMPT + 4]]))


def test_is_compileable_exactly_where_decode_steps_are_static():
    model = tiny_llama()
    assert SlidingWindowCache(model, window=4).is_compileable
    assert FullCache(model, max_length=64).is_compileable
    assert FullCache(model, block=64).is_compileable  # grows by blocks, between steps
    assert FP8Cache(model, block=64).is_compileable
    assert FP8Cache(model, max_length=64).is_compileable
    assert not FullCache(model).is_compileable  # grows
    assert not FP8Cache(model).is_compileable
    assert H2OCache(model, heavy=4, recent=4, layer_budgets="pyramid").is_compileable  # each layer's own mask
    assert H2OCache(model, heavy=4, recent=4, head_budgets="adaptive").is_compileable  # and each head's
    assert KVzipCache(model, budget=16, tokenizer=char_tokenizer()).is_compileable  # its defaults: both
    assert SlidingWindowCache(tiny_gemma3(), window=4).is_compileable  # the model's own sliding layers too
    assert not FullCache(tiny_gemma3()).is_compileable  # its full-attention layers grow


def test_a_padded_batch_is_refused_inside_a_compiled_step_and_served_eagerly(one_thread):
    model = tiny_llama()
    ids = random_ids(2, PROMPT, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = SlidingWindowCache(model, window=8)
    assert cache.is_compileable  # before the prefill nothing is known of the padding
    with torch.no_grad():
        token = model(ids, attention_mask=mask, cache=cache).logits[:, -1:].argmax(-1)
    assert not cache.is_compileable  # exact per-row masks from now on: generate() will not compile
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    # fullgraph: dynamo reports the cache's ValueError as its reason (without fullgraph it breaks the
    # graph there and the step runs eagerly, with exact masks)
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match=NOT_STATIC), torch.no_grad():
        compiled(input_ids=token, attention_mask=mask, cache=cache)
    padded_full = FullCache(model, max_length=32)
    with torch.no_grad():
        model(ids, attention_mask=mask[:, :-1], cache=padded_full)
    assert padded_full.is_compileable  # slot j holds position j: transformers' own mask is exact


def test_a_presized_full_cache_refuses_to_grow():
    model = tiny_llama()
    cache = FullCache(model, max_length=10)
    with torch.no_grad():
        model(random_ids(1, 10), cache=cache)
        with pytest.raises(ValueError, match="max_length=10"):
            model(torch.tensor([[5]]), cache=cache)


@torch.no_grad()
def step_logits(model, cache, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """``[steps, vocab]`` logits of eager greedy decoding after an eager prefill."""
    token = model(prompt, cache=cache).logits[:, -1:].argmax(-1)
    logits = []
    for _ in range(steps):
        out = model(input_ids=token, cache=cache).logits[:, -1]
        logits.append(out[0])
        token = out.argmax(-1, keepdim=True)
    return torch.stack(logits)


@pytest.mark.parametrize(
    "model_name, name",
    [("llama", name) for name in sorted(POLICIES)] + [("gemma3", name) for name in SLIDING_MODEL_POLICIES],
)
@pytest.mark.parametrize("storage", ["native", "fp8", "fp8:residual=3", INT_STORAGE, "int2:key_axis=token;residual=3"])
def test_static_steps_give_the_logits_of_the_host_bookkept_path(name, storage, model_name, one_thread):
    """The static step (whole fixed buffer, device indices) and the eager update that the prefill
    and padded batches take (host slot bookkeeping) are two implementations of one policy: they
    must agree step for step (fp8 and int included: which tokens the residual holds natively, when
    a key group is quantised; Gemma 3's own sliding layers included)."""
    model = tiny_llama() if model_name == "llama" else tiny_gemma3()
    prompt = random_ids(1, PROMPT, seed=8)
    static, host = POLICIES[name](model, storage), POLICIES[name](model, storage)
    for layer in host.layers:
        layer.static_allowed = False
    expected = step_logits(model, host, prompt, 24)
    got = step_logits(model, static, prompt, 24)
    assert static.layers[0].retention.static and not host.layers[0].retention.static
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
