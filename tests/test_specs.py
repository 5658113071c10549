"""Spec grammar, type conversion, the registry and every error path."""

from __future__ import annotations

from typing import Literal

import pytest
from tiny_models import tiny_llama

import hf_kvpolicies
from hf_kvpolicies import FullCache, SlidingWindowCache, available_policies, from_spec, parse_spec, register_policy
from hf_kvpolicies.specs import _REGISTRY


@pytest.fixture
def registry():
    """Restore the registry after a test that registers its own policies."""
    saved = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(saved)


def test_builtins_are_registered():
    assert {"full", "window"} <= set(available_policies())


def test_from_spec_builds_the_named_policy():
    model = tiny_llama()
    assert type(from_spec(model, "full")) is FullCache
    window = from_spec(model, " window : window = 16 ")
    assert type(window) is SlidingWindowCache and window.window == 16


def test_values_are_converted_to_declared_types(registry):
    def custom(model, budget: int = 1, ratio: float | int = 0.5, flag: bool = False,
               mode: Literal["a", "b"] = "a", label: str = ""):
        return (budget, ratio, flag, mode, label)

    register_policy("custom", custom)
    assert from_spec(None, "custom:budget=7,ratio=0.25,flag=true,mode=b,label=x") == (7, 0.25, True, "b", "x")
    assert from_spec(None, "custom:ratio=3") == (1, 3, False, "a", "")
    assert isinstance(parse_spec("custom:ratio=3")[1]["ratio"], int)


def test_unannotated_parameters_take_their_defaults_type(registry):
    def plain(model, budget=3, ratio=0.5, flag=False, label=None):
        return (budget, ratio, flag, label)

    register_policy("plain", plain)
    assert from_spec(None, "plain:budget=7,ratio=0.25,flag=yes,label=x") == (7, 0.25, True, "x")
    with pytest.raises(ValueError, match="budget='seven' is not an integer"):
        from_spec(None, "plain:budget=seven")


def test_registered_policy_is_listed(registry):
    register_policy("mine", FullCache)
    assert "mine" in available_policies()
    with pytest.raises(ValueError, match="already registered"):
        register_policy("mine", SlidingWindowCache)
    register_policy("mine", SlidingWindowCache, overwrite=True)
    with pytest.raises(ValueError, match="letters, digits"):
        register_policy("bad name", FullCache)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", r"unknown policy 'nope': choose one of .*full.*window"),
        ("window:size=3", r"no parameter 'size': valid keys are window, storage"),
        ("window:window=abc", r"window='abc' is not an integer"),
        ("window:window=1.5", r"window='1.5' is not an integer"),
        ("window:window", r"malformed item 'window'.*key=value"),
        ("window:window=3,window=4", r"given twice"),
        ("window:window=0", r"window must be an integer >= 1, got 0"),
        ("full:storage=zip", r"unknown storage 'zip': choose one of .*native"),
    ],
)
def test_errors_name_the_problem_and_the_choices(spec, message):
    with pytest.raises(ValueError, match=message):
        from_spec(tiny_llama(), spec)


def test_public_names():
    for name in ("FullCache", "SlidingWindowCache", "from_spec", "register_policy", "available_policies"):
        assert hasattr(hf_kvpolicies, name)


def test_budget_parameters_spend_the_budget_and_full_policies_take_none():
    from hf_kvpolicies import FP8Cache, FullCache, H2OCache, SinkCache, SlidingWindowCache

    assert FullCache.budget_parameters(256) is None and FP8Cache.budget_parameters(256) is None
    assert SlidingWindowCache.budget_parameters(256) == {"window": 256}
    assert SinkCache.budget_parameters(256) == {"sink_tokens": 4, "window": 252}
    assert SinkCache.budget_parameters(3) == {"sink_tokens": 1, "window": 2}
    assert H2OCache.budget_parameters(257) == {"heavy": 128, "recent": 129}
