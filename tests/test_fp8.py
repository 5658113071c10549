"""FP8 storage: exact decoding, precision at the chosen scale, outliers, the native residual, honest
bytes, and composition with every retention policy (same kept tokens, logits within tolerance)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from helpers import generated_logits, left_padded, prefill_then_decode
from tiny_models import random_ids, tiny_llama, tiny_qwen3
from transformers.cache_utils import Fp8QuantizedLayer

from hf_kvpolicies import (
    FP8Cache,
    FP8Storage,
    FullCache,
    SlidingWindowCache,
    available_storages,
    from_spec,
)
from hf_kvpolicies.storage import NativeStorage, storage_factory
from hf_kvpolicies.storage.cpu_kernels import portable
from hf_kvpolicies.storage.fp8 import DEFAULT_RESIDUAL, MAX_EXPONENT, MIN_EXPONENT, float8_format

E4M3 = float8_format("float8_e4m3fn")
E5M2 = float8_format("float8_e5m2")
FORMATS = [E4M3, E5M2]
LOGIT_TOLERANCE = 0.05
"""Largest |logit difference| allowed against FullCache on the tiny models (logits ~0.6 in size)."""
EMBEDDED_TOLERANCE = 0.05
"""Largest |logit difference| against full precision on SmolLM2-135M, relative to the largest
logit, over 32 greedy steps after a 160-token prompt (measured 0.026, no token changed)."""


def stock_dequantise(fmt, payload: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The reference decoder: PyTorch's own float8 conversion times ``2**(code - 127)``."""
    return payload.view(fmt.dtype).float() * torch.exp2(codes.float() - 127)


def fake_quantised(fmt, x: torch.Tensor) -> torch.Tensor:
    return stock_dequantise(fmt, *fmt.quantise(x)).to(x.dtype)


class FakeFP8Storage(NativeStorage):
    """Native storage holding exactly the numbers an fp8 storage without residual returns: running a
    policy on it and on ``FP8Storage(residual=0)`` must give the same tokens, positions and logits."""

    def write(self, slots, keys, values, ranks=None) -> None:
        super().write(slots, fake_quantised(E4M3, keys), fake_quantised(E4M3, values))

    def rewrite_keys_static(self, slots, keys, values) -> None:
        super().rewrite_keys_static(slots, fake_quantised(E4M3, keys), values)

    def as_written(self, keys, values, ranks=None):
        return fake_quantised(E4M3, keys), fake_quantised(E4M3, values)


