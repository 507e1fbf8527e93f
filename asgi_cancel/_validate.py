"""The one check of an option given in seconds, and the one way a bad option's error reads:
`ValueError("<option> must be ..., got <value> (<type>)")`, raised at construction."""

from __future__ import annotations

import math


def describe(value: object) -> str:
    """`value` for an error message: its repr and its type (`'30s' (str)`)."""
    return f"{value!r} ({type(value).__name__})"


def seconds(name: str, value: object, *, positive: bool = False, below: float = math.inf) -> float:
    """`value` as a float number of seconds: finite, >= 0 (> 0 if `positive`), < `below`.

    Raises:
        ValueError: naming `name`, for anything else (bools, strings, NaN, infinity included).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
        or value >= below
    ):
        raise ValueError(f"{name} must be {_wanted(positive, below)}, got {describe(value)}")
    return float(value)


def seconds_or_none(name: str, value: object, *, positive: bool = False) -> float | None:
    """None, or `value` checked as `seconds()` does."""
    if value is None:
        return None
    try:
        return seconds(name, value, positive=positive)
    except ValueError:
        raise ValueError(
            f"{name} must be None or {_wanted(positive, math.inf)}, got {describe(value)}"
        ) from None


def _wanted(positive: bool, below: float) -> str:
    bounds = "> 0" if positive else ">= 0"
    if below != math.inf:
        bounds += f" and < {below:g}"
    return f"a finite number of seconds {bounds}"
