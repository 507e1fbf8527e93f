"""asgi_cancel.testing: the helper users test their own apps with (the docs example included)."""

from __future__ import annotations

import anyio
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import Message, Receive, Scope, Send

pytestmark = pytest.mark.anyio


async def stream_app(scope: Scope, receive: Receive, send: Send) -> None:
    while (await receive()).get("more_body", False):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for index in range(1000):
        await send({"type": "http.response.body", "body": b"%d" % index, "more_body": True})
        await anyio.sleep(0.002)
    await send({"type": "http.response.body", "body": b""})


async def test_docs_example_stream_stops_when_client_leaves() -> None:
    conn = ClientConnection(b'{"prompt": "hi", "stream": true}')
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                conn.run, CancelOnDisconnectMiddleware(stream_app), http_scope("POST", "/v1/x")
            )
            await conn.wait_for_body_chunks(3)
            conn.disconnect()
    assert conn.app_finished
    assert conn.app_exception is None
    assert not conn.response_complete
    assert conn.status == 200
    assert 3 <= conn.body_chunks < 1000


@pytest.mark.parametrize(
    ("after", "expected"),
    [("replay", ["http.disconnect"] * 3), ("block", ["http.disconnect", "blocked", "blocked"])],
)
async def test_after_disconnect_modes_mimic_servers(after: str, expected: list[str]) -> None:
    conn = ClientConnection(b"x", after_disconnect=after)  # type: ignore[arg-type]
    assert (await conn.receive())["body"] == b"x"
    conn.disconnect()
    seen: list[str] = []
    for _ in range(3):
        with anyio.move_on_after(0.05):
            seen.append((await conn.receive())["type"])
            continue
        seen.append("blocked")
    assert seen == expected


async def test_body_chunks_slow_upload_and_disconnect_after_response() -> None:
    conn = ClientConnection([b"a", b"b"], body_delay=0.01)
    got: list[Message] = [await conn.receive(), await conn.receive()]
    assert [(m["body"], m["more_body"]) for m in got] == [(b"a", True), (b"b", False)]
    assert not conn.disconnected
    await conn.send({"type": "http.response.start", "status": 204, "headers": []})
    await conn.send({"type": "http.response.body", "body": b""})
    assert conn.response_complete
    assert conn.disconnected  # what every HTTP/1.1 server does after a response
    with anyio.fail_after(1):
        assert await conn.receive() == {"type": "http.disconnect"}
    await conn.send({"type": "http.response.body", "body": b"late"})
    assert len(conn.sent) == 2  # dropped, as servers do


def test_an_unknown_after_disconnect_is_a_value_error() -> None:  # body_delay: test_validate
    with pytest.raises(ValueError, match="after_disconnect"):
        ClientConnection(after_disconnect="sometimes")  # type: ignore[arg-type]


def test_http_scope_is_valid() -> None:
    scope = http_scope("POST", "/a b", headers=[(b"x", b"1")], spec_version="2.4")
    assert scope["type"] == "http"
    assert scope["raw_path"] == b"/a%20b"  # as sent on the wire
    assert scope["asgi"] == {"version": "3.0", "spec_version": "2.4"}
    assert scope["headers"] == [(b"x", b"1")]


async def test_block_after_the_disconnect_delivers_it_once_to_callers_waiting_together() -> None:
    got: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})

        async def listen(name: str) -> None:
            got.append(f"{name}: {(await receive())['type']}")

        with anyio.move_on_after(0.5):  # the second caller blocks, as on hypercorn
            async with anyio.create_task_group() as listeners:
                listeners.start_soon(listen, "first")
                listeners.start_soon(listen, "second")

    conn = ClientConnection(after_disconnect="block")
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(conn.run, app, http_scope())
            await conn.wait_for_body_chunks(1)
            await anyio.sleep(0.05)  # both wait in receive()
            conn.disconnect()
    assert len(got) == 1
