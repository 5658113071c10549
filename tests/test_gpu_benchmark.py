"""The GPU benchmark: one line and exit 0 without CUDA; every code path on a tiny model on the CPU."""

from __future__ import annotations

import pytest
import torch

from eval.benchmarks import gpu
from hf_kvpolicies import available_policies


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(capsys):
    assert gpu.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA device" in out[0]


def test_tiny_run_times_every_contender_at_every_context(capsys):
    assert gpu.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--backend", "eager"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    cells = {(row[0].strip(), int(row[1])): row[2].strip() for row in rows if row[1].strip().isdigit()}
    for context in (48, 96):
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
