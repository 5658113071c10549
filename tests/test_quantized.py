"""Integer storage (int8/int4/int2, KIVI's layout): the codes against a naive quantiser written here
from the definition, every policy against a naive "quantise then dequantise every token"
reference storage, padded batches, beams, bytes counted by hand, and bad input refused."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from helpers import generated_logits, left_padded, prefill_then_decode
from tiny_models import char_tokenizer, random_ids, tiny_llama, tiny_qwen3

from hf_kvpolicies import FullCache, QuantizedStorage, SlidingWindowCache, available_policies, available_storages, from_spec
from hf_kvpolicies.specs import policy_constructor
from hf_kvpolicies.storage import NativeStorage, storage_factory
from hf_kvpolicies.storage.affine import pack, unpack

BITS = (8, 4, 2)
SMALL = "group_size=8;residual=8"
"""Options that quantise most of a 40-token stream on the tiny models (the defaults' residual of
32 would hold nearly all of it natively)."""


# --- the naive quantiser, from the definition ----------------------------------------------------
@functools.cache
def representable(half: torch.dtype) -> torch.Tensor:
    """Every finite number of a 16-bit float format, ascending (float32)."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(half).float()
    return every[torch.isfinite(every)].unique()


def naive_group(x: torch.Tensor, bits: int, half: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups along the last axis: codes, zero points (the largest ``half`` number <= a group's
    minimum) and scales (the smallest ``half`` number >= (max - zero) / (2**bits - 1)), found by a
    binary search over every ``half`` number."""
    grid, x, top_code = representable(half), x.float(), 2**bits - 1
    zero = grid[torch.searchsorted(grid, x.amin(-1).contiguous(), right=True) - 1]
    scale = grid[torch.searchsorted(grid, ((x.amax(-1) - zero) / top_code).contiguous())]
    codes = torch.round((x - zero[..., None]) / scale[..., None]).clamp(0, top_code)
    return torch.where(scale[..., None] > 0, codes, 0).to(torch.uint8), zero, scale


def naive_round_trip(x: torch.Tensor, bits: int, group: int, axis: int) -> torch.Tensor:
    """``x`` quantised and decoded group by group along ``axis`` (-1: channels, -2: tokens)."""
    half = torch.float16 if x.dtype == torch.float16 else torch.bfloat16
    out = torch.empty_like(x)
    moved, target = x.movedim(axis, -1), out.movedim(axis, -1)
    for start in range(0, moved.shape[-1], group):
        codes, zero, scale = naive_group(moved[..., start : start + group], bits, half)
        target[..., start : start + group] = (zero[..., None] + codes.float() * scale[..., None]).to(x.dtype)
    return out


class NaiveQuantized(NativeStorage):
    """Every token held exactly; reads return what the definition says the integer storage holds
    after appends: the last ``residual`` tokens written native, values (and token-axis keys)
    quantised per token, the keys of slots ``[0, sinks)`` native, each key channel group
    ``[k * group, (k + 1) * group)`` quantised over its other written tokens once its first token
    has left the residual. A rewrite pushes nothing."""

    def __init__(self, bits: int, group: int = 8, residual: int = 8, key_axis: str = "channel", sinks: int = 1) -> None:
        super().__init__()
        self.bits, self.group, self.residual, self.key_axis = bits, group, residual, key_axis
        self.sinks = sinks if key_axis == "channel" else 0
        self.order: list[int] = []

    def allocate(self, like, capacity, value_dim=None) -> None:
        super().allocate(like, capacity, value_dim)
        self.order = []

    def grow(self, capacity) -> None:
        order = self.order
        super().grow(capacity)  # allocates anew, then copies the slots
        self.order = order

    def write(self, slots, keys, values, ranks=None, push: bool = True) -> None:
        super().write(slots, keys, values)
        if isinstance(slots, int):
            written = list(range(slots, slots + keys.shape[-2]))
        else:  # appends name the same slots in every row and head
            rows = slots.reshape(-1, slots.shape[-1])
            assert (rows == rows[:1]).all()
            written = rows[0].tolist()
        if push:
            self.order.extend(written)

    def rewrite(self, slots, keys, values) -> None:
        self.write(slots, keys, values, push=False)

    def rewrite_static(self, slots, keys, values) -> None:
        self.write(slots, keys, values, push=False)

    def read(self, length):
        keys, values = (t[:, :, :length].clone() for t in (self.keys, self.values))
        native = set(self.order[len(self.order) - self.residual :]) if self.residual else set()
        end = max(self.order, default=-1) + 1
        quantised = [slot for slot in range(min(length, end)) if slot not in native]
        for slot in quantised:
            values[:, :, slot] = naive_round_trip(self.values[:, :, slot : slot + 1], self.bits, self.group, -1)[:, :, 0]
            if self.key_axis == "token":
                keys[:, :, slot] = naive_round_trip(self.keys[:, :, slot : slot + 1], self.bits, self.group, -1)[:, :, 0]
        if self.key_axis == "channel":
            for start in range(0, min(length, end), self.group):
                first = max(start, self.sinks)  # sinks take no part in a group
                if start in native or first >= min(start + self.group, end):
                    continue  # the group's first token is still native (not quantised yet), or it holds only sinks
                members = self.keys[:, :, first : min(start + self.group, end)]
                decoded = naive_round_trip(members, self.bits, self.group, -2)
                for offset in range(min(decoded.shape[2], length - first)):
                    if first + offset not in native:
                        keys[:, :, first + offset] = decoded[:, :, offset]
        return keys, values

    def read_static(self):
        return self.read(self.capacity)

    def gather(self, slots):
        keys, values = self.read(self.capacity)
        return NativeStorage.gather(_Held(keys, values), slots)

    def as_written(self, keys, values, ranks=None):
        empty = NaiveQuantized(self.bits, self.group, self.residual, self.key_axis, self.sinks)
        empty.allocate(keys, keys.shape[-2], values.shape[-1])
        empty.write(0, keys, values)
        return empty.read(keys.shape[-2])


class _Held(NativeStorage):
    def __init__(self, keys, values) -> None:
        super().__init__()
        self.keys, self.values = keys, values


def storage(bits: int, options: str = SMALL) -> str:
    return f"int{bits}:{options}"


# --- the codes -----------------------------------------------------------------------------------
def awkward(shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Random keys with channel scales from 0.01 to 30, a constant channel on the half grid, one off
    it, a constant token, and an outlier: zero-range groups along both axes."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.logspace(-2, 1.5, shape[-1])
    x[..., 0] = 0.75
    x[..., 1] = 0.1  # no bfloat16 or float16 number: its zero point lies below it, its scale above zero
    x[..., 5, :] = -2.0
    x[..., 7, 3] = 500.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("group", [8, 16, 5], ids=["divides", "half", "ragged"])
@pytest.mark.parametrize("bits", BITS)
def test_codes_and_reads_equal_the_naive_quantiser(bits, group, dtype):
    """Keys per channel (groups of slots) and per token, values per token, channels 24 wide, 45 tokens:
    the packed codes, zero points and scales the storage holds and what it reads back."""
    keys, values = awkward((2, 2, 45, 24), dtype), awkward((2, 2, 45, 24), dtype, seed=1)
    half = torch.float16 if dtype == torch.float16 else torch.bfloat16
    per_token = QuantizedStorage(bits, group, residual=0, key_axis="token")
    per_channel = QuantizedStorage(bits, group, residual=group, key_axis="channel", sinks=0)
    for stored in (per_token, per_channel):
        stored.allocate(keys, 45)
        stored.write(0, keys, values)
    for codes, source in ((per_token.values, values), (per_token.keys, keys), (per_channel.values, values)):
        assert codes.codes.shape[-1] == 24 * bits // 8  # packed: 8 // bits codes a byte
        unpacked = unpack(codes.codes, bits, 24)
        for start in range(0, 24, group):
            expected = naive_group(source[0, 1, 9, start : start + group], bits, half)
            assert torch.equal(unpacked[0, 1, 9, start : start + group], expected[0])
            assert codes.zero[0, 1, 9, start // group].float() == expected[1]
            assert codes.scale[0, 1, 9, start // group].float() == expected[2]
    coded = 45 - group  # the first token of every group before it has left the residual
    unpacked = unpack(per_channel.keys.codes, bits, 24)
    for start in range(0, coded, group):
        for channel in (0, 1, 3, 17):
            expected = naive_group(keys[1, 0, start : start + group, channel], bits, half)
            assert torch.equal(unpacked[1, 0, start : start + group, channel], expected[0][: 45 - start])
            assert per_channel.keys.zero[1, 0, start // group, channel].float() == expected[1]
            assert per_channel.keys.scale[1, 0, start // group, channel].float() == expected[2]
    read_keys, read_values = per_token.read(45)
    assert torch.equal(read_keys, naive_round_trip(keys, bits, group, -1))
    assert torch.equal(read_values, naive_round_trip(values, bits, group, -1))
    read_keys, read_values = per_channel.read(45)
    first = -(-coded // group) * group  # groups quantised over every token they hold, native ones included
    assert torch.equal(read_keys[:, :, :coded], naive_round_trip(keys[:, :, :first], bits, group, -2)[:, :, :coded])
    assert torch.equal(read_keys[:, :, coded:], keys[:, :, coded:])
    assert torch.equal(read_values[:, :, :coded], naive_round_trip(values, bits, group, -1)[:, :, :coded])
    assert torch.equal(read_values[:, :, coded:], values[:, :, coded:])
    assert read_keys.dtype == dtype and torch.isfinite(read_keys).all()


@pytest.mark.parametrize("bits", BITS)
def test_packing_puts_8_over_bits_codes_in_a_byte(bits):
    codes = torch.randint(0, 2**bits, (3, 2, 7, 13), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape[-1] == -(-13 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits, 13), codes)
    if bits < 8:  # planar: byte j holds codes j, j + W, ... from the low bits up
        width = packed.shape[-1]
        assert int(packed[0, 0, 0, 1]) & (2**bits - 1) == int(codes[0, 0, 0, 1])
        assert int(packed[0, 0, 0, 1]) >> bits & (2**bits - 1) == int(codes[0, 0, 0, 1 + width])


def test_a_group_keeps_its_grid_for_a_token_inside_it_and_widens_one_channel_for_one_outside():
    """A slot overwritten inside a quantised key group (a scored policy's free slot): a token within
    the grid leaves every other code as it was; one outside it in one channel changes only that
    channel's grid, which then covers it, and re-rounds only that channel's other tokens, once."""
    stored = QuantizedStorage(4, group_size=8, residual=8)
    keys = torch.randn(1, 1, 16, 4)
    stored.allocate(keys, 16)
    stored.write(0, keys, keys)  # slots 0..7 quantised (group 0), 8..15 native

    def group_zero():
        return stored.keys.codes[:, :, :8].clone(), stored.keys.zero[:, :, 0].clone(), stored.keys.scale[:, :, 0].clone()

    def push_out(count: int) -> None:  # writes to group 1 that push the oldest entries out of the residual
        for slot in range(8, 8 + count):
            stored.write(torch.tensor([[[slot]]]), keys[:, :, slot : slot + 1], keys[:, :, slot : slot + 1])

    codes, zero, scale = group_zero()
    before = stored.read(16)[0]
    inside = before[:, :, 3:4].clone()  # a decoded key lies on the grid
    stored.write(torch.tensor([[[3]]]), inside, inside)
    push_out(8)
    assert all(torch.equal(a, b) for a, b in zip(group_zero(), (codes, zero, scale)))
    outside = inside.clone()
    outside[..., 2] = zero[0, 0, 2].float() - 10.0
    stored.write(torch.tensor([[[5]]]), outside, outside)
    push_out(8)
    after = stored.read(16)[0]
    _, new_zero, new_scale = group_zero()
    unchanged = [0, 1, 3]
    assert torch.equal(new_zero[..., unchanged], zero[..., unchanged]) and torch.equal(new_scale[..., unchanged], scale[..., unchanged])
    assert new_zero[0, 0, 2] <= outside[0, 0, 0, 2] and new_scale[0, 0, 2] > scale[0, 0, 2]
    others = [0, 1, 2, 3, 4, 6, 7]
    assert torch.equal(after[:, :, others][..., unchanged], before[:, :, others][..., unchanged])
    step = new_scale[0, 0, 2].float()
    assert 0 < (after[:, :, others, 2] - before[:, :, others, 2]).abs().max() <= step / 2  # re-rounded once
    assert (after[:, :, 5, 2] - outside[:, :, 0, 2]).abs().max() <= step / 2


def test_ring_smaller_than_the_residual_stays_native():
    model = tiny_llama()
    ids = random_ids(1, 40)
    native = prefill_then_decode(model, ids, SlidingWindowCache(model, window=6), prefill=10)
    quantised = prefill_then_decode(model, ids, SlidingWindowCache(model, window=6, storage="int2:residual=16;group_size=8"), 10)
    torch.testing.assert_close(quantised[:, 10:], native[:, 10:], rtol=0, atol=1e-5)


def test_rewritten_sinks_push_no_recent_token_out_of_the_residual():
    stored = QuantizedStorage(4, group_size=4, residual=4)
    tokens = torch.randn(1, 2, 20, 8)
    stored.allocate(tokens, 20)
    for t in range(20):
        stored.write(t, tokens[:, :, t : t + 1], tokens[:, :, t : t + 1])
    sinks = torch.randn(1, 2, 2, 8)
    stored.rewrite(0, sinks, sinks)  # re-rotated sinks: quantised in place, nothing pushed
    keys, values = stored.read(20)
    assert torch.equal(keys[:, :, 16:], tokens[:, :, 16:]) and torch.equal(values[:, :, 16:], tokens[:, :, 16:])
    assert (keys[:, :, :2] - sinks).abs().max() < 0.5 and not torch.equal(keys[:, :, :2], sinks)


def test_sink_keys_stay_native_and_out_of_their_groups_range():
    keys = torch.randn(1, 2, 40, 8)
    keys[:, :, 0] *= 50.0  # an attention sink's key: an outlier in every channel
    with_sink, without = QuantizedStorage(2, 8, 8, sinks=1), QuantizedStorage(2, 8, 8, sinks=0)
    for stored in (with_sink, without):
        stored.allocate(keys, 40)
        stored.write(0, keys, keys)
    read, plain = with_sink.read(40)[0], without.read(40)[0]
    assert torch.equal(read[:, :, 0], keys[:, :, 0]) and not torch.equal(plain[:, :, 0], keys[:, :, 0])
    assert torch.equal(read[:, :, 1:8], naive_round_trip(keys[:, :, 1:8], 2, 8, -2))  # group 0 without the sink
    assert (read[:, :, 1:8] - keys[:, :, 1:8]).abs().max() < (plain[:, :, 1:8] - keys[:, :, 1:8]).abs().max() / 4
    assert torch.equal(read[:, :, 8:], plain[:, :, 8:])
    assert torch.equal(with_sink.gather(torch.tensor([0, 3]))[0], read[:, :, [0, 3]])
    assert torch.equal(torch.stack(with_sink.as_written(keys, keys)), torch.stack(with_sink.read(40)))


# --- every policy against the naive reference storage -------------------------------------------
def build(model, name: str, storage, budget: int | None = None):
    """``name`` at ``budget`` kept tokens (its class's ``budget_parameters``), or at a budget that
    covers the stream; KVzip writes its repeat prompt with the character tokenizer."""
    constructor = policy_constructor(name)
    kwargs = dict(constructor.budget_parameters(budget or 64) or {})
    if "tokenizer" in inspect.signature(constructor).parameters:
        kwargs["tokenizer"] = char_tokenizer()
    return constructor(model, storage=storage, **kwargs)


def storage_policies() -> list[str]:
    return [name for name in available_policies() if "storage" in inspect.signature(policy_constructor(name)).parameters]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", storage_policies())
def test_a_budget_covering_the_stream_equals_the_naive_reference(name, bits, one_thread):
    """Logits of a 24-token prompt and 16 decode steps, and the scores of the attention-scored
    policies (they score what attention sees: the decoded keys)."""
    model = tiny_llama()
    ids = random_ids(2, 40)
    reference = build(model, name, lambda: NaiveQuantized(bits))
    quantised = build(model, name, storage(bits))
    expected = prefill_then_decode(model, ids, reference, prefill=24)
    got = prefill_then_decode(model, ids, quantised, prefill=24)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    native = prefill_then_decode(model, ids, build(model, name, "native"), prefill=24)
    assert (got - native).abs().max() > 1e-4  # the storage did quantise
    for ours, theirs in zip(quantised.layers, reference.layers):
        if getattr(ours.retention, "scores", None) is not None:
            ours.host_state(), theirs.host_state()
            torch.testing.assert_close(ours.retention.scores, theirs.retention.scores, rtol=0, atol=1e-5)


def kept(cache) -> list[torch.Tensor]:
    return [
        layer.retention.kept_positions() if hasattr(layer.retention, "kept_positions")
        else layer.retention.slot_pos[layer.retention.kept_slots()].sort().values
        for layer in cache.layers
    ]


@pytest.mark.parametrize("name", ["window", "sink", "knorm"])
def test_policies_whose_statistic_ignores_key_values_keep_what_native_storage_keeps(name, one_thread):
    """Window and sink keep by position; KNorm scores each key as the model computed it, which in
    the first layer does not depend on what the storage held (deeper layers' keys do)."""
    model = tiny_llama()
    ids = random_ids(2, 48)
    native = build(model, name, "native", budget=12)
    prefill_then_decode(model, ids, native, prefill=20)
    for bits in BITS:
        quantised = build(model, name, storage(bits, "group_size=4;residual=4"), budget=12)
        prefill_then_decode(model, ids, quantised, prefill=20)
        layers = 1 if name == "knorm" else len(quantised.layers)
        for ours, theirs in zip(kept(quantised)[:layers], kept(native)[:layers]):
            assert torch.equal(ours, theirs), bits


class NaiveChannelGroups:
    """One row and head's key groups under scattered writes (a scored policy's decode steps),
    transcribed from the rules: each write pushes its slot into the residual (the last ``residual``
    writes); the group of the slot it pushes out is quantised then. Its members in the residual
    (and the one pushed out) are fresh, its other written members survivors. Per channel: with no
    survivor, the fresh tokens' own range; with every fresh token within half a step of the grid,
    the grid kept, and the survivors' codes with it; otherwise the grid widened over the fresh
    tokens, the survivors re-encoded from what they read."""

    def __init__(self, bits: int, group: int, residual: int, capacity: int, width: int, sinks: int) -> None:
        self.bits, self.group, self.residual, self.sinks = bits, group, residual, sinks
        self.exact = torch.zeros(capacity, width)
        self.codes = torch.zeros(capacity, width)
        groups = -(-capacity // group)
        self.zero, self.scale = torch.zeros(groups, width), torch.zeros(groups, width)
        self.pushed: list[int] = []
        self.widened = 0  # channels whose grid widened over survivors

    def write(self, slot: int, key: torch.Tensor) -> None:
        self.exact[slot] = key.float()
        self.pushed.append(slot)
        if len(self.pushed) > self.residual:
            departed = self.pushed.pop(0)
            self.quantise(departed // self.group, departed)

    def quantise(self, group: int, departed: int) -> None:
        top_code, grid = 2**self.bits - 1, representable(torch.bfloat16)
        members = range(max(group * self.group, self.sinks), min((group + 1) * self.group, len(self.exact)))
        fresh = [m for m in members if m in self.pushed or m == departed]
        if not fresh:
            return
        survivors = [m for m in members if m not in fresh]
        for channel in range(self.exact.shape[1]):
            zero, scale = self.zero[group, channel].clone(), self.scale[group, channel].clone()
            top = zero + top_code * scale
            fresh_values = self.exact[fresh, channel]
            survivor_values = zero + self.codes[survivors, channel] * scale
            fits = fresh_values.min() >= zero - scale / 2 and fresh_values.max() <= top + scale / 2
            if not (survivors and fits):
                lo, hi = fresh_values.min(), fresh_values.max()
                if survivors:
                    lo, hi = torch.minimum(zero, lo), torch.maximum(top, hi)
                    self.widened += 1
                zero = grid[torch.searchsorted(grid, lo, right=True) - 1]
                scale = grid[torch.searchsorted(grid, (hi - zero) / top_code)]
                self.zero[group, channel], self.scale[group, channel] = zero, scale
            encoded = list(zip(fresh, fresh_values)) + ([] if survivors and fits else list(zip(survivors, survivor_values)))
            for member, value in encoded:
                self.codes[member, channel] = torch.round((value - zero) / scale).clamp(0, top_code) if scale > 0 else 0.0

    def read(self) -> torch.Tensor:
        groups = torch.arange(len(self.exact)) // self.group
        decoded = self.zero[groups] + self.codes * self.scale[groups]
        for slot in [*self.pushed, *range(self.sinks)]:
            decoded[slot] = self.exact[slot]
        return decoded


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("bits", BITS)
def test_scattered_writes_follow_the_group_rules(bits, static):
    """Appends fill 22 slots, then each row and head writes one token at a time into a slot of its
    own (as a scored policy's decode steps do), some far outside their group's range: the keys read
    back equal the rules' transcription above at every step, eagerly and through the static step
    (two sink slots included: their keys stay native and out of group 0's range)."""
    batch, heads, capacity, width, group, residual, sinks = 2, 2, 22, 5, 4, 6, 2
    generator = torch.Generator().manual_seed(bits)
    stored = QuantizedStorage(bits, group, residual, sinks=sinks)
    naive = [[NaiveChannelGroups(bits, group, residual, capacity, width, sinks) for _ in range(heads)] for _ in range(batch)]
    stored.allocate(torch.zeros(batch, heads, 1, width), capacity)
    for step in range(capacity + 40):
        keys = torch.randn(batch, heads, 1, width, generator=generator)
        keys *= torch.where(torch.rand(batch, heads, 1, 1, generator=generator) < 0.1, 20.0, 1.0)  # outliers widen a grid
        slots = torch.full((batch, heads, 1), step) if step < capacity else torch.randint(0, capacity, (batch, heads, 1), generator=generator)
        if static and step == capacity:
            stored.enter_static()
        (stored.write_static if static and step >= capacity else stored.write)(slots, keys, keys)
        for row in range(batch):
            for head in range(heads):
                naive[row][head].write(int(slots[row, head, 0]), keys[row, head, 0])
        read = stored.read_static()[0] if static and step >= capacity else stored.read(min(step + 1, capacity))[0]
        expected = torch.stack([torch.stack([n.read() for n in row]) for row in naive])[:, :, : read.shape[2]]
        assert torch.equal(read, expected), step
    assert min(n.widened for row in naive for n in row) > 0


# --- padded batches and beams -------------------------------------------------------------------
PADDED = (40, 9, 25)
"""Rows over and under the budget of 16: one batch mixes prompts trimmed and written in place."""


def padded_differences(name: str, options: str, steps: int, dtype: torch.dtype = torch.float32) -> tuple[list[float], list[float]]:
    """Per row: the largest logit difference between the row in a left-padded batch and the row
    alone, and between the row alone and the same policy in native storage."""
    model = tiny_qwen3().to(dtype)
    rows = [random_ids(1, n, seed=i + 1) for i, n in enumerate(PADDED)]
    ids, mask = left_padded(rows)
    batch = generated_logits(model, ids, build(model, name, options, budget=16), steps, attention_mask=mask)
    alone = [generated_logits(model, row, build(model, name, options, budget=16), steps)[0] for row in rows]
    native = [generated_logits(model, row, build(model, name, "native", budget=16), steps)[0] for row in rows]
    return (
        [float((batch[i] - alone[i]).abs().max()) for i in range(len(rows))],
        [float((alone[i] - native[i]).abs().max()) for i in range(len(rows))],
    )


@pytest.mark.parametrize("name", storage_policies())
def test_padded_batch_with_token_keys_equals_each_row_alone(name, one_thread):
    """Per-token keys and values depend on no other slot: each row gets exactly what it gets alone."""
    differences, errors = padded_differences(name, "int4:key_axis=token;residual=4;group_size=4", steps=8)
    assert max(differences) < 1e-5 and min(errors) > 1e-3, (differences, errors)


@pytest.mark.parametrize("options", [f"int{bits}:residual=4;group_size=4" for bits in BITS] + ["int4"])
@pytest.mark.parametrize("name", storage_policies())
def test_padded_batch_with_channel_keys_equals_each_row_alone(name, options, one_thread):
    """Channel groups span slots, and a left-padded row's tokens sit in other slots than alone, beside
    its pads: the storage groups each row's own tokens in the order the row alone writes them,
    pads left out, so each row is held, and read, as it is alone. In float64, where the model's
    own batch noise (~1e-7 in float32) cannot tip a code across a rounding boundary, exactly; the
    differences from native storage show that quantisation is at work (with the default residual
    of 32, on the row over it)."""
    differences, errors = padded_differences(name, options, steps=8, dtype=torch.float64)
    assert max(differences) < 1e-6 and max(errors) > 1e-3, (differences, errors)


SINK_LAYOUTS = [
    "sink:sink_tokens=12,window=20,storage=int{bits}",
    "sink:sink_tokens=12,window=20,positions=absolute,storage=int{bits}",
    "sink:sink_tokens=8,window=8,storage=int{bits}:residual=4;group_size=4",
]
"""A ring (21 slots) no longer than the residual (32) beside a layer (33) that is; a residual (4)
shorter than the sinks (8). The rows of 11 and 5 tokens have fewer real tokens than their sinks."""


@pytest.mark.parametrize("layout", SINK_LAYOUTS)
@pytest.mark.parametrize("bits", BITS)
def test_padded_sinks_are_held_as_each_row_alone_holds_them(layout, bits, one_thread):
    """Each row's residual pushes its own real tokens (not its pads, not the ring's copies of its
    sinks) and decides for itself whether a write only refreshes what it holds, and a displaced
    sink that arrives while decoding goes to its sink slot then, as the row alone writes it: rows
    of 50, 11, 30, 24 and 5 tokens each equal themselves alone, in float64, where quantisation
    is at work (they differ from native storage)."""
    model = tiny_qwen3().to(torch.float64)
    rows = [random_ids(1, n, seed=i + 1) for i, n in enumerate((50, 11, 30, 24, 5))]
    ids, mask = left_padded(rows)
    spec = layout.format(bits=bits)
    batch = generated_logits(model, ids, from_spec(model, spec), 8, attention_mask=mask)
    alone = [generated_logits(model, row, from_spec(model, spec), 8)[0] for row in rows]
    native = generated_logits(model, ids, from_spec(model, spec.split(",storage=")[0]), 8, attention_mask=mask)
    assert max(float((batch[i] - alone[i]).abs().max()) for i in range(len(rows))) < 1e-6
    assert float((batch - native).abs().max()) > 1e-5


@pytest.mark.parametrize("storage_option", ["int4", "fp8", "native"])
def test_sinks_arriving_inside_a_multi_token_forward_are_refused_where_rows_are_held_apart(storage_option):
    """A padded row of 3 tokens beside one of 30 (sinks 8): its last five sinks arrive after the
    prompt. Two tokens in one forward would show them to queries before their arrival in a
    storage that stores them in their sink slots on arrival: refused, naming the fix; native
    storage (sinks copied in once they leave the ring) serves it, as does one token per forward."""
    model = tiny_qwen3()
    ids, mask = left_padded([random_ids(1, 30, seed=1), random_ids(1, 3, seed=2)])
    spec = f"sink:sink_tokens=8,window=8,storage={storage_option}"
    following = random_ids(2, 2, seed=3)
    for step in (2, 1):
        cache = from_spec(model, spec)
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=cache, use_cache=True)
            grown = torch.cat([mask, torch.ones(2, step, dtype=mask.dtype)], dim=1)
            if step == 2 and storage_option != "native":
                with pytest.raises(ValueError, match="multi-token forward brings sinks of a padded row"):
                    model(following, attention_mask=grown, cache=cache, use_cache=True)
            else:
                logits = model(following[:, :step], attention_mask=grown, cache=cache, use_cache=True).logits
                assert torch.isfinite(logits).all()


@pytest.mark.parametrize("bits", BITS)
def test_beam_search_reorders_codes_scales_and_residual(bits):
    model = tiny_llama()
    ids = random_ids(2, 12)
    kwargs = dict(max_new_tokens=12, num_beams=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    for make in (lambda s: FullCache(model, storage=s), lambda s: SlidingWindowCache(model, window=10, storage=s)):
        with torch.no_grad():
            expected = model.generate(ids, cache=make(lambda: NaiveQuantized(bits, 4, 4)), **kwargs)
            got = model.generate(ids, cache=make(storage(bits, "group_size=4;residual=4")), **kwargs)
        assert torch.equal(got.sequences, expected.sequences)
        torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["sink:sink_tokens=12,window=20,storage=int4", "h2o:heavy=8,recent=8,storage=int2:residual=8;group_size=4"])
def test_beam_search_over_a_padded_batch_equals_each_row_alone(spec, one_thread):
    """Beams reorder each row's own residual ring position with its entries: rows of 40, 9 and 25
    tokens, 3 beams each, give the sequences and scores each row's beam search gives alone."""
    model = tiny_qwen3().to(torch.float64)
    rows = [random_ids(1, n, seed=i + 1) for i, n in enumerate((40, 9, 25))]
    ids, mask = left_padded(rows)
    kwargs = dict(max_new_tokens=10, num_beams=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, cache=from_spec(model, spec), **kwargs)
        for i, row in enumerate(rows):
            alone = model.generate(row, cache=from_spec(model, spec), **kwargs)
            assert batch.sequences[i, ids.shape[1] :].tolist() == alone.sequences[0, row.shape[1] :].tolist()
            assert abs(float(batch.sequences_scores[i] - alone.sequences_scores[0])) < 1e-9


# --- bytes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize(("bits", "options"), [(8, ""), (4, ""), (2, ""), (4, "residual=128;sinks=4"), (2, "key_axis=token;group_size=48")])
def test_footprint_and_held_bytes_by_hand(bits, options, tokens):
    """A full cache of ``tokens`` (a prompt: allocated exactly) on a model with head dim 64 and 2 KV
    heads, bf16 keys: every tensor counted from the layout, nothing else held."""
    model = tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    spec = f"int{bits}:{options}" if options else f"int{bits}"
    cache = FullCache(model, storage=spec)
    stored = cache.layers[0].storage
    chunk = torch.randn(1, 2, tokens, 64).to(torch.bfloat16)
    for layer in range(len(cache.layers)):
        cache.update(chunk, chunk, layer)
    group, residual, axis, sinks = stored.group_size, stored.residual, stored.key_axis, stored.sinks
    rows = 1 * 2  # batch x KV heads
    codes = 64 * bits // 8  # bytes a vector
    value_groups = -(-64 // group)
    values = tokens * (codes + value_groups * 2 * 2)  # codes, then a bf16 zero point and scale per group
    if axis == "channel":
        slot_groups = -(-tokens // group)
        keys_allocated = slot_groups * group * codes + slot_groups * 64 * 2 * 2 + 8 + sinks * 64 * 2  # whole groups of slots; `written`; sink keys
        keys_held = tokens * codes + slot_groups * 64 * 2 * 2 + 8 + min(tokens, sinks) * 64 * 2
    else:
        keys_allocated = keys_held = values
    native = min(tokens, residual) * (2 * 64 * 2 + 8)  # bf16 key and value, the slot it shadows
    ring = residual * (2 * 64 * 2 + 8)
    assert stored.nbytes == rows * (keys_allocated + values + ring)
    assert stored.bytes_held(tokens) == rows * (keys_held + values + native)
    positions = tokens * 8
    assert cache.get_memory_footprint() == len(cache.layers) * (stored.nbytes + positions)


def test_int4_and_int2_hold_a_third_and_a_fifth_of_bf16_at_4096_tokens():
    """Everything allocated counted (codes, zero points, scales, residual, slot positions), SmolLM2's
    layout (head dim 64, 3 KV heads), bf16 keys."""
    model = tiny_llama(hidden_size=192, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=1)
    sizes = {}
    for spec in ("native", "int4", "int2"):
        cache = FullCache(model, storage=spec)
        for start in range(0, 4096, 1024):
            chunk = torch.randn(1, 3, 1024, 64).to(torch.bfloat16)
            cache.update(chunk, chunk, 0)
        sizes[spec] = cache.get_memory_footprint()
    assert sizes["int4"] / sizes["native"] <= 0.33 and sizes["int2"] / sizes["native"] <= 0.21, sizes


# --- options and bad input ----------------------------------------------------------------------
def test_options_reach_every_policy_and_the_defaults_are_kivis_but_the_residual():
    model = tiny_llama()
    cache = from_spec(model, "window:window=8,storage=int2:group_size=16;residual=64;key_axis=token")
    stored = cache.layers[0].storage
    assert (stored.bits, stored.group_size, stored.residual, stored.key_axis) == (2, 16, 64, "token")
    default = FullCache(model, storage="int4").layers[0].storage
    assert (default.bits, default.group_size, default.residual, default.key_axis, default.sinks) == (4, 32, 32, "channel", 1)
    assert from_spec(model, "snapkv:budget=64,storage=int8").layers[0].storage.bits == 8
    assert {"int8", "int4", "int2"} <= set(available_storages())
    assert repr(storage_factory("int4:residual=64")) == "QuantizedStorage.factory(bits=4, group_size=32, residual=64, key_axis='channel', sinks=1)"
    assert from_spec(model, "full:storage=int4:key_axis=token").layers[0].storage.sinks == 0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: QuantizedStorage(bits=3), "bits must be one of 2, 4, 8, got 3"),
        (lambda: QuantizedStorage(bits=16), "bits must be one of 2, 4, 8"),
        (lambda: QuantizedStorage(group_size=0), "group_size must be an integer >= 1, got 0"),
        (lambda: QuantizedStorage(residual=-1), "residual must be an integer >= 0, got -1"),
        (lambda: QuantizedStorage(key_axis="head"), "key_axis must be one of 'channel', 'token', got 'head'"),
        (lambda: QuantizedStorage(residual=8, group_size=32), "residual must be >= group_size, got residual=8; .* key_axis='token'"),
        (lambda: storage_factory("int3"), "unknown storage 'int3': choose one of .*int2, int4, int8"),
        (lambda: storage_factory("int4:residual=-3"), "residual must be an integer >= 0, got -3"),
        (lambda: storage_factory("int4:group_size=x"), "group_size must be an integer >= 1, got 'x'"),
        (lambda: storage_factory("int4:key_axis=head"), "key_axis must be one of 'channel', 'token'"),
        (lambda: storage_factory("int4:bits=8"), "options are group_size=<int>, residual=<int>, key_axis=<channel|token> and sinks=<int>"),
        (lambda: QuantizedStorage(sinks=-1), "sinks must be an integer >= 0, got -1"),
        (lambda: storage_factory("int2:key_axis=token;sinks=2"), "sinks=2 .* give sinks=0 with key_axis='token'"),
        (lambda: FullCache(tiny_llama(), storage="int4:residual=600"), "residual=600 exceeds the 512 positions"),
    ],
)
def test_bad_input_is_refused_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()
