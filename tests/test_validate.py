"""Every option given in seconds, on every constructor, goes through one check with one
message: `<option> must be a finite number of seconds ..., got <value> (<type>)`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, CancelToken
from asgi_cancel.testing import ASGITransport, ClientConnection
from asgi_cancel.transformers import generate_in_thread
from asgi_cancel.types import Receive, Scope, Send


async def hello_app(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("not called")


BAD = [-1, -0.1, float("nan"), float("inf"), "1", "30s", True, None]


middleware = partial(CancelOnDisconnectMiddleware, hello_app)
transport = partial(ASGITransport, hello_app)


def in_a_thread(**options: Any) -> object:
    return generate_in_thread(lambda: 0, token=CancelToken(), **options)


def redis_broker(**options: Any) -> object:
    from asgi_cancel.redis import RedisBroker

    return RedisBroker("redis://127.0.0.1:1/0", **options)


# (what makes one, the option, the bounds its message names, a value it takes, ones it refuses)
OPTIONS: list[tuple[Callable[..., object], str, str, float, list[Any]]] = [
    (middleware, "grace", ">= 0", 0, BAD),
    (middleware, "watch_delay", ">= 0", 0, BAD),
    (middleware, "timeout", "None or", 1, [0, *BAD[:-1]]),
    (middleware, "session_timeout", "None or", 1, [0, *BAD[:-1]]),
    (transport, "exit_timeout", "> 0", 1, [0, *BAD]),
    (in_a_thread, "join_timeout", ">= 0", 0, BAD),  # NaN was taken, and broke Thread.join
    (CancelRegistry, "remember", ">= 0", 0, BAD),
    (ClientConnection, "body_delay", ">= 0", 0, BAD),
    (redis_broker, "wait", "> 0 and < 60", 1, [0, 60, *BAD]),
    (redis_broker, "connect_timeout", "> 0 and < 60", 1, [0, 60, *BAD]),
    (redis_broker, "health_timeout", "> 0 and < 60", 1, [0, 60, *BAD]),
]


@pytest.mark.parametrize(
    ("make", "option", "bounds", "value"),
    [(make, option, bounds, bad) for make, option, bounds, _, bads in OPTIONS for bad in bads],
    ids=lambda value: repr(value) if not callable(value) else "",
)
def test_a_bad_number_of_seconds_is_a_value_error_naming_the_option(
    make: Callable[..., object], option: str, bounds: str, value: Any
) -> None:
    with pytest.raises(ValueError, match=rf"^{option} must be ") as error:
        make(**{option: value})
    message = str(error.value)
    assert "a finite number of seconds" in message, message
    assert bounds in message, message
    assert message.endswith(f", got {value!r} ({type(value).__name__})"), message


@pytest.mark.parametrize(
    ("make", "option", "good"),
    [(make, option, good) for make, option, _, good, _ in OPTIONS],
    ids=[option for _, option, *_ in OPTIONS],
)
def test_a_good_number_of_seconds_is_taken(
    make: Callable[..., object], option: str, good: float
) -> None:
    make(**{option: good})  # the control: the same constructor takes a valid value
