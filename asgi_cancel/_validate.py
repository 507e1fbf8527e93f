"""The checks of what users and clients hand the middleware: an option given in seconds, a
header name, a request id. A bad option's error reads one way:
`ValueError("<option> must be ..., got <value> (<type>)")`, raised at construction."""

from __future__ import annotations

import math
import re

# RFC 9110's token: what a header name may be made of.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", re.ASCII)
# A request id: 1 to 200 characters that are safe in a URL path, a header and a log line.
MAX_ID_LENGTH = 200
ID_CHARACTERS = "A-Z a-z 0-9 . _ ~ : + = @ -"
_ID = re.compile(rf"[A-Za-z0-9._~:+=@-]{{1,{MAX_ID_LENGTH}}}", re.ASCII)


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


def header_name(option: str, value: object) -> bytes:
    """`value` as a lowercase header name for the middleware's `option`; ValueError naming the
    option if it is not one (RFC 9110: letters, digits and ``!#$%&'*+-.^_`|~``)."""
    if not isinstance(value, str) or len(value) > 100 or _TOKEN.fullmatch(value) is None:
        wanted = "a header name such as 'x-request-id'"
        raise ValueError(f"{option} must be {wanted}, got {describe(value)}")
    return value.lower().encode("ascii")


def valid_request_id(value: str) -> bool:
    """Whether `value` (from a client) is an acceptable request id: 1 to `MAX_ID_LENGTH` of
    `ID_CHARACTERS`."""
    return len(value) <= MAX_ID_LENGTH and _ID.fullmatch(value) is not None
