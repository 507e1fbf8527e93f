"""The cancel line and its fields (`_report.py`): escaped, capped, and saying what happened."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry
from asgi_cancel._report import MAX_LOGGED, escaped
from asgi_cancel.testing import http_scope
from asgi_cancel.types import Receive, Scope, Send

from .helpers import running

pytestmark = pytest.mark.anyio


async def sleeps(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["path"].startswith("/stream"):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
    await anyio.sleep(30)


async def cancelled_line(
    caplog: pytest.LogCaptureFixture, scope: Scope, leave: bool = True, **options: Any
) -> tuple[str, dict[str, Any]]:
    """Run `sleeps` until the client leaves (or a deadline passes); the one line logged."""
    with caplog.at_level(logging.INFO, logger="asgi_cancel"):
        async with running(CancelOnDisconnectMiddleware(sleeps, **options), scope) as conn:
            if leave:
                await anyio.sleep(0.05)
                conn.disconnect()
    records = [record for record in caplog.records if record.name == "asgi_cancel"]
    assert len(records) == 1, [record.getMessage() for record in records]
    return records[0].getMessage(), getattr(records[0], "asgi_cancel")  # noqa: B009


@pytest.mark.parametrize(
    ("path", "logged"),
    [
        ("/a\r\nINFO:asgi_cancel:forged", "/a\\r\\nINFO:asgi_cancel:forged"),
        ("/\x1b[31mred", "/\\x1b[31mred"),
        ("/line\u2028separator", "/line\\u2028separator"),
        ("/caf\xe9", "/caf\\xe9"),
    ],
    ids=["crlf", "escape-sequence", "unicode-line-separator", "latin-1"],
)
async def test_a_path_is_logged_escaped_on_one_line(
    caplog: pytest.LogCaptureFixture, path: str, logged: str
) -> None:
    line, fields = await cancelled_line(caplog, http_scope("GET", path))
    assert line.startswith(f"GET {logged} cancelled after ")
    assert line.isprintable()
    assert fields["path"] == logged


async def test_a_long_path_is_capped_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    line, fields = await cancelled_line(caplog, http_scope("GET", "/" + "a" * 100_000))
    assert len(fields["path"]) == MAX_LOGGED + 3
    assert len(line) < MAX_LOGGED + 200


async def test_the_request_id_is_in_the_fields(caplog: pytest.LogCaptureFixture) -> None:
    scope = http_scope(headers=[(b"x-request-id", b"req-7")])
    _, fields = await cancelled_line(caplog, scope, registry=CancelRegistry())
    assert fields["request_id"] == "req-7"
    assert fields["reason"] == "client disconnected"
    assert fields["status"] == 499


@pytest.mark.parametrize(
    ("path", "ending", "status"),
    [
        ("/slow", "before the response: deadline exceeded (504)", 504),
        ("/stream", "mid-stream: deadline exceeded (stream cut)", None),
    ],
    ids=["before-the-response", "mid-stream"],
)
async def test_a_deadline_logs_what_the_client_gets(
    caplog: pytest.LogCaptureFixture, path: str, ending: str, status: int | None
) -> None:
    line, fields = await cancelled_line(caplog, http_scope("GET", path), leave=False, timeout=0.05)
    assert line.endswith(ending)
    assert fields["status"] == status


def test_escaped_leaves_plain_ascii_alone_and_escapes_the_rest() -> None:
    assert escaped("/v1/chat/completions?x=1") == "/v1/chat/completions?x=1"
    assert escaped("a\tb") == "a\\tb"
    assert escaped(42) == "42"