def wide_range(shape, seed: int = 0) -> torch.Tensor:
    """Random values whose tokens span 10^-30 .. 10^30 in magnitude."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    return x * torch.logspace(-30, 30, shape[-2])[:, None]


# --- the format ------------------------------------------------------------------------------
@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu-decoder", "float8-conversion"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_byte_decodes_exactly_at_every_scale(fmt, accelerator):
    """The CPU's integer decoder and the float8 conversion an accelerator runs
    (:func:`~hf_kvpolicies.storage.cpu_kernels.portable` takes it here) give the same bits."""
    finite = torch.arange(256, dtype=torch.uint8)
    finite = finite[torch.isfinite(finite.view(fmt.dtype).float())]
    codes = torch.tensor([1, 2, 60, 100, 120, 127, 134, 200, 246], dtype=torch.uint8)
    payload, codes = finite[None, :].expand(len(codes), -1), codes[:, None].expand(-1, len(finite))
    reference = stock_dequantise(fmt, payload, codes)
    with portable() if accelerator else contextlib.nullcontext():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert torch.equal(fmt.dequantise(payload, codes, dtype), reference.to(dtype)), dtype


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_scale_codes_are_the_smallest_that_fit_at_every_magnitude(fmt):
    """The code read from a magnitude's bits is ``127 + e`` for the smallest ``e`` with
    ``amax <= max * 2**e`` (clamped to the format's range), checked against ``frexp``."""
    magnitudes = torch.cat([
        torch.logspace(-44, 38, 4001, dtype=torch.float64).float(),
        torch.tensor([fmt.max, fmt.max * (1 + 2**-23), fmt.max * (1 - 2**-24), 1.0, 2.0**-126, 2.0**-149]),
    ])
    magnitudes = torch.cat([magnitudes, magnitudes * 2.0**-80, magnitudes.nextafter(torch.tensor(float("inf")))])
    magnitudes = magnitudes[torch.isfinite(magnitudes) & (magnitudes > 0)]
    _, codes = fmt.quantise(torch.stack([magnitudes, -magnitudes / 3], dim=-1))
    mantissa, exponent = torch.frexp(magnitudes)
    top_mantissa, top_exponent = math.frexp(fmt.max)
    e = (exponent - top_exponent + (mantissa > top_mantissa)).clamp(MIN_EXPONENT, MAX_EXPONENT)
    assert torch.equal(codes[:, 0].long(), e + 127)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_trip_precision_at_the_chosen_scale(fmt):
    x = wide_range((2, 1, 3, 64, 32))
    payload, codes = fmt.quantise(x)
    scale = torch.exp2(codes.float() - 127)
    out = fmt.dequantise(payload, codes, torch.float32)
    assert torch.isfinite(out).all()
    # the largest element of each (token, head) lands in the format's top binade: nothing saturates
    top = x.abs().amax(-1, keepdim=True) / scale
    assert (top <= fmt.max).all() and (top > fmt.max / 2).all()
    half_ulp = 2.0 ** -(fmt.mantissa_bits + 1)
    smallest_normal = torch.finfo(fmt.dtype).smallest_normal
    normal = x.abs() / scale >= smallest_normal
    relative = (out - x).abs() / x.abs()
    assert (relative[normal] <= half_ulp).all()
    subnormal_step = smallest_normal * 2.0 ** -fmt.mantissa_bits
    assert ((out - x).abs()[~normal] <= scale.expand_as(x)[~normal] * subnormal_step / 2).all()


def test_zeros_subnormals_and_the_scale_edge():
    x = torch.zeros(1, 1, 5, 8)
    x[0, 0, 1] = torch.tensor([448.0, -448.0, 1.0, -1.0, 0.0, -0.0, 2.0**-9, 0.0])  # on the grid at scale 1
    # at scale 2**-20: the edge, subnormals (exact, a tie rounded to even, one below half a step)
    grid = torch.tensor([448.0, -448.0, 224.0, 2.0**-7, 3 * 2.0**-9, 1.5 * 2.0**-9, 2.0**-11, 0.0])
    x[0, 0, 2] = grid * 2.0**-20
    x[0, 0, 3] = 1e-40  # fp32 subnormals
    x[0, 0, 4] = torch.tensor([3e38, -3e38, 1.0, 0, 0, 0, 0, 0])  # near fp32's maximum
    payload, codes = E4M3.quantise(x)
    out = E4M3.dequantise(payload, codes, torch.float32)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 0, 0], torch.zeros(8))  # an all-zero token stays zero
    assert torch.equal(out[0, 0, 1], x[0, 0, 1])
    assert int(codes[0, 0, 1]) == 127 and int(codes[0, 0, 2]) == 127 - 20  # the largest maps to 448 exactly
    rounded = torch.tensor([448.0, -448.0, 224.0, 2.0**-7, 3 * 2.0**-9, 2 * 2.0**-9, 0.0, 0.0])
    assert torch.equal(out[0, 0, 2], rounded * 2.0**-20)
    assert (out[0, 0, 3] - x[0, 0, 3]).abs().max() <= 2.0**-136  # half a subnormal step at the smallest scale
    assert torch.allclose(out[0, 0, 4, :2], x[0, 0, 4, :2], rtol=2**-4)


