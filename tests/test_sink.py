"""SinkCache against independent references: explicit masks, and a naive cache that re-rotates
un-rotated keys at their in-cache positions at every step (the paper's §3.2, written plainly)."""

from __future__ import annotations

import pytest
import torch
from helpers import generated_logits, left_padded, prefill_then_decode, stream_long, streaming_reference
from tiny_models import random_ids, tiny_gemma3, tiny_llama, tiny_qwen3
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.models.llama.modeling_llama import rotate_half

from hf_kvpolicies import FullCache, SinkCache, SlidingWindowCache, from_spec
from hf_kvpolicies.storage import NativeStorage

ATOL = 1e-4
MODES = ("cache", "absolute")


class NaiveSinkLayer(CacheLayerMixin):
    """Keeps every kept key *un-rotated*; each forward rotates all of them at their index in the
    cache, shifted so that the newest key sits at its absolute position (the queries arrive
    rotated at theirs; a common shift leaves every attention score unchanged). O(cache) per step."""

    is_compileable = False
    is_sliding = False

    def __init__(self, model, layer_type: str | None, sinks: int, window: int, rerotate: bool) -> None:
        super().__init__()
        self.rotary_emb, self.layer_type = model.model.rotary_emb, layer_type
        self.sinks, self.window, self.rerotate = sinks, window, rerotate
        self.seen = 0

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        extra = () if self.layer_type is None else (self.layer_type,)
        cos, sin = self.rotary_emb(x, positions[None], *extra)
        return x * cos[:, None] + rotate_half(x) * sin[:, None]

    def lazy_initialization(self, key_states, value_states) -> None:
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self.rerotate:
            key_states = self.rope(key_states, -torch.arange(self.seen, self.seen + q))
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.seen += q
        n = keys.shape[-2]
        out = self.rope(keys, torch.arange(n) + self.seen - n) if self.rerotate else keys
        keep = torch.arange(n)
        if n > self.sinks + self.window:
            keep = torch.cat([torch.arange(self.sinks), torch.arange(n - self.window, n)])
        self.keys, self.values = keys[:, :, keep], values[:, :, keep]
        return out, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_length = (self.keys.shape[-2] if self.is_initialized else 0) + query_length
        return kv_length, self.seen + query_length - kv_length

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[beam_idx], self.values[beam_idx]


def naive_sink_cache(model, sinks: int, window: int, positions: str) -> Cache:
    """The reference: naive layers on full-attention layers, transformers' own on sliding ones."""
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    per_type = isinstance(model.model.rotary_emb.rope_type, dict)
    layers = [
        DynamicSlidingWindowLayer(model.config.sliding_window)
        if kind == "sliding_attention"
        else NaiveSinkLayer(model, kind if per_type else None, sinks, window, rerotate=positions == "cache")
        for kind in types
    ]
    return Cache(layers=layers)


class CopyingStorage(NativeStorage):
    """Reads return copies, as a quantised storage's do: sinks must be written before the read."""

    def read(self, length: int):
        keys, values = super().read(length)
        return keys.clone(), values.clone()


@pytest.mark.parametrize("positions", MODES)
def test_budget_covering_the_sequence_matches_full_cache(tiny_model, positions):
    ids = random_ids(1, 30)
    expected = prefill_then_decode(tiny_model, ids, FullCache(tiny_model), prefill=12)
    cache = SinkCache(tiny_model, sink_tokens=4, window=26, positions=positions)
    torch.testing.assert_close(prefill_then_decode(tiny_model, ids, cache, prefill=12), expected, atol=1e-5, rtol=0)


def test_absolute_positions_match_the_band_with_sink_columns(tiny_model):
    ids = random_ids(1, 40, seed=1)
    cache = SinkCache(tiny_model, sink_tokens=3, window=5, positions="absolute")
    got = prefill_then_decode(tiny_model, ids, cache, prefill=1)
    torch.testing.assert_close(got, streaming_reference(tiny_model, ids, window=5, sinks=3), atol=ATOL, rtol=0)
    without_sinks = streaming_reference(tiny_model, ids, window=5)
    assert (got[:, 9:] - without_sinks[:, 9:]).abs().max() > 1e-2  # the sinks are attended to
    assert cache.kept_tokens(cache.first_policy_layer) == 8 and cache.get_seq_length() == 40


