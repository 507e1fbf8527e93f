"""Drive an ASGI app like a server would, and make the client leave at a chosen point.

httpx's `ASGITransport` and Starlette's `TestClient` cannot simulate a client that disconnects in
the middle of a request. `ClientConnection` is a server-side `receive`/`send` pair that can:

    conn = ClientConnection(body=[b"hello ", b"world"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(conn.run, app)
        await conn.wait_for_body_chunks(3)   # the app has streamed 3 chunks
        conn.disconnect()                    # the client is gone
    assert conn.app_finished

Real servers differ in what `receive()` does after a disconnect: uvicorn and granian answer
`http.disconnect` again on every call, hypercorn and daphne deliver it once and then block
forever. `after_disconnect="block"` (the default) reproduces the stricter behaviour.

`ASGITransport` is the same for an `httpx.AsyncClient`: a drop-in for `httpx.ASGITransport`
whose responses stream and whose client can leave (closing a stream, a read timeout).

Needs anyio (installed with Starlette, httpx and FastAPI), and httpx for `ASGITransport`; works
on asyncio and trio.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal
from urllib.parse import quote

from ._extras import missing_extra

try:
    import anyio
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise missing_extra("testing", exc) from exc

from ._validate import seconds
from .types import ASGIApp, Message, Scope

if TYPE_CHECKING:
    from ._testing_transport import AppStillRunning as AppStillRunning
    from ._testing_transport import ASGITransport as ASGITransport

__all__ = ["ASGITransport", "AppStillRunning", "ClientConnection", "http_scope"]


def __getattr__(name: str) -> object:
    # The transport needs httpx, ClientConnection does not: imported on first use.
    if name in ("ASGITransport", "AppStillRunning"):
        try:
            from . import _testing_transport
        except ImportError as exc:
            raise missing_extra("testing", exc) from exc
        return getattr(_testing_transport, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def http_scope(
    method: str = "GET",
    path: str = "/",
    *,
    headers: Iterable[tuple[bytes, bytes]] = (),
    query_string: bytes = b"",
    spec_version: str = "2.3",
    http_version: str = "1.1",
) -> Scope:
    """Build a minimal, valid HTTP connection scope (`path` decoded, as servers give it;
    `raw_path` its percent-encoded bytes)."""
    raw_path = quote(path, safe="/:@!$&'()*+,;=~").encode("ascii")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": http_version,
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": raw_path,
        "query_string": query_string,
        "root_path": "",
        "headers": list(headers),
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


class ClientConnection:
    """A server-side view of one HTTP request whose client can leave at any moment.

    Args:
        body: the request body, as one bytes object or as the chunks the server delivers
            (each chunk one `http.request` message; all but the last have `more_body`).
        after_disconnect: what `receive()` does once `http.disconnect` was delivered:
            `"block"` waits forever (hypercorn, daphne), `"replay"` answers it again
            (uvicorn, granian).
        body_delay: seconds to wait before delivering each body chunk (a slow upload).
        disconnect_after_response: deliver `http.disconnect` once the app has sent the final
            response message, as every HTTP/1.1 server does (the client has not left).
    """

    def __init__(
        self,
        body: bytes | Sequence[bytes] = b"",
        *,
        after_disconnect: Literal["block", "replay"] = "block",
        body_delay: float = 0.0,
        disconnect_after_response: bool = True,
    ) -> None:
        if after_disconnect not in ("block", "replay"):
            raise ValueError(
                f"after_disconnect must be 'block' or 'replay', got {after_disconnect!r}"
            )
        chunks = [body] if isinstance(body, (bytes, bytearray)) else list(body)
        self._chunks: list[bytes] = [bytes(chunk) for chunk in chunks] or [b""]
        self._after_disconnect = after_disconnect
        self._body_delay = seconds("body_delay", body_delay)
        self._disconnect_after_response = disconnect_after_response
        self._next_chunk = 0
        self._disconnected = anyio.Event()
        self._disconnect_delivered = False
        self._changed = anyio.Event()
        self.sent: list[Message] = []
        """Every message the app passed to `send`, in order."""
        self.receive_calls = 0
        """How many times `receive` was called (by the app or a middleware)."""
        self.app_finished = False
        self.app_exception: BaseException | None = None

    # -- the server's callables -----------------------------------------------------------------
    async def receive(self) -> Message:
        self.receive_calls += 1
        if self._next_chunk < len(self._chunks) and not self._disconnected.is_set():
            if self._body_delay:
                with anyio.move_on_after(self._body_delay):
                    await self._disconnected.wait()
            if not self._disconnected.is_set():
                index = self._next_chunk
                self._next_chunk += 1
                more_body = index < len(self._chunks) - 1
                return {"type": "http.request", "body": self._chunks[index], "more_body": more_body}
        await self._disconnected.wait()
        if self._disconnect_delivered and self._after_disconnect == "block":
            await anyio.sleep_forever()  # (checked after the wait: two callers get one)
        self._disconnect_delivered = True
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self._disconnected.is_set():
            return  # what servers do: drop silently
        self.sent.append(dict(message))
        if self._disconnect_after_response and self.response_complete:
            self._disconnected.set()
        self._notify()

    # -- the client's side ----------------------------------------------------------------------
    def disconnect(self) -> None:
        """The client leaves now: the next (or a pending) `receive()` gets `http.disconnect`."""
        self._disconnected.set()
        self._notify()

    @property
    def disconnected(self) -> bool:
        return self._disconnected.is_set()

    async def run(self, app: ASGIApp, scope: Scope | None = None) -> None:
        """Call `app` with this connection; record how it ended (exceptions are re-raised)."""
        try:
            await app(scope if scope is not None else http_scope(), self.receive, self.send)
        except BaseException as exc:
            self.app_exception = exc
            raise
        finally:
            self.app_finished = True
            self._notify()

    async def wait_for_body_chunks(self, count: int) -> None:
        """Wait until the app has sent `count` non-empty response body chunks."""
        while self.body_chunks < count and not self.app_finished:
            await self._wait_changed()

    async def wait_for_response_start(self) -> None:
        while self.status is None and not self.app_finished:
            await self._wait_changed()

    async def wait_until_finished(self) -> None:
        while not self.app_finished:
            await self._wait_changed()

    # -- what the client got --------------------------------------------------------------------
    @property
    def status(self) -> int | None:
        for message in self.sent:
            if message["type"] == "http.response.start":
                status: int = message["status"]
                return status
        return None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    @property
    def body_chunks(self) -> int:
        return sum(1 for m in self.sent if m["type"] == "http.response.body" and m.get("body"))

    @property
    def response_complete(self) -> bool:
        return any(
            m["type"] == "http.response.body" and not m.get("more_body", False) for m in self.sent
        )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_changed(self) -> None:
        await self._changed.wait()