def test_later_token_larger_than_all_before_is_not_clipped():
    storage = FP8Storage(residual=0)
    quiet = torch.randn(1, 2, 10, 16)
    storage.allocate(quiet, 16)
    storage.write(0, quiet, quiet)
    loud = 1000.0 * torch.randn(1, 2, 1, 16)
    storage.write(10, loud, loud)
    keys, _ = storage.read(11)
    assert ((keys[:, :, 10] - loud[:, :, 0]).abs() <= 2**-4 * loud[:, :, 0].abs()).all()
    # a per-tensor scale frozen at the first update clips it to ~448 x that scale
    layer = Fp8QuantizedLayer()
    layer.update(quiet, quiet)
    frozen, _ = layer.update(loud, loud)
    assert not ((frozen[:, :, 10] - loud[:, :, 0]).abs() <= 2**-4 * loud[:, :, 0].abs()).all()


def test_outlier_channel_is_no_worse_than_transformers_fp8():
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 3, 64, 64, generator=generator)
    keys[..., 7] *= 1e4  # one channel 10^4 x larger than the rest
    storage = FP8Storage(residual=0)
    storage.allocate(keys, 64)
    storage.write(0, keys, keys)
    ours, _ = storage.read(64)
    layer = Fp8QuantizedLayer()
    layer.update(keys, keys)
    theirs = layer._dequantize(layer._quantized_keys)
    assert torch.isfinite(ours).all() and torch.isfinite(theirs).all()
    rest = torch.ones(64, dtype=torch.bool)
    rest[7] = False
    for part in (slice(None), rest):  # everything, and the ordinary channels alone
        our_error = (ours - keys)[..., part].norm()
        their_error = (theirs - keys)[..., part].norm()
        assert our_error <= their_error, (our_error, their_error)
    assert ((ours - keys).abs() <= 2**-4 * keys.abs() + 1e-3 * keys[..., 7:8].abs()).all()


# --- the storage -----------------------------------------------------------------------------
def random_writes(storage, native, capacity: int, steps: int, seed: int, batch: int = 2, heads: int = 2):
    """Write the same random tokens to both storages, with every slot form, rewrites included."""
    generator = torch.Generator().manual_seed(seed)
    like = torch.zeros(batch, heads, 1, 8)
    storage.allocate(like, capacity)
    native.allocate(like, capacity)
    native.write(0, torch.zeros(batch, heads, capacity, 8), torch.zeros(batch, heads, capacity, 8))
    for step in range(steps):
        q = int(torch.randint(1, 4, (1,), generator=generator))
        keys, values = (torch.randn(batch, heads, q, 8, generator=generator) for _ in range(2))
        form = step % 3
        if form == 0:
            slots = int(torch.randint(0, capacity - q + 1, (1,), generator=generator))
        elif form == 1:
            slots = torch.randperm(capacity, generator=generator)[:q]
        else:
            slots = torch.stack([torch.randperm(capacity, generator=generator)[:q] for _ in range(batch * heads)])
            slots = slots.view(batch, heads, q)
        storage.write(slots, keys, values)
        native.write(slots, keys, values)
        yield slots, keys, values


@pytest.mark.parametrize("residual", [0, 1, 5, 40])
def test_each_slot_holds_its_last_write_natively_or_quantised(residual):
    storage, native = FP8Storage(residual=residual), NativeStorage()
    capacity = 12
    for slots, keys, values in random_writes(storage, native, capacity, steps=40, seed=residual):
        got = torch.stack(storage.read(capacity))
        exact = torch.stack(native.read(capacity))
        quantised = fake_quantised(E4M3, exact)
        is_exact = (got == exact).all(-1)
        assert (is_exact | (got == quantised).all(-1)).all()
        if residual:  # the tokens just written are always among the native ones
            newest = torch.stack([keys, values])[:, :, :, -min(residual, keys.shape[-2]) :]
            if isinstance(slots, int):
                tail = got[:, :, :, slots + keys.shape[-2] - newest.shape[-2] : slots + keys.shape[-2]]
            else:
                index = slots[..., -newest.shape[-2] :]
                tail = torch.stack(storage.gather(index))
            assert torch.equal(tail, newest)
        else:
            assert torch.equal(got, quantised)
    # gathers and short reads agree with the full read
    full = torch.stack(storage.read(capacity))
    assert torch.equal(torch.stack(storage.read(5)), full[..., :5, :])
    shared = torch.tensor([7, 0, 3])
    assert torch.equal(torch.stack(storage.gather(shared)), full[..., shared, :])
    per_head = torch.randint(0, capacity, (2, 2, 4))
    expected = full.gather(3, per_head[None, ..., None].expand(2, -1, -1, -1, 8))
    assert torch.equal(torch.stack(storage.gather(per_head)), expected)


