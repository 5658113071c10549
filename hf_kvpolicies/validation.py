"""Argument checks shared by the policies: one clear ``ValueError`` naming the parameter."""

from __future__ import annotations

import numbers


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as a Python ``int``: any integer type (``numpy.int64`` too), never a bool. The
    conversion matters: slot arithmetic tells an ``int`` start slot from a tensor of slots."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def check_tokens_or_fraction(name: str, value: object) -> int | float:
    """A budget: a token count (integer >= 0) or a fraction of the prompt length (float in (0, 1])."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a token count (integer >= 0) or a fraction in (0, 1], got {value!r}")
    value = int(value) if isinstance(value, numbers.Integral) else float(value)
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be a token count >= 0 or a fraction in (0, 1], got {value}")
    if isinstance(value, float) and not 0 < value <= 1:
        raise ValueError(
            f"{name}={value} is a float, i.e. a fraction of the prompt length, and must lie in (0, 1]; "
            "write an integer for a number of tokens"
        )
    return value


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value
