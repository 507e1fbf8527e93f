"""Cancel by id across processes and machines: a `CancelRegistry` broker on Redis pub/sub.

```python
from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry
from asgi_cancel.redis import RedisBroker

registry = CancelRegistry(broker=RedisBroker("redis://cancel-bus:6379/0"))
app = CancelOnDisconnectMiddleware(app, registry=registry)
```

Every process of the deployment (the workers of `uvicorn --workers N`, several servers,
several machines) gives its registry a broker on the same Redis (or Valkey) and channel. A
cancel issued in any of them, by `registry.acancel()` or the cancel endpoint, is published to
all; the process that holds the request stops it under the same rules as a local cancel, and
answers, so that the caller learns within `wait` seconds whether some process held it.
Registration stays local: a request that is not cancelled costs no network round trip, and an
outage of Redis (down, or frozen: silent for `health_timeout`) never harms or slows a request;
cancels then reach the local process only, and the outage is logged once. Needs the `redis`
extra (`pip install 'asgi-cancel[redis]'`) and an asyncio event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
from typing import Any
from urllib.parse import urlsplit

from ._extras import missing_extra

try:
    from redis.exceptions import RedisError

    from ._redis_listener import Listener, without_credentials
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise missing_extra("redis", exc) from exc

from ._registry import CancelRegistry
from ._validate import seconds, valid_request_id

__all__ = ["RedisBroker"]

logger = logging.getLogger("asgi_cancel")

# A message is a small JSON object; anything longer is not ours and is dropped unread.
MAX_MESSAGE = 1024
MAX_REASON = 100
_VERSION = 1


class RedisBroker:
    """Carries a `CancelRegistry`'s cancels between processes over Redis pub/sub.

    Each process subscribes to `channel` (cancels) and to a reply channel of its own. A cancel
    is published with a nonce; each other process stops what it holds and answers on the
    sender's reply channel. Redis tells the sender how many processes received the message, so
    the answer comes as soon as one held the request or all said no, and at the latest after
    `wait` seconds (then: not held).

    The connection is made when the registry is first used in an event loop (a request, a
    cancel), and made again with backoff after an outage, which is logged once (WARNING) and
    its end once (INFO). An outage is a refused or lost connection, or a Redis that answers
    nothing for `health_timeout` seconds (frozen, or a black-holed network path: noticed at
    most 1.3 x `health_timeout` after it stopped answering). While it lasts, a cancel that no
    local request held is answered at once, not held (the endpoint's 404, with `"broker":
    "unreachable"`), and nothing queues: it is not sent at all. Incoming messages are
    size-capped and their ids checked as at the edge (1 to 200 of `A-Z a-z 0-9 . _ ~ : + =
    @ -`). Redis is trusted infrastructure: see docs/at-scale.md for an
    ACL user and TLS (`rediss://`).

    Args:
        url: the Redis URL (`redis://`, `rediss://` for TLS, `unix://`), with the ACL user's
            credentials if any (never logged).
        channel: the pub/sub channel the deployment shares.
        wait: seconds a cancel waits for the other processes' answers at most.
        connect_timeout: seconds opening a connection may take at most, and each publish
            that waits for no answers.
        health_timeout: seconds Redis may leave the broker's ping unanswered before it is
            taken as away (a frozen Redis, a black-holed network path: a connection that stays
            open and silent); the listener pings it every tenth of that, and a new connection
            counts once Redis confirmed the subscriptions within it. The default, 10 s, is
            twice the 5 s after which a Redis busy with a long script answers BUSY
            (`busy-reply-threshold`): keep it above that, and a busy Redis is never taken as
            away. 6 s notices a freeze of 8 s (within 7.8 s), at 10 / 6 pings a second.

    Raises:
        ValueError: `url` is not a Redis URL, or a duration is not a positive number.
    """

    def __init__(
        self,
        url: str,
        *,
        channel: str = "asgi-cancel",
        wait: float = 1.0,
        connect_timeout: float = 0.5,
        health_timeout: float = 10.0,
    ) -> None:
        scheme = urlsplit(url).scheme if isinstance(url, str) else ""
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {url!r}")
        if not isinstance(channel, str) or not channel or len(channel) > 100:
            raise ValueError(f"channel must be a short non-empty name, got {channel!r}")
        for name, value in (
            ("wait", wait),
            ("connect_timeout", connect_timeout),
            ("health_timeout", health_timeout),
        ):
            seconds(name, value, positive=True, below=60)
        self.url = url
        self.channel = channel
        self.wait = float(wait)
        self.connect_timeout = float(connect_timeout)
        self.health_timeout = float(health_timeout)
        self.node = os.urandom(8).hex()
        self.connected = False
        self._registry: CancelRegistry | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._listener: Listener | None = None
        self._client: Any = None
        self._pending: dict[str, _Answers] = {}
        self._sending: set[asyncio.Task[object]] = set()
        self._nonces = 0
        self._tried = False  # a first connection attempt has ended (made or failed)
        self._tried_event: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"<RedisBroker {without_credentials(self.url)} channel={self.channel!r}>"

    # -- Broker ----------------------------------------------------------------------------------
    def bind(self, registry: CancelRegistry) -> None:
        if self._registry is not None and self._registry is not registry:
            raise ValueError("a RedisBroker serves one CancelRegistry")
        self._registry = registry

    def start_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            logger.warning("RedisBroker needs asyncio; cancels stay local here")
            return
        self._loop = loop
        self._tried_event = asyncio.Event()
        listener = self._listener = Listener(
            self.url,
            (self.channel, self._reply_channel(self.node)),
            connect_timeout=self.connect_timeout,
            health_timeout=self.health_timeout,
            deliver=self._received,
            reachable=self._reachable,
        )
        # An empty context: the listener must not keep the first request's context alive.
        self._task = contextvars.Context().run(loop.create_task, listener.run())

    async def cancel_elsewhere(self, request_id: str, reason: str) -> bool:
        loop = self._loop
        if loop is None:
            return False  # not started (no asyncio loop): the local answer is the answer
        if not self.connected and not self._tried:
            # Started just now (the first use of a process): its first connection is on the way.
            if asyncio.get_running_loop() is loop:
                await self._first_connection()
            else:
                waiting = asyncio.run_coroutine_threadsafe(self._first_connection(), loop)
                await asyncio.wrap_future(waiting)
        if not self.connected:
            return False  # Redis is away: the local answer is the answer
        if asyncio.get_running_loop() is not loop:
            future = asyncio.run_coroutine_threadsafe(self._ask(request_id, reason), loop)
            return await asyncio.wrap_future(future)
        return await self._ask(request_id, reason)

    def cancel_elsewhere_soon(self, request_id: str, reason: str) -> None:
        loop = self._loop
        if loop is None or not self.connected:
            return
        try:
            loop.call_soon_threadsafe(self._send_soon, self._cancel_message(request_id, reason))
        except RuntimeError:  # the loop is closed
            pass

    def _reachable(self, client: Any) -> None:
        # The listener's word: connected (the client to publish with), or away (None).
        if client is not None:
            self._client = client
        self.connected = client is not None
        if not self._tried:  # a first connection attempt has ended (made or failed)
            self._tried = True
            if self._tried_event is not None:
                self._tried_event.set()

    async def _first_connection(self) -> None:
        assert self._tried_event is not None
        try:
            await asyncio.wait_for(self._tried_event.wait(), self.connect_timeout * 2)
        except asyncio.TimeoutError:
            pass

    async def aclose(self) -> None:
        """Stop listening and close the connection (at the app's shutdown; optional: the
        event loop's end does the same). Cancels are local from then on. Waits for the
        listener `health_timeout` at most (then logged and left)."""
        task, self._task = self._task, None
        if task is not None and self._listener is not None:
            await self._listener.stop(task)
        for sending in list(self._sending):
            sending.cancel()

    # -- sending ---------------------------------------------------------------------------------
    def _cancel_message(self, request_id: str, reason: str, nonce: str = "") -> bytes:
        message = {
            "v": _VERSION,
            "op": "cancel",
            "id": request_id,
            "reason": reason[:MAX_REASON],
            "from": self.node,
            "nonce": nonce,
        }
        return json.dumps(message).encode()

    async def _ask(self, request_id: str, reason: str) -> bool:
        self._nonces += 1
        nonce = f"{self._nonces}"
        answers = self._pending[nonce] = _Answers()
        message = self._cancel_message(request_id, reason, nonce)

        async def publish_and_wait() -> bool:
            receivers = await self._client.publish(self.channel, message)
            answers.expect(int(receivers) - 1)  # every subscriber but us answers
            return await answers.held

        try:
            return await asyncio.wait_for(publish_and_wait(), self.wait)
        except (asyncio.TimeoutError, RedisError, OSError):
            return answers.any_held
        finally:
            del self._pending[nonce]

    def _send_soon(self, data: bytes, channel: str | None = None) -> None:
        task = asyncio.get_running_loop().create_task(self._send(data, channel or self.channel))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, data: bytes, channel: str) -> None:
        try:
            await asyncio.wait_for(self._client.publish(channel, data), self.connect_timeout)
        except (asyncio.TimeoutError, RedisError, OSError):
            logger.debug("a broker message was not sent", exc_info=True)

    # -- receiving -------------------------------------------------------------------------------
    async def _received(self, data: object) -> None:
        if not isinstance(data, bytes) or len(data) > MAX_MESSAGE:
            return
        try:
            message = json.loads(data)
        except (ValueError, RecursionError):  # (a thousand "[" nest past the parser's limit)
            return
        if not isinstance(message, dict) or message.get("v") != _VERSION:
            return
        sender, nonce = message.get("from"), message.get("nonce")
        if not (isinstance(sender, str) and isinstance(nonce, str)) or sender == self.node:
            return
        if message.get("op") == "reply":
            answers = self._pending.get(nonce)
            if answers is not None:
                answers.add(message.get("held") is True)
            return
        request_id, reason = message.get("id"), message.get("reason")
        if message.get("op") != "cancel" or not isinstance(request_id, str):
            return
        if not valid_request_id(request_id) or not isinstance(reason, str):
            return
        registry = self._registry
        assert registry is not None
        held = await registry.stop_here(request_id, reason[:MAX_REASON])
        if not held:
            registry.remember_cancel(request_id)
        if nonce and len(nonce) <= 32 and len(sender) <= 32:
            reply = {"v": _VERSION, "op": "reply", "nonce": nonce, "held": held, "from": self.node}
            self._send_soon(json.dumps(reply).encode(), self._reply_channel(sender))

    def _reply_channel(self, node: str) -> str:
        return f"{self.channel}:reply:{node}"


class _Answers:
    """The other processes' answers to one cancel: done at the first 'held', or once all the
    expected answers are in."""

    def __init__(self) -> None:
        self.held: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.any_held = False
        self.count = 0
        self.expected: int | None = None

    def expect(self, count: int) -> None:
        self.expected = count
        self._check()

    def add(self, held: bool) -> None:
        self.count += 1
        self.any_held = self.any_held or held
        self._check()

    def _check(self) -> None:
        if self.held.done():
            return
        if self.any_held or (self.expected is not None and self.count >= self.expected):
            self.held.set_result(self.any_held)