def test_residual_keeps_the_most_recent_writes_natively():
    storage = FP8Storage(residual=8)
    tokens = torch.randn(1, 2, 50, 16)
    storage.allocate(tokens, 64)
    for t in range(50):  # appends, as a full cache decodes
        storage.write(t, tokens[:, :, t : t + 1], tokens[:, :, t : t + 1])
    keys, _ = storage.read(50)
    assert torch.equal(keys[:, :, 42:], tokens[:, :, 42:])
    assert torch.equal(keys[:, :, :42], fake_quantised(E4M3, tokens[:, :, :42]))
    assert not torch.equal(keys[:, :, :42], tokens[:, :, :42])
    # rewriting shadowed slots (re-rotated sinks) refreshes them in place: fresher tokens stay native
    sinks = torch.randn(1, 2, 2, 16)
    storage.write(48, sinks, sinks)
    storage.write(50, tokens[:, :, :1], tokens[:, :, :1])
    keys, _ = storage.read(51)
    assert torch.equal(keys[:, :, 43:48], tokens[:, :, 43:48])
    assert torch.equal(keys[:, :, 48:50], sinks)


def test_ring_smaller_than_the_residual_stays_native():
    model = tiny_llama()
    ids = random_ids(1, 40)
    native = prefill_then_decode(model, ids, SlidingWindowCache(model, window=6), prefill=10)
    fp8 = prefill_then_decode(model, ids, SlidingWindowCache(model, window=6, storage=FP8Storage.factory(residual=16)), 10)
    torch.testing.assert_close(fp8[:, 10:], native[:, 10:], rtol=0, atol=1e-5)


def test_reorder_moves_scales_and_residual_with_the_payload():
    storage = FP8Storage(residual=3)
    rows = torch.randn(3, 2, 10, 8) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1, 1)
    storage.allocate(rows, 10)
    storage.write(0, rows, -rows)
    before = torch.stack(storage.read(10))
    order = torch.tensor([2, 2, 0])
    storage.reorder(order)
    assert torch.equal(torch.stack(storage.read(10)), before[:, order])


def test_nbytes_counts_payload_scales_and_residual():
    storage = FP8Storage(residual=5)
    like = torch.zeros(2, 3, 1, 64, dtype=torch.bfloat16)
    storage.allocate(like, 100)
    payload, scales = 2 * 2 * 3 * 100 * 64, 2 * 2 * 3 * 100
    residual = 2 * 2 * 3 * 5 * 64 * 2 + 2 * 3 * 5 * 8
    assert storage.nbytes == payload + scales + residual
    storage.grow(300)
    assert storage.nbytes == 3 * (payload + scales) + residual
    assert FP8Storage(residual=0).nbytes == 0


def test_memory_at_4096_tokens_is_about_half_of_bf16():
    model = tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head dim 64
    full, fp8 = FullCache(model), FP8Cache(model)
    for start in range(0, 4096, 1024):  # a chunked prefill's updates, without the forwards
        chunk = torch.randn(1, 1, 1024, 64, dtype=torch.bfloat16)
        for cache in (full, fp8):
            for layer in range(len(cache.layers)):
                cache.update(chunk, chunk, layer)
    ratio = fp8.get_memory_footprint() / full.get_memory_footprint()
    assert ratio <= 0.55, ratio


