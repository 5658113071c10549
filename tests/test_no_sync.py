"""No decode step of any registered policy x storage reads a value back from the device.

Each case prefills past the policy's budget (so decode steps evict), then runs decode steps
under :class:`host_sync.HostSyncGuard`; any read of a device-side value from hf-kvpolicies code
fails the test with where it happened. New policies are covered as soon as they are registered:
they are built with ``budget_parameters`` (every bounded policy implements it).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from host_sync import guarded, mark
from tiny_models import char_tokenizer, random_ids, tiny_gemma3, tiny_llama

from hf_kvpolicies import FullCache, available_policies
from hf_kvpolicies.specs import policy_constructor

BUDGET = 8
PROMPT = 14
DECODE_STEPS = 4
STORAGES = ("native", "fp8", "int4:group_size=4;residual=4")
"""The integer storage with a residual small enough that decode steps quantise key groups."""


def cases():
    for name in available_policies():
        takes_storage = "storage" in inspect.signature(policy_constructor(name)).parameters
        for storage in STORAGES if takes_storage else (None,):
            yield pytest.param(name, storage, id=f"{name}-{storage or 'own'}")


def build(model, name: str, storage: str | None):
    constructor = policy_constructor(name)
    kwargs = dict(constructor.budget_parameters(BUDGET) or {})
    if "tokenizer" in inspect.signature(constructor).parameters:
        kwargs["tokenizer"] = char_tokenizer()  # KVzip writes its repeat prompt with it
    if storage is not None:
        kwargs["storage"] = storage
    return constructor(model, **kwargs)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize(("name", "storage"), list(cases()))
@torch.no_grad()
def test_decode_steps_read_nothing_back_from_the_device(name, storage, make_model, padded, monkeypatch, one_thread):
    model = make_model()
    try:
        cache = build(model, name, storage)
    except ValueError as error:  # a policy that cannot serve a model refuses it at construction, naming why
        assert make_model is tiny_gemma3 and "sliding" in str(error)
        return
    assert_decode_reads_nothing(model, cache, padded, monkeypatch)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("storage", STORAGES)
@torch.no_grad()
def test_a_full_cache_in_blocks_grows_without_reading_back(storage, padded, monkeypatch, one_thread):
    """The prompt fills 14 of 16 slots: the third decode step grows the buffer by a block, from host counts."""
    model = tiny_llama()
    cache = FullCache(model, block=4, storage=storage)
    assert_decode_reads_nothing(model, cache, padded, monkeypatch)
    assert cache.layers[0].storage.capacity == 20


def assert_decode_reads_nothing(model, cache, padded: bool, monkeypatch) -> None:
    """A prefill of a batch of two (its second row left-padded where ``padded``), then decode steps
    that must read nothing back from the device."""
    ids = mark(random_ids(2, PROMPT + DECODE_STEPS))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    mask = mark(mask)
    with guarded(model, monkeypatch) as guard:
        try:
            model(ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], cache=cache)
        except NotImplementedError as error:
            assert padded and "padded" in str(error)  # a policy that refuses padded batches says so at prefill
            return
        guard.strict = True
        for t in range(PROMPT, PROMPT + DECODE_STEPS):
            model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache)
    assert cache.get_seq_length() == PROMPT + DECODE_STEPS
    assert not guard.reads, "decode steps read device values back to the host:\n" + "\n".join(sorted(set(guard.reads)))
