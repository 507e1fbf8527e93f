"""One request through `asgi_cancel.testing.ASGITransport`: the app's `receive`/`send` on one
side, the client's reads on the other, each waiting for the other as a server's connection does."""

from __future__ import annotations

import contextvars
import enum
import math
from collections import deque
from collections.abc import Callable

import anyio
import anyio.lowlevel
import httpx

from ._backend import library
from .types import AnyASGIApp, Message, Scope

# What the app may send ahead of the client's reads before `send()` waits: uvicorn's high-water
# mark. A stream then runs with the client, and the client that leaves stops it within 64 KiB.
HIGH_WATER = 65536


class State(enum.Enum):
    OPEN = "open"  # the client is reading
    COMPLETE = "complete"  # the app sent its final body message
    LEFT = "left"  # the client went away before that


class Exchange:
    """One request: the app's `receive`/`send` on one side, the client's reads on the other."""

    def __init__(self, request: httpx.Request, after_disconnect: str) -> None:
        assert isinstance(request.stream, httpx.AsyncByteStream)  # an AsyncClient's
        self.request = request
        self._request_body: httpx.AsyncByteStream = request.stream
        self.after_disconnect = after_disconnect
        self.state = State.OPEN
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.app_error: BaseException | None = None
        self.upload_error: Exception | None = None  # raised by the request body's iterator
        self.closed = False  # by the client's side: finish() ran
        self._uploaded: deque[bytes] = deque()  # request body read from the client, not received
        self._upload_done = False
        self._final_request_sent = False
        self._disconnect_delivered = False
        self._downloaded: deque[bytes] = deque()  # response body sent by the app, not yet read
        self._buffered = 0
        self._changed = anyio.Event()
        self.finished = anyio.Event()
        self._app_scope = anyio.CancelScope()
        self._upload_scope = anyio.CancelScope()

    def start(self, app: AnyASGIApp, scope: Scope) -> None:
        # The app outlives handle_async_request (it streams while the client reads), so it
        # cannot run in a task group of the caller's, and anyio has no task outside one: it runs
        # in tasks of the running loop's own (the package's backend seam), awaited or cancelled
        # by the response's aclose() within exit_timeout. In a context of their own, as under a
        # server, whichever the loop.
        running = library()
        assert running is not None  # an httpx call runs in an event loop
        for work in (self._upload(), self._run(app, scope)):
            contextvars.Context().run(running.spawn_detached, work)

    async def _run(self, app: AnyASGIApp, scope: Scope) -> None:
        try:
            with self._app_scope:
                await app(scope, self.receive, self.send)
        except BaseException as exc:  # handed to the client's side
            self.app_error = exc
        finally:
            self._upload_scope.cancel()
            self.finished.set()
            self._notify()

    async def _upload(self) -> None:
        # The client's side of the body, in its own task so that a receive() cancelled by the
        # app (or interrupted by the disconnect) loses no chunk of an async-iterator body.
        with self._upload_scope:
            try:
                async for chunk in self._request_body:
                    if not chunk:
                        continue
                    self._uploaded.append(chunk)
                    self._notify()
                    while len(self._uploaded) > 1:  # one ahead: the last chunk ends the body
                        await self._wait_changed()
            except Exception as exc:  # the body's own error: to the app, a dropped connection
                self.upload_error = exc
                self.leave()
                return
            self._upload_done = True
            self._notify()

    # -- the server's callables -----------------------------------------------------------------
    async def receive(self) -> Message:
        while self.state is State.OPEN:
            if self._uploaded:
                body = self._uploaded.popleft()
                more_body = bool(self._uploaded) or not self._upload_done
                self._final_request_sent = not more_body
                self._notify()
                return {"type": "http.request", "body": body, "more_body": more_body}
            if self._upload_done and not self._final_request_sent:
                self._final_request_sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await self._wait_changed()
        if self._disconnect_delivered and self.after_disconnect == "block":
            await anyio.sleep_forever()
        self._disconnect_delivered = True
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        await anyio.lowlevel.checkpoint()  # a loop of sends lets the client run
        if self.state is State.LEFT:
            return  # dropped, as servers do
        if self.state is State.COMPLETE:
            raise RuntimeError(f"{message['type']!r} sent after the response completed")
        if message["type"] == "http.response.start":
            if self.status is not None:
                raise RuntimeError("'http.response.start' sent twice")
            self.status = message["status"]
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            if self.status is None:
                raise RuntimeError("'http.response.body' sent before 'http.response.start'")
            body = bytes(message.get("body", b""))
            if body and self.request.method != "HEAD":
                self._downloaded.append(body)
                self._buffered += len(body)
            if not message.get("more_body", False):
                self.state = State.COMPLETE
        self._notify()
        while self._buffered >= HIGH_WATER and self.state is State.OPEN:
            await self._wait_changed()

    # -- the client's side ----------------------------------------------------------------------
    async def wait_response_start(self, read_timeout: float | None) -> None:
        await self._wait(
            lambda: (
                self.status is not None or self.finished.is_set() or self.upload_error is not None
            ),
            read_timeout,
        )

    async def next_chunk(self, read_timeout: float | None) -> bytes | None:
        """The next body chunk; None at the end of the body."""
        await self._wait(
            lambda: (
                bool(self._downloaded) or self.state is not State.OPEN or self.finished.is_set()
            ),
            read_timeout,
        )
        if self._downloaded:
            chunk = self._downloaded.popleft()
            self._buffered -= len(chunk)
            self._notify()
            return chunk
        return None

    def leave(self) -> None:
        """The client goes away: the app's next (or pending) `receive()` is `http.disconnect`."""
        if self.state is State.OPEN:
            self.state = State.LEFT
            self._notify()

    def cancel(self) -> None:
        self._app_scope.cancel()

    async def _wait(self, ready: Callable[[], bool], read_timeout: float | None) -> None:
        with anyio.move_on_after(math.inf if read_timeout is None else read_timeout) as watchdog:
            while not ready():
                await self._wait_changed()
        if watchdog.cancelled_caught:
            raise httpx.ReadTimeout(f"nothing read for {read_timeout}s", request=self.request)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_changed(self) -> None:
        await self._changed.wait()