# --- caches ----------------------------------------------------------------------------------
def test_fp8_cache_logits_close_to_full_cache(tiny_model):
    ids = random_ids(2, 40)
    reference = prefill_then_decode(tiny_model, ids, FullCache(tiny_model), prefill=20)
    for residual in (0, DEFAULT_RESIDUAL):
        logits = prefill_then_decode(tiny_model, ids, FP8Cache(tiny_model, residual=residual), prefill=20)
        assert (logits - reference).abs().max() <= LOGIT_TOLERANCE, residual
    # a residual that covers every token reproduces the full cache
    covered = prefill_then_decode(tiny_model, ids, FP8Cache(tiny_model, residual=64), prefill=20)
    torch.testing.assert_close(covered, reference, rtol=0, atol=1e-5)


def test_fp8_without_residual_is_exactly_fake_quantisation(tiny_model):
    """The fp8 layer returns the very numbers of a native cache fed fake-quantised tokens."""
    ids = random_ids(2, 30)
    fake = prefill_then_decode(tiny_model, ids, FullCache(tiny_model, storage=FakeFP8Storage), prefill=12)
    fp8 = prefill_then_decode(tiny_model, ids, FP8Cache(tiny_model, residual=0), prefill=12)
    torch.testing.assert_close(fp8, fake, rtol=0, atol=1e-5)


def test_batch_rows_are_independent():
    model = tiny_llama()
    ids = random_ids(3, 24)  # rows differ in content, hence in scales
    batch = prefill_then_decode(model, ids, FP8Cache(model, residual=4), prefill=10)
    for row in range(3):
        alone = prefill_then_decode(model, ids[row : row + 1], FP8Cache(model, residual=4), prefill=10)
        torch.testing.assert_close(batch[row : row + 1], alone, rtol=0, atol=1e-5)


