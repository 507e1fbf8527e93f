"""Request ids and deadlines: what a request gets when the middleware's options ask for them.

Only requests of a middleware built with `registry=`, `timeout=`, `timeouts=` or
`timeout_header=` come here; the others pay one `is None` check in their driver. Every header
read here comes from the client: each is length-capped and parsed in linear time, and a value
that is not well-formed is answered 400 before the app runs (docs/security.md).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from time import monotonic
from typing import TYPE_CHECKING, Protocol

from ._registry import CANCELLED, CANCELLED_STATUS, CancelRegistry
from ._report import escaped
from ._responses import refuse
from ._validate import ID_CHARACTERS, MAX_ID_LENGTH, header_name, seconds_or_none, valid_request_id
from .types import Message, Receive, Scope, Send

if TYPE_CHECKING:
    from ._backend import Served
    from ._scope import CancelScope


class Tracked(Protocol):
    """What `Tracking.begin()` reads and sets on a request: an HTTP cycle or a websocket
    session."""

    scope: Scope
    real_receive: Receive
    real_send: Send

    @property
    def cancel_scope(self) -> CancelScope: ...


logger = logging.getLogger("asgi_cancel")

DEADLINE_EXCEEDED = "deadline exceeded"
DEADLINE_STATUS = 504
# A budget: "30", "1.5", "30s", "500ms" or "2m", at most 32 characters; larger values are
# capped at a day (a budget can only shorten the configured deadline, never lengthen it).
MAX_BUDGET_LENGTH = 32
MAX_BUDGET = 86400.0
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)[ \t]*(ms|s|m)?", re.ASCII)
_UNIT = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0}

Timeouts = Mapping[str, float | None] | Callable[[Scope], float | None]


def parse_duration(value: str) -> float | None:
    """Seconds from `"30"`, `"1.5"`, `"30s"`, `"500ms"` or `"2m"` (spaces and tabs around
    allowed), capped at `MAX_BUDGET`; None if malformed or longer than `MAX_BUDGET_LENGTH`.

    Linear in the input: the length is checked first, and no two parts of the pattern can
    match the same character.
    """
    if len(value) > MAX_BUDGET_LENGTH:
        return None
    match = _DURATION.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    return min(float(match[1]) * _UNIT[match[2]], MAX_BUDGET)


def new_request_id() -> str:
    # Unguessable: whoever can reach the cancel endpoint must not guess another client's id.
    return os.urandom(12).hex()


def route_path(scope: Scope) -> str:
    """The path the app routes on: `scope["path"]` without `scope["root_path"]` (what
    Starlette's router matches; uvicorn's `--root-path` puts the root in both)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("/", ""):
        return path[len(root) :] or "/"
    return path