@pytest.mark.parametrize("prefill", [1, 20])
def test_cache_positions_match_the_naive_rerotating_reference(tiny_model, prefill):
    """Token by token from the first token, and after a prompt longer than the budget."""
    ids = random_ids(1, 40, seed=2)
    got = prefill_then_decode(tiny_model, ids, SinkCache(tiny_model, sink_tokens=2, window=6), prefill=prefill)
    expected = prefill_then_decode(tiny_model, ids, naive_sink_cache(tiny_model, 2, 6, "cache"), prefill=prefill)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    absolute = streaming_reference(tiny_model, ids, window=6, sinks=2, causal_prefix=prefill)
    assert (got[:, 10:] - absolute[:, 10:]).abs().max() > 1e-3  # re-rotation changes the result


@pytest.mark.parametrize("positions", MODES)
def test_chunked_prefill_and_copying_storage_match_the_reference(positions):
    """Chunks into a full ring, then decoding, with a storage whose reads are copies."""
    model = tiny_qwen3()
    ids = random_ids(1, 44, seed=3)
    caches = [SinkCache(model, sink_tokens=2, window=6, positions=positions, storage=CopyingStorage),
              naive_sink_cache(model, 2, 6, positions)]
    outputs = []
    with torch.no_grad():
        for cache in caches:
            logits = [model(ids[:, s : s + 10], cache=cache).logits for s in range(0, 30, 10)]
            logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(30, 44)]
            outputs.append(torch.cat(logits, dim=1))
    torch.testing.assert_close(outputs[0], outputs[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("positions", MODES)
@pytest.mark.parametrize(
    "make,sinks,window",
    [(tiny_llama, 2, 4), (tiny_llama, 4, 3), (tiny_llama, 3, 8), (tiny_gemma3, 2, 4)],
    ids=["llama-2+4", "llama-4+3", "llama-3+8", "gemma3-2+4"],
)
def test_left_padded_batch_gives_each_row_its_result_alone(make, sinks, window, positions):
    """The sinks are each row's first real tokens. Pads of 0, 1, 2 and 10 tokens cover a row with
    fewer pads than sinks, as many, and more (its 2-token prompt is shorter than some sink counts,
    so generated tokens become its sinks); budgets trim at prefill or wrap while decoding."""
    model = make()
    rows = [random_ids(1, n, seed=n) for n in (12, 11, 10, 2)]
    ids, mask = left_padded(rows)

    def make_cache():
        return SinkCache(model, sink_tokens=sinks, window=window, positions=positions)

    batched = generated_logits(model, ids, make_cache(), 12, attention_mask=mask)
    for i, row in enumerate(rows):
        torch.testing.assert_close(batched[i], generated_logits(model, row, make_cache(), 12)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("positions", MODES)
def test_beam_search_matches_the_reference(positions):
    """A 2-token prompt with 4 sinks: two sinks are generated tokens, which differ between beams,
    so the sink copies must follow every reorder."""
    model = tiny_llama()
    ids = random_ids(2, 2, seed=6)
    options = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, num_beams=3)
    expected = model.generate(ids, cache=naive_sink_cache(model, 4, 5, positions), **options)
    got = model.generate(ids, cache=SinkCache(model, sink_tokens=4, window=5, positions=positions), **options)
    assert torch.equal(got, expected)


def test_no_sinks_is_the_sliding_window():
    model = tiny_llama()
    ids = random_ids(1, 30, seed=7)
    expected = prefill_then_decode(model, ids, SlidingWindowCache(model, window=5), prefill=8)
    got = prefill_then_decode(model, ids, SinkCache(model, sink_tokens=0, window=5), prefill=8)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("positions", MODES)
def test_memory_is_constant_and_decoding_writes_in_place(positions):
    model = tiny_llama()
    ids = random_ids(1, 10_000, seed=5)
    cache = SinkCache(model, sink_tokens=4, window=60, positions=positions)
    at_2000 = stream_long(model, cache, ids)
    assert cache.get_seq_length() == 10_000 and cache.kept_tokens() == 64
    assert cache.get_memory_footprint() == at_2000
    sink_copies = 3 * 4 * model.config.num_key_value_heads * 16 * 4  # keys, their rotate_half, values: 4 sinks, fp32
    extra = sink_copies if positions == "cache" else 0
    ring = 2 * 65 * model.config.num_key_value_heads * 16 * 4 + 65 * 8  # slots and their positions
    assert at_2000 == model.config.num_hidden_layers * (ring + extra)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"sink_tokens": -1}, r"sink_tokens must be an integer >= 0"),
        ({"sink_tokens": 2.0}, r"sink_tokens must be an integer >= 0"),
        ({"sink_tokens": "4"}, r"sink_tokens must be an integer >= 0"),
        ({"window": 0}, r"window must be an integer >= 1"),
        ({"window": 1.5}, r"window must be an integer >= 1"),
        ({"positions": "relative"}, r"positions must be one of 'cache', 'absolute'"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SinkCache(tiny_llama(), **kwargs)


def test_spec_builds_the_cache_and_rejects_bad_values():
    model = tiny_llama()
    cache = from_spec(model, "sink:sink_tokens=2,window=9,positions=absolute")
    assert (cache.sink_tokens, cache.window, cache.positions) == (2, 9, "absolute")
    with pytest.raises(ValueError, match="positions"):
        from_spec(model, "sink:positions=relative")
    with pytest.raises(ValueError, match="sink_tokens"):
        from_spec(model, "sink:sink_tokens=-2")


@torch.no_grad()
def teacher_forced(model, cache, ids, mask, steps: torch.Tensor, reorder_at: int, index: torch.Tensor):
    """Prompt, then ``steps`` tokens one by one; after ``reorder_at`` of them the rows are reordered
    by ``index`` (as beam search does) and continue with the tokens of their new rows."""
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = [model(ids, attention_mask=mask, position_ids=position, cache=cache).logits[:, -1:]]
    for t in range(steps.shape[1]):
        if t == reorder_at:
            cache.reorder_cache(index)
            mask, position, steps, logits = mask[index], position[index], steps[index], [x[index] for x in logits]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position = position[:, -1:] + 1
        logits.append(model(steps[:, t : t + 1], attention_mask=mask, position_ids=position, cache=cache).logits)
    return torch.cat(logits, dim=1)


def test_reordering_rows_moves_their_sinks_pads_and_rotations():
    """Rows with 0 and 3 pads, reordered to (1, 1, 0) after the sinks were displaced and rotated:
    each row continues exactly as the row it now holds would alone."""
    model = tiny_llama()
    rows = [random_ids(1, 12, seed=8), random_ids(1, 9, seed=9)]
    ids, mask = left_padded(rows)
    steps = random_ids(2, 20, seed=10)
    index = torch.tensor([1, 1, 0])
    make = lambda: SinkCache(model, sink_tokens=2, window=4)  # noqa: E731
    got = teacher_forced(model, make(), ids, mask, steps, reorder_at=12, index=index)
    for i, source in enumerate(index.tolist()):
        alone = teacher_forced(model, make(), rows[source], torch.ones_like(rows[source]), steps[source : source + 1],
                               reorder_at=-1, index=torch.tensor([0]))
        torch.testing.assert_close(got[i], alone[0], atol=ATOL, rtol=0)


def test_fp8_storage_rotates_from_exact_copies_without_drift():
    """Through an fp8 storage (no native residual: every read is quantised), re-rotated sinks are
    re-quantised from the exact copies each step, so positions='cache' stays as close to its
    reference as positions='absolute' (no rounding piles up over the stream)."""
    model = tiny_llama()
    ids = random_ids(1, 64, seed=11)
    errors = {}
    for positions in MODES:
        expected = prefill_then_decode(model, ids, naive_sink_cache(model, 2, 6, positions), prefill=1)
        got = prefill_then_decode(model, ids, SinkCache(model, 2, 6, positions, storage="fp8:residual=0"), prefill=1)
        errors[positions] = (got - expected)[:, 32:].abs().max().item()
    assert 0 < errors["cache"] < 2 * errors["absolute"] + 1e-3, errors
