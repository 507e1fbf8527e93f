"""Public ASGI type aliases and the callback types of asgi-cancel's options.

Kept free of any framework import (asgiref.typing is the reference). Tests, benchmarks and
users import these: `from asgi_cancel.types import ASGIApp, OnCancelled`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["ASGIApp", "AnyASGIApp", "Message", "OnCancelled", "Receive", "Scope", "Send"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# What the middleware accepts as the app it wraps: loose on purpose, so apps typed with their
# own scope TypedDicts (Quart, hypercorn's types, asgiref.typing) type-check when wrapped.
AnyASGIApp = Callable[[Any, Any, Any], Awaitable[Any]]
# `on_cancelled(scope, *, reason: str, elapsed: float, response_started: bool)`, called once per
# cancelled request. Loose (`...`) so that any callable taking those keywords fits.
OnCancelled = Callable[..., object]
