"""Request ids and deadlines: what a request gets when the middleware's options ask for them.

Only requests of a middleware built with `registry=`, `timeout=`, `timeouts=` or
`timeout_header=` come here; the others pay one `is None` check in their driver.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from time import monotonic
from typing import TYPE_CHECKING

from ._cycle import error_response
from ._registry import CancelRegistry
from .types import Scope, Send

if TYPE_CHECKING:
    from ._cycle import Cycle

DEADLINE_EXCEEDED = "deadline exceeded"
DEADLINE_STATUS = 504
MAX_ID_LENGTH = 200
# "30", "1.5", "30s", "500ms", "2m": the budget a client or a gateway passes on.
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*", re.ASCII)
_UNIT = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0}

Timeouts = Mapping[str, float | None] | Callable[[Scope], float | None]


def parse_duration(value: str) -> float | None:
    """Seconds from `"30"`, `"1.5"`, `"30s"`, `"500ms"` or `"2m"`; None if malformed."""
    match = _DURATION.fullmatch(value)
    if match is None:
        return None
    return float(match[1]) * _UNIT[match[2]]


def new_request_id() -> str:
    return os.urandom(12).hex()


def _seconds_or_none(name: str, value: object) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be None or a finite number of seconds > 0, got {value!r}")
    return float(value)


class Tracking:
    """The middleware's id and deadline options, checked once, applied per request."""

    __slots__ = ("id_header", "prefixes", "registry", "route_timeout", "timeout", "timeout_header")

    def __init__(
        self,
        registry: CancelRegistry | None,
        timeout: float | None,
        timeouts: Timeouts | None,
        timeout_header: str | None,
    ) -> None:
        if registry is not None and not isinstance(registry, CancelRegistry):
            raise ValueError(f"registry must be a CancelRegistry or None, got {registry!r}")
        self.registry = registry
        self.id_header = registry.header.encode("latin-1") if registry is not None else None
        self.timeout = _seconds_or_none("timeout", timeout)
        self.route_timeout: Callable[[Scope], float | None] | None = None
        self.prefixes: list[tuple[str, float | None]] = []
        if callable(timeouts):
            self.route_timeout = timeouts
        elif isinstance(timeouts, Mapping):
            for prefix, seconds in timeouts.items():
                if not isinstance(prefix, str):
                    raise ValueError(f"timeouts keys must be path prefixes, got {prefix!r}")
                self.prefixes.append((prefix, _seconds_or_none(f"timeouts[{prefix!r}]", seconds)))
            self.prefixes.sort(key=lambda item: len(item[0]), reverse=True)  # longest wins
        elif timeouts is not None:
            raise ValueError(
                f"timeouts must be a mapping of path prefixes or a callable, got {timeouts!r}"
            )
        if timeout_header is not None and (
            not isinstance(timeout_header, str) or not timeout_header
        ):
            raise ValueError(
                f"timeout_header must be a header name or None, got {timeout_header!r}"
            )
        self.timeout_header = timeout_header.lower().encode("latin-1") if timeout_header else None

    def configured_timeout(self, scope: Scope) -> float | None:
        if self.route_timeout is not None:
            return self.route_timeout(scope)
        path = scope.get("path", "")
        for prefix, seconds in self.prefixes:
            if path.startswith(prefix):
                return seconds
        return self.timeout

    def begin(self, cycle: Cycle) -> Awaitable[None] | None:
        """Give the request its id and deadline; returns the response to send instead of
        running the app (a malformed timeout header: 400; no budget left: 504), else None."""
        scope = cycle.scope
        token = cycle.token
        id_header = self.id_header
        timeout_header = self.timeout_header
        # One dict built in C rather than a Python loop over the headers (the last of a
        # repeated header wins, as in the loop it replaces).
        headers = dict(scope.get("headers", ()))
        raw_id: bytes | None = headers.get(id_header) if id_header is not None else None
        request_id = raw_id.decode("latin-1").strip() if raw_id is not None else None
        budget: bytes | None = headers.get(timeout_header) if timeout_header is not None else None
        if id_header is not None:
            if not request_id or len(request_id) > MAX_ID_LENGTH or not request_id.isprintable():
                request_id = new_request_id()
            token.request_id = request_id
            state = scope.get("state")
            if isinstance(state, dict):  # Starlette's request.state.request_id
                state["request_id"] = request_id
        seconds = self.configured_timeout(scope)
        if budget is not None:
            text = budget.decode("latin-1")
            passed = parse_duration(text)
            if passed is None:
                return refuse(
                    cycle.real_send,
                    400,
                    f"malformed {self.timeout_header.decode()} header {text!r}: expected seconds,"  # type: ignore[union-attr]
                    " e.g. 30, 1.5, 30s, 500ms or 2m",
                )
            seconds = passed if seconds is None else min(seconds, passed)
        if seconds is not None:
            if seconds <= 0:
                return refuse(cycle.real_send, DEADLINE_STATUS, DEADLINE_EXCEEDED)
            token.deadline = monotonic() + seconds
        return None

    def register(
        self, cycle: Cycle, call_soon_threadsafe: Callable[[Callable[[], object]], object]
    ) -> None:
        request_id = cycle.token.request_id
        if self.registry is not None and request_id is not None:
            self.registry.register(request_id, cycle, call_soon_threadsafe)

    def unregister(self, cycle: Cycle) -> None:
        request_id = cycle.token.request_id
        if self.registry is not None and request_id is not None:
            self.registry.unregister(request_id, cycle)


async def refuse(send: Send, status: int, message: str) -> None:
    start, body = error_response(status, message)
    await send(start)
    await send(body)
