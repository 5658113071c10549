"""One-line policy specs ``NAME[:key=value,...]`` and the registry they are looked up in.

``from_spec(model, "sink:sink_tokens=4,window=1020,storage=fp8")`` calls
``SinkCache(model, sink_tokens=4, window=1020, storage="fp8")``: the keys are the
constructor's keyword arguments and each value is converted to the type it declares.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel
from transformers.cache_utils import Cache

PolicyConstructor = Callable[..., Cache]

_REGISTRY: dict[str, PolicyConstructor] = {}


def register_policy(name: str, constructor: PolicyConstructor, *, overwrite: bool = False) -> None:
    """Make ``constructor(model, **kwargs)`` available to specs as ``name``."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"policy name {name!r} must be letters, digits, '-' or '_'")
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not constructor:
        raise ValueError(f"policy {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = constructor


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def policy_constructor(name: str) -> PolicyConstructor:
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(available_policies())}")
    return _REGISTRY[name]


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``NAME[:key=value,...]`` and convert each value to the type the constructor declares."""
    name, _, arguments = spec.strip().partition(":")
    constructor = policy_constructor(name.strip())
    parameters = _keyword_parameters(constructor)
    kwargs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in arguments.split(","))):
        key, equals, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not equals or not key or not raw:
            raise ValueError(f"malformed item {item!r} in policy spec {spec!r}: write key=value")
        if key not in parameters:
            raise ValueError(
                f"policy {name!r} has no parameter {key!r}: valid keys are {', '.join(parameters) or '(none)'}"
            )
        if key in kwargs:
            raise ValueError(f"parameter {key!r} is given twice in policy spec {spec!r}")
        kwargs[key] = _convert(name, key, raw, parameters[key])
    return name.strip(), kwargs


def from_spec(model: PreTrainedModel, spec: str) -> Cache:
    """Build the cache that ``spec`` names for ``model``."""
    name, kwargs = parse_spec(spec)
    return policy_constructor(name)(model, **kwargs)


def _keyword_parameters(constructor: PolicyConstructor) -> dict[str, Any]:
    """Parameters after the model, with their resolved annotations; an unannotated parameter takes
    its default's type (a string where it has no default, or ``None``)."""
    target = constructor.__init__ if inspect.isclass(constructor) else constructor
    hints = typing.get_type_hints(target)
    parameters = list(inspect.signature(target).parameters.values())
    parameters = parameters[2:] if inspect.isclass(constructor) else parameters[1:]
    return {
        p.name: hints.get(p.name, _default_type(p))
        for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _default_type(parameter: inspect.Parameter) -> type:
    default = parameter.default
    return str if default is parameter.empty or default is None else type(default)


def _convert(policy: str, key: str, raw: str, annotation: Any) -> Any:
    choices = _alternatives(annotation)
    for choice in choices:
        value = _try_convert(raw, choice)
        if value is not _FAILED:
            return value
    expected = " or ".join(_describe(choice) for choice in choices)
    raise ValueError(f"policy {policy!r}: {key}={raw!r} is not {expected}")


def _alternatives(annotation: Any) -> list[Any]:
    """The types a value may take, most specific first (int before float, bool before int)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(annotation) if m is not type(None)]
    else:
        members = [annotation]
    order = {bool: 0, int: 1, float: 2}
    return sorted(members, key=lambda m: order.get(m, 3 if typing.get_origin(m) is typing.Literal else 4))


_FAILED = object()
_TRUE, _FALSE = {"true", "yes", "1", "on"}, {"false", "no", "0", "off"}


def _try_convert(raw: str, target: Any) -> Any:
    if typing.get_origin(target) is typing.Literal:
        options = {str(option): option for option in typing.get_args(target)}
        return options.get(raw, _FAILED)
    if target is bool:
        lowered = raw.lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else _FAILED
    if target in (int, float):
        try:
            return target(raw)
        except ValueError:
            return _FAILED
    if target is str:
        return raw
    return _FAILED  # callables and other objects cannot be written in a spec


def _describe(target: Any) -> str:
    if typing.get_origin(target) is typing.Literal:
        return "one of " + ", ".join(repr(option) for option in typing.get_args(target))
    names = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}
    return names.get(target, f"a {getattr(target, '__name__', target)} (not expressible in a spec)")
