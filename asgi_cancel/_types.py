"""ASGI type aliases, kept free of any framework import (asgiref.typing is the reference)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# What the middleware accepts as the app it wraps: loose on purpose, so apps typed with their
# own scope TypedDicts (Quart, hypercorn's types, asgiref.typing) type-check when wrapped.
AnyASGIApp = Callable[[Any, Any, Any], Awaitable[Any]]
