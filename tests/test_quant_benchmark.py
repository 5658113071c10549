"""The integer storage benchmark's target lines: each figure checked against its bound."""

from __future__ import annotations

import pytest

from eval.benchmarks import quant
from eval.benchmarks.quant import found, targets
from eval.benchmarks.runner import Contender


def contender(label: str, ppl: float, ms_1k: float, ms_4k: float) -> Contender:
    return Contender(label, None, {"ppl (2000 tok)": ppl, "ms/token @1024": ms_1k, "ms/token @4096": ms_4k})


def test_each_target_is_met_or_missed_on_its_own_figures():
    results = {c.label: c for c in [
        contender("full", 20.0, 50.0, 70.0),
        contender("int8", 20.01, 55.0, 90.0),
        contender("int4", 20.3, 60.0, 100.0),
        contender("quanto int4", 20.2, 65.0, 110.0),
        contender("int2", 26.0, 62.0, 110.0),
        contender("quanto int2", 200.0, 61.0, 120.0),
    ]}
    needles = [
        "| policy | exact @1024 | exact @2048 | digits right | MiB held @2048 |",
        "|---|---|---|---|---|",
        "| window 256 | 5/20 | 2/20 | 19% | 11.25 |",
        "| window 256 int4 | 5/20 | 1/20 | 18% | 3.75 |",
        "| snapkv 256 | 20/20 | 17/20 | 96% | 11.25 |",
        "| snapkv 256 int4 | 19/20 | 16/20 | 95% | 3.75 |",
    ]
    lines = targets(results, [1024, 4096], 2000, {"int4": 0.329, "int2": 0.22}, needles)
    assert lines == [
        "perplexity: int8 / full 1.0005 (met, target <= 1.001)",
        "perplexity: int4 / full 1.0150 (MISSED, target <= 1.01)",
        "perplexity: int2 / full 1.3000 (MISSED, target <= 1.25)",
        "perplexity: int4 20.300, quanto int4 20.200 (MISSED, target no worse than quanto)",
        "memory at 4096 tokens, all allocated: int4 / bf16 full 0.329 (met, target <= 0.33)",
        "memory at 4096 tokens, all allocated: int2 / bf16 full 0.220 (MISSED, target <= 0.21)",
        "decode @4096: int8 / full 1.29x (met, target <= 1.5)",
        "decode @4096: int4 / full 1.43x (met, target <= 1.5)",
        "decode @4096: int2 / full 1.57x (MISSED, target <= 1.5)",
        "decode @1024: int4 / quanto int4 0.92x (met, target < 1)",
        "decode @4096: int4 / quanto int4 0.91x (met, target < 1)",
        "decode @1024: int2 / quanto int2 1.02x (MISSED, target < 1)",
        "decode @4096: int2 / quanto int2 0.92x (met, target < 1)",
        "needles: window 256 int4 finds 6, native 7 (met, target within 1)",
        "needles: snapkv 256 int4 finds 35, native 37 (MISSED, target within 1)",
    ]
    assert found(needles[3]) == 6


def test_without_quanto_it_stops_before_measuring_and_names_the_install(monkeypatch, capsys):
    monkeypatch.setattr(quant, "is_optimum_quanto_available", lambda: False)
    monkeypatch.setattr(quant, "run", lambda *args, **kwargs: pytest.fail("measured without quanto"))
    with pytest.raises(SystemExit) as stopped:
        quant.main(["--contexts", "64"])
    assert stopped.value.code == 2
    assert "pip install 'hf-kvpolicies[bench]'" in capsys.readouterr().err
