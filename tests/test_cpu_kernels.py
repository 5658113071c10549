"""The CPU kernels of integer storage reads against the PyTorch operations they stand in for: the
same bits for every bit width, group size, key axis, write pattern and batch shape; the PyTorch
operations wherever the kernels cannot serve; and a failed build that says so and reads as before."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import generated_logits, left_padded
from tiny_models import random_ids, tiny_llama

from eval.benchmarks.runner import Contender, run
from hf_kvpolicies import FullCache, QuantizedStorage, from_spec
from hf_kvpolicies.storage import cpu_kernels
from hf_kvpolicies.storage.cpu_kernels import portable

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler on this machine: the kernels are not built")


def both_reads(storage: QuantizedStorage, read) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``read(storage)`` through the kernels, then through the PyTorch operations."""
    fused = tuple(t.clone() for t in read(storage))
    with portable():
        reference = read(storage)
    return fused, reference


def assert_same_bits(fused, reference) -> None:
    for mine, theirs in zip(fused, reference, strict=True):
        assert mine.shape == theirs.shape
        assert torch.equal(mine, theirs)


def streamed(
    bits: int, options: dict, batch: int, heads: int, width: int, tokens: int, dtype: torch.dtype = torch.float32
) -> QuantizedStorage:
    """A storage after a prefill of half of ``tokens`` and the rest appended one by one."""
    generator = torch.Generator().manual_seed(0)
    keys = (torch.randn(batch, heads, tokens, width, generator=generator) * torch.linspace(0.1, 8, width)).to(dtype)
    values = torch.randn(batch, heads, tokens, width, generator=generator).to(dtype)
    storage = QuantizedStorage(bits, **options)
    storage.allocate(keys[:, :, :1], tokens + 8)
    half = tokens // 2
    storage.write(0, keys[:, :, :half], values[:, :, :half])
    for slot in range(half, tokens):
        storage.write(slot, keys[:, :, slot : slot + 1], values[:, :, slot : slot + 1])
    return storage


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize(
    "options",
    (
        {},
        {"group_size": 5, "residual": 7},  # groups that divide neither the slots nor the width
        {"group_size": 8, "residual": 8, "sinks": 3},
        {"key_axis": "token", "group_size": 7, "residual": 0},
        {"key_axis": "token", "group_size": 64, "residual": 16},
    ),
    ids=("kivi", "odd-groups", "sinks", "token-keys", "token-keys-wide-group"),
)
@pytest.mark.parametrize("shape", ((1, 3, 64), (2, 2, 40), (3, 1, 18)), ids=("1x3x64", "2x2x40", "3x1x18"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_reads_equal_the_pytorch_operations_bit_for_bit(bits, options, shape, dtype):
    batch, heads, width = shape
    storage = streamed(bits, options, batch, heads, width, tokens=75, dtype=dtype)
    for length in (75, 60, 1):
        assert_same_bits(*both_reads(storage, lambda s: s.read(length)))
    storage.enter_static()
    assert_same_bits(*both_reads(storage, lambda s: s.read_static()))


@pytest.mark.parametrize("bits", (4, 2))
def test_scattered_writes_and_reordered_rows_read_the_same_bits(bits):
    """Per-row slots (a scored policy's eviction: the residual shadows slots anywhere) and a beam
    reorder (rows made anew by index_select)."""
    storage = streamed(bits, {"group_size": 8, "residual": 8}, 2, 3, 32, tokens=48)
    generator = torch.Generator().manual_seed(1)
    for _ in range(12):
        slots = torch.randint(0, 48, (2, 3, 1), generator=generator)
        storage.write(slots, torch.randn(2, 3, 1, 32, generator=generator), torch.randn(2, 3, 1, 32, generator=generator))
    assert_same_bits(*both_reads(storage, lambda s: s.read(48)))
    storage.reorder(torch.tensor([1, 1]))
    assert_same_bits(*both_reads(storage, lambda s: s.read(48)))


@pytest.mark.parametrize("spec", ("full:storage=int4", "window:window=24,storage=int2", "snapkv:budget=24,window=8,storage=int4"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_generated_logits_equal_the_pytorch_operations(spec, dtype, one_thread):
    """Whole decodes of a left-padded batch, eager and static steps: the kernels change no logit."""
    model = tiny_llama().to(dtype)
    ids, mask = left_padded([random_ids(1, 30), random_ids(1, 22)])
    options = ":group_size=8;residual=8"
    fused = generated_logits(model, ids, from_spec(model, spec + options), new_tokens=12, attention_mask=mask)
    with portable():
        reference = generated_logits(model, ids, from_spec(model, spec + options), new_tokens=12, attention_mask=mask)
    assert torch.equal(fused, reference)


def test_the_pytorch_operations_serve_where_the_kernels_cannot():
    storage = streamed(4, {}, 1, 2, 16, tokens=40)
    keys = storage.keys
    fp16 = streamed(4, {}, 1, 2, 16, tokens=40, dtype=torch.float16).keys
    assert cpu_kernels.decode_groups(fp16.codes, fp16.zero, fp16.scale, 40, 16, 32, -2, 4, torch.float16) is None
    strided = keys.codes[:, :, :, :4]
    assert cpu_kernels.decode_groups(strided, keys.zero, keys.scale, 40, 8, 32, -2, 4, torch.float32) is None
    assert cpu_kernels.decode_groups(keys.codes, keys.zero, keys.scale, 40, 16, 32, -2, 4, torch.float32) is not None
    with portable():
        assert cpu_kernels.decode_groups(keys.codes, keys.zero, keys.scale, 40, 16, 32, -2, 4, torch.float32) is None


def test_a_residual_that_carries_gradients_reads_through_autograd():
    storage = QuantizedStorage(4, group_size=8, residual=8)
    keys = torch.randn(1, 2, 20, 16, requires_grad=True)
    values = torch.randn(1, 2, 20, 16, requires_grad=True)
    storage.allocate(keys[:, :, :1].detach(), 24)
    storage.write(0, keys, values)
    read_keys, read_values = storage.read(20)
    (read_keys.sum() + read_values.sum()).backward()
    assert torch.equal(keys.grad[:, :, 12:], torch.ones(1, 2, 8, 16))  # the residual's 8 native tokens
    assert torch.equal(values.grad[:, :, 12:], torch.ones(1, 2, 8, 16))


def test_a_failed_build_is_logged_and_reads_as_before(monkeypatch, tmp_path, caplog):
    model = tiny_llama()
    ids = random_ids(1, 24)
    expected = generated_logits(model, ids, FullCache(model, storage="int4:group_size=8;residual=8"), new_tokens=4)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HF_KVPOLICIES_CACHE", str(tmp_path))
    cpu_kernels.library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
            assert cpu_kernels.library() is None
        assert "did not build" in caplog.text and "no-such-compiler" in caplog.text
        logits = generated_logits(model, ids, FullCache(model, storage="int4:group_size=8;residual=8"), new_tokens=4)
        assert torch.equal(logits, expected)
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()


def test_the_kernels_are_built_once_into_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_KVPOLICIES_CACHE", str(tmp_path))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is not None
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].name.startswith("cpu_kernels-") and built[0].suffix == ".so"
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.library() is not None
        assert list(tmp_path.iterdir()) == built  # found, not built again
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()


def test_the_environment_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("HF_KVPOLICIES_CPU_KERNELS", "0")
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()


def test_benchmarks_say_which_path_integer_reads_took(monkeypatch, capsys):
    contenders = [Contender("full", FullCache)]
    run(contenders, ppl_tokens=0, contexts=[], progress=False)
    assert "integer storage reads through its CPU kernels;" in capsys.readouterr().out
    monkeypatch.setenv("HF_KVPOLICIES_CPU_KERNELS", "0")
    cpu_kernels.library.cache_clear()
    try:
        run(contenders, ppl_tokens=0, contexts=[], progress=False)
        assert "integer storage reads through PyTorch operations;" in capsys.readouterr().out
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()


@pytest.mark.parametrize("bits", (4, 2))
def test_keys_and_values_of_different_widths_read_the_same_bits(bits):
    """Multi-head latent attention's layout: keys wider than values (each decoded by its own width)."""
    generator = torch.Generator().manual_seed(2)
    keys, values = torch.randn(2, 2, 50, 48, generator=generator), torch.randn(2, 2, 50, 32, generator=generator)
    storage = QuantizedStorage(bits, group_size=8, residual=8)
    storage.allocate(keys[:, :, :1], 56, value_dim=32)
    storage.write(0, keys[:, :, :30], values[:, :, :30])
    for slot in range(30, 50):
        storage.write(slot, keys[:, :, slot : slot + 1], values[:, :, slot : slot + 1])
    assert_same_bits(*both_reads(storage, lambda s: s.read(50)))


def test_the_kernels_say_which_models_they_serve():
    cpu = torch.device("cpu")
    assert cpu_kernels.serves(cpu, torch.float32) and cpu_kernels.serves(cpu, torch.bfloat16)
    assert not cpu_kernels.serves(cpu, torch.float16)
    assert not cpu_kernels.serves(torch.device("meta"), torch.float32)
    with portable():
        assert not cpu_kernels.serves(cpu, torch.float32)
