"""`RedisBroker`'s connection to Redis: subscribed, pinged, and taken as away once Redis refuses
or drops it, or answers nothing for `health_timeout` seconds (frozen, or a black-holed network
path); each outage logged once, its end once, and the connection made again with backoff."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

logger = logging.getLogger("asgi_cancel")

MAX_BACKOFF = 5.0
# The listener pings Redis this many times per health_timeout.
PINGS_PER_TIMEOUT = 10


class Listener:
    """Listens on `channels` until stopped: hands each message's data to `deliver`, and tells
    `reachable` of each connection made (its client, to publish with) and lost (None)."""

    def __init__(
        self,
        url: str,
        channels: tuple[str, ...],
        *,
        connect_timeout: float,
        health_timeout: float,
        deliver: Callable[[object], Awaitable[None]],
        reachable: Callable[[Any], None],
    ) -> None:
        self.url = url
        self.channels = channels
        self.connect_timeout = connect_timeout
        self.health_timeout = health_timeout
        self.deliver = deliver
        self.reachable = reachable
        self.stopping = False

    async def stop(self, task: asyncio.Task[None]) -> None:
        """End `task` (running `run()`). A cancel that meets redis-py's read timeout expiring in
        the same loop step is taken for that expiry and lost (async-timeout, on Python 3.10),
        so the cancel is repeated until the task ends, and the flag ends the loop at its next
        turn (one ping interval) whatever happens to the cancels. Bounded: after
        `health_timeout` (the longest any of its awaits may take) it is left, logged."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.health_timeout
        while not task.done():
            if loop.time() >= deadline:
                logger.warning("the broker's listener did not stop in %g s", self.health_timeout)
                return
            task.cancel()
            await asyncio.wait({task}, timeout=0.05)

    async def run(self) -> None:
        backoff = 0.1
        away = False
        while not self.stopping:
            client = aioredis.Redis.from_url(
                self.url,
                socket_connect_timeout=self.connect_timeout,
                socket_timeout=self.health_timeout,
            )
            pubsub: Any = client.pubsub()
            try:
                # A frozen Redis (or a black-holed path) still completes the TCP handshake in
                # the kernel: connected means Redis itself confirmed the subscriptions.
                await asyncio.wait_for(self._subscribe(pubsub), self.health_timeout)
                self.reachable(client)
                if away:
                    logger.info(
                        "the broker at %s is reachable again", without_credentials(self.url)
                    )
                away, backoff = False, 0.1
                await self._serve(pubsub)
            except Exception as exc:  # RedisError, OSError, a timeout; anything else in full
                self.reachable(None)
                if not isinstance(exc, (RedisError, OSError, asyncio.TimeoutError)):
                    logger.exception("the broker's listener failed; restarting it")
                if not away:
                    away = True
                    logger.warning(
                        "the broker at %s is unreachable (%s); cancels by id reach this process "
                        "only until it is back",
                        without_credentials(self.url),
                        self._why(exc),
                    )
            finally:
                self.reachable(None)
                await _quietly(pubsub.aclose(), self.connect_timeout)
                await _quietly(client.aclose(), self.connect_timeout)
            if self.stopping:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _subscribe(self, pubsub: Any) -> None:
        await pubsub.subscribe(*self.channels)
        while True:
            message = await pubsub.get_message(timeout=self.health_timeout / PINGS_PER_TIMEOUT)
            if message is None:
                continue
            if message["type"] == "message":
                await self._deliver(message.get("data"))
            elif message["type"] == "subscribe" and message["data"] == len(self.channels):
                return  # every channel confirmed

    async def _serve(self, pubsub: Any) -> None:
        """Deliver the messages; ping Redis every health_timeout / 10 seconds, and raise
        TimeoutError once a ping is unanswered for health_timeout (nothing at all heard)."""
        loop = asyncio.get_running_loop()
        every = self.health_timeout / PINGS_PER_TIMEOUT
        pinged_at = loop.time()  # the last ping sent (the subscription counts as one answered)
        unanswered = False
        while not self.stopping:
            try:
                message = await pubsub.get_message(timeout=every)
            except ResponseError:  # -BUSY during a long script, and the like: Redis is there
                message = {"type": "error"}
            now = loop.time()
            if message is not None:
                unanswered = False  # anything heard: Redis is there
                if message["type"] == "message":
                    await self._deliver(message.get("data"))
            # Judged only after a read found nothing waiting: a loop blocked by the app longer
            # than health_timeout finds the answer in the socket, never a false outage.
            elif unanswered and now - pinged_at > self.health_timeout:
                raise TimeoutError(f"no answer in {self.health_timeout:g} s")
            if now - pinged_at >= every and not unanswered:
                await pubsub.ping()
                pinged_at, unanswered = loop.time(), True

    async def _deliver(self, data: object) -> None:
        # One message that fails (a bug, or one crafted to) costs that message, not the
        # connection and what is queued behind it.
        try:
            await self.deliver(data)
        except Exception:
            logger.exception("a broker message could not be handled; skipped")

    def _why(self, exc: Exception) -> str:
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            return f"no answer in {self.health_timeout:g} s"
        return type(exc).__name__


def without_credentials(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


async def _quietly(closing: Any, timeout: float) -> None:
    try:
        await asyncio.wait_for(closing, timeout)
    except (RedisError, OSError, asyncio.TimeoutError):
        pass
