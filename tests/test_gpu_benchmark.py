"""The GPU benchmark: one line and exit 0 without CUDA; every code path on a tiny model on the CPU."""

from __future__ import annotations

import inspect

import pytest
import torch

from eval.benchmarks import gpu
from hf_kvpolicies import available_policies


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(capsys):
    assert gpu.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA device" in out[0]


def test_tiny_run_times_every_contender(capsys):
    assert gpu.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--backend", "eager"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    cells = {(row[0].strip(), int(row[1])): row[2].strip() for row in rows if row[1].strip().isdigit()}
    for context in (64,):
        assert float(cells["DynamicCache", context]) > 0
        assert float(cells["StaticCache compiled", context]) > 0  # compiled with fullgraph=True
        for name in available_policies():
            timed = [label for label, at in cells if at == context and label.partition(":")[0] == name]
            assert timed, f"policy {name} missing at context {context}"
            for label in timed:
                if label.endswith(" compiled") and cells[label, context] == "n/a (is_compileable is False)":
                    continue  # a cache that cannot compile is reported as such, never timed eager in its place
                if name == "kvzip" and "tokenizer" in cells[label, context]:
                    continue  # a random-weight model has no tokenizer for KVzip's repeat prompt: refused, said so
                assert float(cells[label, context]) > 0, label


def test_the_operation_count_covers_every_policy_and_storage_and_scales_per_layer():
    """Counts are exact and machine-independent: every layer adds the same operations, so a count is
    linear in the layers (what a cache adds per layer is a property of the cache); the table lists
    DynamicCache and every policy x storage."""
    from tiny_models import random_ids, tiny_llama

    from eval.benchmarks import ops
    from hf_kvpolicies import available_storages
    from hf_kvpolicies.specs import policy_constructor

    ids = random_ids(1, 64)
    counts, kernels = {}, {}
    for layers in (2, 3, 4):
        rows = ops.count(tiny_llama(num_hidden_layers=layers), ids, 40, 16, ["full", "window", "h2o"])
        counts[layers] = {row.label: row.operations for row in rows}
        kernels[layers] = {row.label: row.kernels for row in rows}
    for label in counts[2]:
        assert counts[4][label] - counts[3][label] == counts[3][label] - counts[2][label] > 0, label
        assert kernels[4][label] - kernels[3][label] == kernels[3][label] - kernels[2][label] > 0, label
        assert kernels[2][label] < counts[2][label], label  # a step's views launch nothing
    per_layer = {label: counts[3][label] - counts[2][label] - (counts[3]["DynamicCache"] - counts[2]["DynamicCache"]) for label in counts[2]}
    assert 0 < per_layer["full"] < per_layer["h2o:heavy=8,recent=8"]  # a scored step does more than an append
    storages = lambda name: len(available_storages()) if "storage" in inspect.signature(policy_constructor(name)).parameters else 1  # noqa: E731
    labels = [label for label, _ in ops.contenders(16)]
    assert labels[0] == "DynamicCache" and len(labels) == 1 + sum(storages(name) for name in available_policies())
    labels = [label for label, _ in ops.contenders(16, ["snapkv:chunk=4", "full:storage=fp8"])]  # specs: as given
    assert labels == [
        "DynamicCache", *(f"snapkv:budget=16,window=4,kernel=3,chunk=4,storage={s}" for s in available_storages() if s != "native"),
        "snapkv:budget=16,window=4,kernel=3,chunk=4", "full:storage=fp8",
    ]
    table = ops.table([ops.Count("DynamicCache", 100, 70), ops.Count("full", 114, 80)], layers=2, context=40)
    assert table.splitlines()[-1] == "| full | 114 | 1.14x | +7.0 | 80 | +5.0 |"