class Tracking:
    """The middleware's id and deadline options, checked once, applied per request."""

    __slots__ = (
        "id_header",
        "prefixes",
        "registry",
        "route_timeout",
        "session_timeout",
        "timeout",
        "timeout_header",
    )

    def __init__(
        self,
        registry: CancelRegistry | None,
        timeout: float | None,
        timeouts: Timeouts | None,
        timeout_header: str | None,
        session_timeout: float | None = None,
    ) -> None:
        if registry is not None and not isinstance(registry, CancelRegistry):
            raise ValueError(f"registry must be a CancelRegistry or None, got {registry!r}")
        self.registry = registry
        self.id_header = registry.header.encode("ascii") if registry is not None else None
        self.timeout = seconds_or_none("timeout", timeout, positive=True)
        self.session_timeout = seconds_or_none("session_timeout", session_timeout, positive=True)
        self.route_timeout: Callable[[Scope], float | None] | None = None
        self.prefixes: list[tuple[str, float | None]] = []
        if callable(timeouts):
            self.route_timeout = timeouts
        elif isinstance(timeouts, Mapping):
            for prefix, seconds in timeouts.items():
                if not isinstance(prefix, str) or not prefix.startswith("/"):
                    raise ValueError(
                        f"timeouts keys must be path prefixes starting with '/', got {prefix!r}"
                    )
                limit = seconds_or_none(f"timeouts[{prefix!r}]", seconds, positive=True)
                self.prefixes.append((prefix, limit))
            self.prefixes.sort(key=lambda item: len(item[0]), reverse=True)  # longest wins
        elif timeouts is not None:
            raise ValueError(
                f"timeouts must be a mapping of path prefixes or a callable, got {timeouts!r}"
            )
        self.timeout_header = (
            None if timeout_header is None else header_name("timeout_header", timeout_header)
        )

    def configured_timeout(self, scope: Scope) -> float | None:
        if scope["type"] == "websocket":  # a session's own deadline, not a request's
            return self.session_timeout
        if self.route_timeout is not None:
            return self.route_timeout(scope)
        if self.prefixes:
            path = route_path(scope)
            for prefix, seconds in self.prefixes:
                if path.startswith(prefix):
                    return seconds
        return self.timeout

    def begin(self, cycle: Tracked) -> Awaitable[None] | None:
        """Give the request its id and deadline; returns the response to send instead of
        running the app (a malformed id or timeout header: 400; no budget left: 504), else
        None."""
        scope = cycle.scope
        cancel_scope = cycle.cancel_scope
        # One dict built in C rather than a Python loop over the headers (the last of a
        # repeated header wins, as in the loop it replaces).
        headers = dict(scope.get("headers", ()))
        if self.id_header is not None:
            raw_id: bytes | None = headers.get(self.id_header)
            request_id = "" if raw_id is None else raw_id.decode("latin-1").strip(" \t")
            if not request_id:  # none sent (or an empty header): ours
                request_id = new_request_id()
            elif not valid_request_id(request_id):
                expected = f"1 to {MAX_ID_LENGTH} of {ID_CHARACTERS}"
                return self._refuse(cycle, self.id_header, request_id, expected)
            cycle.real_send = SendWithId(cycle.real_send, self.id_header, request_id)
            if self.registry is not None and self.registry.cancelled_before_it_came(request_id):
                return refuse(
                    scope, cycle.real_receive, cycle.real_send, CANCELLED_STATUS, CANCELLED
                )
            cancel_scope.request_id = request_id
            state = scope.get("state")
            if isinstance(state, dict):  # Starlette's request.state.request_id
                state["request_id"] = request_id
        seconds = self.configured_timeout(scope)
        if self.timeout_header is not None:
            budget: bytes | None = headers.get(self.timeout_header)
            if budget is not None:
                text = budget.decode("latin-1")
                passed = parse_duration(text)
                if passed is None:
                    return self._refuse(
                        cycle, self.timeout_header, text, "seconds, e.g. 30, 1.5, 30s, 500ms or 2m"
                    )
                seconds = passed if seconds is None else min(seconds, passed)
        if seconds is not None:
            if seconds <= 0:
                return refuse(
                    scope, cycle.real_receive, cycle.real_send, DEADLINE_STATUS, DEADLINE_EXCEEDED
                )
            cancel_scope.deadline = monotonic() + seconds
        return None

    @staticmethod
    def _refuse(cycle: Tracked, header: bytes, value: str, expected: str) -> Awaitable[None]:
        name = header.decode("ascii")
        logger.info(
            "%s %s refused: malformed %s header %s",
            escaped(cycle.scope.get("method", "?")),
            escaped(cycle.scope.get("path", "?")),
            name,
            escaped(repr(value)),
        )
        expected = f"malformed {name} header: expected {expected}"
        return refuse(cycle.scope, cycle.real_receive, cycle.real_send, 400, expected)

    def register(
        self, cycle: Served, call_soon_threadsafe: Callable[[Callable[[], object]], object]
    ) -> None:
        request_id = cycle.cancel_scope.request_id
        if self.registry is not None and request_id is not None:
            self.registry.register(request_id, cycle, call_soon_threadsafe)

    def unregister(self, cycle: Served) -> None:
        request_id = cycle.cancel_scope.request_id
        if self.registry is not None and request_id is not None:
            self.registry.unregister(request_id, cycle)


_STARTS = ("http.response.start", "websocket.accept", "websocket.http.response.start")


class SendWithId:
    """The server's `send` with the request's id added to the response start as `header`,
    unless the app set that header itself (its own id is kept: one header, the app's).

    Every response of a request with an id carries it, the middleware's own (499, 504)
    included; a refused id never gets here. Only the start needs it: once the start has
    passed, the cycle sends to the server's `send` directly. `__wrapped__` is the server's
    `send`, for `_servers` to recognise the server behind it.
    """

    __slots__ = ("__wrapped__", "header", "value")

    def __init__(self, send: Send, header: bytes, request_id: str) -> None:
        self.__wrapped__ = send
        self.header = header
        self.value = request_id.encode("ascii")

    def __call__(self, message: Message) -> Awaitable[None]:
        send = self.__wrapped__
        if message["type"] not in _STARTS:
            return send(message)
        header = self.header
        headers = message.get("headers", ())
        if not isinstance(headers, (list, tuple)):  # any iterable: read once, here
            headers = list(headers)
            message = {**message, "headers": headers}
        for name, _ in headers:
            if name.lower() == header:
                return send(message)
        # A copy: the app may send the same list again (Starlette's `raw_headers`).
        return send({**message, "headers": [*headers, (header, self.value)]})
