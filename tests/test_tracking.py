"""The edge of ids and deadlines (`_tracking.py`): every header read there is hostile input.

Budgets and ids are parsed in linear time and capped in length, malformed values are answered
400 before the app runs and logged on one escaped line, header options must be header names,
and route prefixes match the path the app routes on.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, current_token
from asgi_cancel._tracking import MAX_BUDGET, parse_duration, route_path
from asgi_cancel._validate import valid_request_id
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import Receive, Scope, Send

from .helpers import respond, served

pytestmark = pytest.mark.anyio
# httptools accepts a header value this long; h11 and hypercorn cap lower.
HEADER_LIMIT = 1024 * 1024


async def answer_with_the_token(scope: Scope, receive: Receive, send: Send) -> None:
    token = current_token()
    answer = {"id": token.request_id, "remaining": token.remaining()}
    await respond(send, json.dumps(answer).encode())


async def run(scope: Scope, **options: Any) -> ClientConnection:
    return await served(CancelOnDisconnectMiddleware(answer_with_the_token, **options), scope)


# -- budgets ------------------------------------------------------------------------------------
PARSED = {"30": 30.0, "1.5": 1.5, ".5s": 0.5, "30s": 30.0, "500ms": 0.5, "2m": 120.0}
PARSED |= {" \t2 m\t ": 120.0, "9" * 32: MAX_BUDGET}  # capped at a day: finite, forwarded so
REFUSED = ["", "s", "1.5.5", "-1", "1e3", "nan", "inf", "5 h", "1 2", "1s s", "٣", "9" * 33]
REFUSED += ["1" + " " * 40]


@pytest.mark.parametrize(("value", "seconds"), [*PARSED.items(), *((v, None) for v in REFUSED)])
def test_budgets_that_parse_or_not(value: str, seconds: float | None) -> None:
    assert parse_duration(value) == seconds


_UNITS = {"": 1.0, "s": 1.0, "ms": 0.001, "m": 60.0}


@given(
    number=st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False),
    unit=st.sampled_from(sorted(_UNITS)),
    left=st.text(" \t", max_size=4),
    middle=st.text(" \t", max_size=2),
    right=st.text(" \t", max_size=4),
)
def test_equivalent_budgets_parse_the_same(
    number: Any, unit: str, left: str, middle: str, right: str
) -> None:
    """Whitespace around the value and between number and unit never changes the answer, and
    a unit means what it says."""
    text = f"{number}{middle}{unit}" if unit else str(number)
    value = f"{left}{text}{right}"
    expected = min(float(number) * _UNITS[unit], MAX_BUDGET)
    if len(value) > 32:
        assert parse_duration(value) is None  # too long to be a budget, however well-formed
    else:
        assert parse_duration(value) == pytest.approx(expected)


@given(st.text(alphabet=st.sampled_from("0123456789. \tmsx"), max_size=200))
def test_any_string_parses_to_none_or_a_finite_capped_budget(value: str) -> None:
    seconds = parse_duration(value)
    assert seconds is None or 0 <= seconds <= MAX_BUDGET


@pytest.mark.parametrize(
    "hostile",
    [
        "1" + " " * HEADER_LIMIT + "x",  # the pattern that stalled the loop for 22.9 s at 100 KB
        "1" * HEADER_LIMIT,
        "1." + "1" * HEADER_LIMIT + "x",
        " " * HEADER_LIMIT,
        "\t1" * (HEADER_LIMIT // 2),
    ],
    ids=["digit-spaces-x", "digits", "decimal-x", "spaces", "tabs"],
)
def test_a_budget_as_long_as_the_server_allows_is_refused_at_once(hostile: str) -> None:
    """Linear in the input (and capped): a value up to the server's header limit is refused
    in a small fraction of a second, where the quadratic pattern needed minutes."""
    started = time.perf_counter()
    for _ in range(10):
        assert parse_duration(hostile) is None
    assert time.perf_counter() - started < 1.0


async def test_a_huge_budget_without_a_configured_deadline_is_capped_not_infinite() -> None:
    scope = http_scope(headers=[(b"x-request-timeout", b"9" * 32)])
    conn = await run(scope, timeout_header="x-request-timeout")
    assert conn.status == 200
    remaining = json.loads(conn.body)["remaining"]
    assert MAX_BUDGET - 5 < remaining <= MAX_BUDGET


# -- ids ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "request_id",
    ["0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "req_01HZX", "a:b=c+d@e~f.g", "x" * 200],
    ids=["uuid", "prefixed", "punctuation", "200-characters"],
)
async def test_an_id_of_the_safe_kind_is_kept(request_id: str) -> None:
    scope = http_scope(headers=[(b"x-request-id", request_id.encode())])
    conn = await run(scope, registry=CancelRegistry())
    assert conn.status == 200
    assert json.loads(conn.body)["id"] == request_id


MALFORMED = [b"x" * 201, b"caf\xe9", b"a/b", b"a\r\nb", b"a b", b"<script>", b"a;b", b"\x00"]
IDS = ["201-characters", "latin-1", "slash", "crlf", "space", "markup", "semicolon", "nul"]
HOSTILE_BUDGET = ("x-request-timeout", b"1" + b" " * 100_000 + b"x")


@pytest.mark.parametrize(
    ("header", "raw"),
    [*(("x-request-id", raw) for raw in MALFORMED), HOSTILE_BUDGET],
    ids=[*IDS, "a-hostile-budget"],
)
async def test_an_id_of_any_other_kind_is_400_and_logged_on_one_escaped_line(
    header: str, raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Replacing it silently would make a later cancel by that id answer 404; passing it on
    would break the next hop's headers (httpx refuses a latin-1 byte) or a URL path. A hostile
    budget the same: the app never runs."""
    scope = http_scope("POST", "/v1/x\r\nFORGED", headers=[(header.encode(), raw)])
    options = {"timeout_header": header} if header == "x-request-timeout" else {}
    with caplog.at_level(logging.INFO, logger="asgi_cancel"):
        conn = await run(scope, registry=CancelRegistry(), **options)
    assert conn.status == 400
    assert header in json.loads(conn.body)["error"]
    (line,) = [record.getMessage() for record in caplog.records if record.name == "asgi_cancel"]
    assert "\n" not in line
    assert "\r" not in line
    assert line.startswith(f"POST /v1/x\\r\\nFORGED refused: malformed {header} header")


async def test_an_empty_id_header_gets_a_generated_id() -> None:
    conn = await run(http_scope(headers=[(b"x-request-id", b"  ")]), registry=CancelRegistry())
    assert len(json.loads(conn.body)["id"]) == 24


@given(st.text(max_size=300))
def test_every_valid_id_is_safe_in_a_path_a_header_and_a_log_line(value: str) -> None:
    if valid_request_id(value):
        assert 1 <= len(value) <= 200
        assert value.isascii()
        assert value.isprintable()
        assert not set(value) & set("/ ?#%\\\"'<>;,")


# -- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("header", ["X Request Id", "x-request-id:", "", "é"])
def test_a_registry_header_that_is_not_a_header_name_is_a_value_error(header: str) -> None:
    with pytest.raises(ValueError, match="header"):
        CancelRegistry(header=header)


# -- the path the app routes on ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "root", "routed"),
    [
        ("/api/payments/1", "/api", "/payments/1"),
        ("/api", "/api", "/"),
        ("/apix/payments", "/api", "/apix/payments"),  # not under the root
        ("/payments", "", "/payments"),
    ],
)
def test_route_path_drops_the_root_path(path: str, root: str, routed: str) -> None:
    assert route_path({"path": path, "root_path": root}) == routed