def test_beam_search_matches_fake_quantisation():
    model = tiny_llama()
    ids = random_ids(2, 12)
    kwargs = dict(max_new_tokens=10, num_beams=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        fake = model.generate(ids, cache=FullCache(model, storage=FakeFP8Storage), **kwargs)
        fp8 = model.generate(ids, cache=FP8Cache(model, residual=0), **kwargs)
    assert torch.equal(fp8.sequences, fake.sequences)
    torch.testing.assert_close(fp8.sequences_scores, fake.sequences_scores, rtol=0, atol=1e-5)


def test_crop_then_decode():
    model = tiny_llama()
    ids = random_ids(1, 30)
    cache = FP8Cache(model, residual=6)
    with torch.no_grad():
        model(ids[:, :20], cache=cache, use_cache=True)
        cache.crop(-5)  # back to 15 tokens: the residual still shadows slots 15..19
        logits = prefill_then_decode(model, ids[:, 15:], cache, prefill=1)
    reference = prefill_then_decode(model, ids, FullCache(model), prefill=16)[:, 15:]
    assert (logits - reference).abs().max() <= LOGIT_TOLERANCE


def test_embedded_model_greedy_tokens(embedded):
    """32 greedy tokens with FP8Cache; FullCache's logits on the same tokens (one uncached forward)."""
    from eval.data import embedded_text, tokenize

    model, tokenizer = embedded
    ids = tokenize(tokenizer, embedded_text(), 160)
    prompt = ids.shape[1]
    with torch.no_grad():
        out = model.generate(
            ids, cache=FP8Cache(model), max_new_tokens=32, min_new_tokens=32, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
        logits = torch.stack(out.logits, dim=1)
        reference = model(out.sequences[:, :-1]).logits[:, prompt - 1 :]
    difference = float((logits - reference).abs().max() / reference.abs().max())
    differing = int((out.sequences[:, prompt:] != reference.argmax(-1)).sum())
    print(
        f"\nembedded model, 32 greedy tokens: max |logit diff| {difference:.4f} of the largest logit; "
        f"full precision would have chosen another token at {differing} of the 32 steps"
    )
    assert difference <= EMBEDDED_TOLERANCE
    assert differing <= 3


# --- composition -----------------------------------------------------------------------------
def kept_positions(cache) -> list[torch.Tensor]:
    return [
        layer.retention.kept_positions() if hasattr(layer.retention, "kept_positions")
        else layer.retention.slot_pos[: layer.retention.live].sort().values
        for layer in cache.layers
    ]


def policies():
    from hf_kvpolicies import H2OCache, SinkCache

    return {
        "window": lambda m, s: SlidingWindowCache(m, window=8, storage=s),
        "sink-cache": lambda m, s: SinkCache(m, sink_tokens=2, window=8, storage=s),
        "sink-absolute": lambda m, s: SinkCache(m, sink_tokens=2, window=8, positions="absolute", storage=s),
        "h2o": lambda m, s: H2OCache(m, heavy=6, recent=4, storage=s),
    }


@pytest.mark.parametrize("policy", ["window", "sink-cache", "sink-absolute", "h2o"])
def test_composed_policy_is_exactly_fake_quantised_native(policy, tiny_model):
    """Same numbers in, same tokens kept and same logits out: fp8 changes nothing but the values."""
    make = policies()[policy]
    ids = random_ids(2, 36)
    fake_cache, fp8_cache = make(tiny_model, FakeFP8Storage), make(tiny_model, "fp8:residual=0")
    fake = prefill_then_decode(tiny_model, ids, fake_cache, prefill=14)
    fp8 = prefill_then_decode(tiny_model, ids, fp8_cache, prefill=14)
    torch.testing.assert_close(fp8, fake, rtol=0, atol=1e-5)
    for ours, theirs in zip(kept_positions(fp8_cache), kept_positions(fake_cache)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("policy", ["window", "sink-cache", "sink-absolute", "h2o"])
def test_composed_policy_close_to_native(policy):
    make = policies()[policy]
    model = tiny_llama()
    ids = random_ids(2, 40)
    native_cache, fp8_cache = make(model, "native"), make(model, FP8Storage.factory(residual=2))
    native = prefill_then_decode(model, ids, native_cache, prefill=14)
    fp8 = prefill_then_decode(model, ids, fp8_cache, prefill=14)
    assert (fp8 - native).abs().max() <= LOGIT_TOLERANCE
    for ours, theirs in zip(kept_positions(fp8_cache), kept_positions(native_cache)):
        assert torch.equal(ours, theirs)


# --- padded batches: the rows agree with themselves run alone -------------------------------
def padded_against_alone(model, spec: str) -> float:
    """Max logit difference over 12 generated tokens between a left-padded batch of 3 rows (40,
    9 and 20 tokens: longer and shorter than the budget) and each row run alone."""
    rows = [random_ids(1, 40, seed=1), random_ids(1, 9, seed=2), random_ids(1, 20, seed=3)]
    ids, mask = left_padded(rows)
    batch = generated_logits(model, ids, from_spec(model, spec), 12, attention_mask=mask)
    return max(
        float((batch[i] - generated_logits(model, row, from_spec(model, spec), 12)[0]).abs().max())
        for i, row in enumerate(rows)
    )


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("spec", [
    "window:window=12,storage=fp8",
    "window:window=12,storage=fp8:residual=0",
    "window:window=30,storage=fp8:residual=4",
    "sink:sink_tokens=2,window=10,storage=fp8",
    "sink:sink_tokens=2,window=10,storage=fp8:residual=0",
    "sink:sink_tokens=4,window=20,positions=absolute,storage=fp8:residual=3",
    "sink:sink_tokens=4,window=40,storage=fp8",
    "sink:sink_tokens=4,window=6,storage=fp8:residual=8",
    "sink:sink_tokens=4,window=6,positions=absolute,storage=fp8:residual=8",
    "sink:sink_tokens=12,window=8,storage=fp8:residual=16",
])
def test_padded_batch_in_fp8_equals_each_row_alone(make_model, spec, one_thread):
    """A prompt longer than the budget attends before it is stored (concatenate path), a shorter
    one after (in place): both see the new tokens as the storage holds them. Each row's residual
    holds its own newest tokens, its sinks included, also where the ring is shorter than the
    residual (window 6) and where a row (9 tokens) has fewer real tokens than its sinks (12)."""
    assert padded_against_alone(make_model(), spec) < 1e-5


@pytest.mark.parametrize("residual", [0, 2, 8])
@pytest.mark.parametrize("policy", ["h2o:heavy=24,recent=24", "snapkv:budget=48,window=8", "tova:budget=48", "knorm:budget=48"])
def test_padded_batch_of_a_scored_policy_in_fp8_equals_each_row_alone(policy, residual, one_thread):
    """Rows of 20, 60 and 100 tokens at budget 48: the batch's prompt is over budget, so it attends
    before it is stored, while the 20-token row alone is written in place first; both see its
    tokens as the fp8 storage holds them (all but the newest ``residual`` rounded)."""
    model = tiny_llama()
    spec = f"{policy},storage=fp8:residual={residual}"
    rows = [random_ids(1, n, seed=i + 1) for i, n in enumerate((20, 60, 100))]
    ids, mask = left_padded(rows)
    batch = generated_logits(model, ids, from_spec(model, spec), 12, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = generated_logits(model, row, from_spec(model, spec), 12)[0]
        assert (batch[i] - alone).abs().max() < 1e-5


# --- options and bad input -------------------------------------------------------------------
def test_storage_options_reach_composed_policies():
    model = tiny_llama()
    cache = from_spec(model, "window:window=8,storage=fp8:residual=3;dtype=e5m2")
    storage = cache.layers[0].storage
    assert (storage.residual, storage.format.dtype) == (3, torch.float8_e5m2)
    cache = from_spec(model, "fp8:residual=0,dtype=float8_e5m2")
    assert isinstance(cache, FP8Cache)
    assert (cache.layers[0].storage.residual, cache.layers[0].storage.format.dtype) == (0, torch.float8_e5m2)
    default = SlidingWindowCache(model, storage="fp8").layers[0].storage
    assert (default.residual, default.format.dtype) == (DEFAULT_RESIDUAL, torch.float8_e4m3fn)
    assert "fp8" in available_storages()


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ("fp16", "unknown storage .* choose one of .*fp8"),
        ("fp8:residual=-1", "residual must be an integer >= 0"),
        ("fp8:residual=many", "residual must be an integer >= 0"),
        ("fp8:dtype=float8_e3m4", "'float8_e4m3fn', 'float8_e5m2'"),
        ("fp8:dtype=int8", "'float8_e4m3fn', 'float8_e5m2'"),
        ("fp8:window=3", "options are residual=<int> and dtype="),
        ("native:residual=1", "takes no options"),
    ],
)
def test_bad_storage_is_refused(storage, message):
    with pytest.raises(ValueError, match=message):
        storage_factory(storage)


def test_bad_fp8_cache_arguments_are_refused(monkeypatch):
    model = tiny_llama()
    with pytest.raises(ValueError, match="residual must be an integer >= 0"):
        FP8Cache(model, residual=-1)
    with pytest.raises(ValueError, match="residual must be an integer >= 0"):
        from_spec(model, "fp8:residual=-2")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        FP8Cache(model, dtype=torch.float16)
    monkeypatch.delattr(torch, "float8_e5m2")
    lacking = "this PyTorch build .* has no torch.float8_e5m2; fp8 storage supports 'float8_e4m3fn'"
    with pytest.raises(ValueError, match=lacking):
        FP8Cache(model, dtype="e5m2")
