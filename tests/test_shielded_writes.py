"""Shielded writes to a real database: a record is fully written or never started, never half.

The endpoint writes one order as four autocommitted statements (an order row, two item rows,
the order's total), through stdlib `sqlite3` in a worker thread or through `aiosqlite`. A first
run counts its await points; then the client leaves at each of them in turn, and during each
worker-thread call, and the table is checked afterwards. Inside `shield()` every run leaves no
order or a whole one. The same endpoint without `shield()` leaves half an order at some point:
that is why `shield` exists.
"""

from __future__ import annotations

import gc
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, asynccontextmanager, closing, nullcontext
from dataclasses import dataclass
from pathlib import Path

import aiosqlite
import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, shield
from asgi_cancel.testing import ClientConnection, http_scope

from .helpers import respond
from .servers.events import Receive, Scope, Send

pytestmark = [
    pytest.mark.anyio,
    # aiosqlite cancelled in the middle of connect() leaves its connection to the garbage
    # collector, and Python 3.13 warns about an unclosed database: not what is tested here.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

WATCHDOG = 10.0
ORDER_ID = 1
SCHEMA = (
    "CREATE TABLE orders (id INTEGER PRIMARY KEY, total INTEGER NOT NULL)",
    "CREATE TABLE items (order_id INTEGER NOT NULL, sku TEXT NOT NULL)",
)
STATEMENTS = (
    ("INSERT INTO orders (id, total) VALUES (?, 0)", (ORDER_ID,)),
    ("INSERT INTO items (order_id, sku) VALUES (?, 'apple')", (ORDER_ID,)),
    ("INSERT INTO items (order_id, sku) VALUES (?, 'pear')", (ORDER_ID,)),
    ("UPDATE orders SET total = 2 WHERE id = ?", (ORDER_ID,)),
)
NOTHING: tuple[list[tuple[int, int]], int] = ([], 0)
WHOLE: tuple[list[tuple[int, int]], int] = ([(ORDER_ID, 2)], 2)


@dataclass
class Injector:
    """Numbers the endpoint's await points; the client leaves at the chosen one."""

    conn: ClientConnection
    at: int | None
    in_thread: int | None
    points: int = 0
    threads: int = 0

    def point(self) -> None:
        if self.points == self.at:
            self.conn.disconnect()
        self.points += 1

    def thread_call(self) -> None:
        """Called inside a worker thread, after its statement ran."""
        if self.threads == self.in_thread:
            anyio.from_thread.run_sync(self.conn.disconnect)
            time.sleep(0.02)  # the thread goes on a little after the client left
        self.threads += 1


Execute = Callable[[str, tuple[int, ...]], Awaitable[None]]


@asynccontextmanager
async def sqlite3_in_a_thread(path: Path, injector: Injector) -> AsyncIterator[Execute]:
    with closing(sqlite3.connect(path, isolation_level=None, check_same_thread=False)) as db:

        def run(sql: str, parameters: tuple[int, ...]) -> None:
            db.execute(sql, parameters)
            injector.thread_call()

        async def execute(sql: str, parameters: tuple[int, ...]) -> None:
            await anyio.to_thread.run_sync(run, sql, parameters)

        yield execute


@asynccontextmanager
async def with_aiosqlite(path: Path, injector: Injector) -> AsyncIterator[Execute]:
    async with aiosqlite.connect(path, isolation_level=None) as db:

        async def execute(sql: str, parameters: tuple[int, ...]) -> None:
            await db.execute(sql, parameters)

        yield execute


DRIVERS = {"sqlite3-thread": sqlite3_in_a_thread, "aiosqlite": with_aiosqlite}


def order_app(
    path: Path, injector: Injector, driver: str, *, shielded: bool
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        injector.point()
        await anyio.lowlevel.checkpoint()
        async with DRIVERS[driver](path, injector) as execute:
            guard: AbstractContextManager[object] = shield() if shielded else nullcontext()
            with guard:
                for sql, parameters in STATEMENTS:
                    injector.point()
                    await execute(sql, parameters)
            injector.point()
            await anyio.lowlevel.checkpoint()
        await respond(send, b"created", 201)

    return app


def stored(path: Path) -> tuple[list[tuple[int, int]], int]:
    with closing(sqlite3.connect(path)) as db:
        orders = db.execute("SELECT id, total FROM orders").fetchall()
        items = db.execute("SELECT COUNT(*) FROM items").fetchone()[0]
    return orders, items


async def place_order(
    tmp_path: Path, driver: str, *, shielded: bool, at: int | None, in_thread: int | None
) -> tuple[tuple[list[tuple[int, int]], int], Injector]:
    path = tmp_path / f"orders-{shielded}-{at}-{in_thread}.sqlite"
    with closing(sqlite3.connect(path)) as db:
        db.executescript(";".join(SCHEMA))
    conn = ClientConnection(b"order")
    injector = Injector(conn, at=at, in_thread=in_thread)
    # watch_delay=0: watched from the first await (the whole order takes under 5 ms).
    app = CancelOnDisconnectMiddleware(
        order_app(path, injector, driver, shielded=shielded), watch_delay=0
    )
    with anyio.fail_after(WATCHDOG):
        await conn.run(app, http_scope("POST"))  # returns normally: own cancellation absorbed
    # aiosqlite's thread may still run a statement whose await was cancelled: let it land.
    await anyio.sleep(0.05)
    # A connection aiosqlite abandoned mid-connect is collected here, inside this test (whose
    # marks ignore its warning), not in whichever later test the garbage collector runs in.
    gc.collect()
    return stored(path), injector


def injections(driver: str, points: int) -> list[tuple[int | None, int | None]]:
    cases: list[tuple[int | None, int | None]] = [(at, None) for at in range(points)]
    if driver == "sqlite3-thread":
        cases += [(None, thread) for thread in range(len(STATEMENTS))]
    return cases


# aiosqlite is asyncio only.
LOOPS_AND_DRIVERS = [
    ("asyncio", "sqlite3-thread"),
    ("asyncio", "aiosqlite"),
    ("trio", "sqlite3-thread"),
]


@pytest.mark.parametrize(("anyio_backend", "driver"), LOOPS_AND_DRIVERS)
@pytest.mark.parametrize("shielded", [True, False], ids=["shielded", "unshielded"])
async def test_record_is_whole_or_absent_wherever_the_client_leaves_only_if_shielded(
    tmp_path: Path, driver: str, anyio_backend: str, shielded: bool
) -> None:
    outcome, first = await place_order(tmp_path, driver, shielded=True, at=None, in_thread=None)
    assert outcome == WHOLE
    assert first.points == len(STATEMENTS) + 2
    seen = []
    for at, in_thread in injections(driver, first.points):
        outcome, _ = await place_order(
            tmp_path, driver, shielded=shielded, at=at, in_thread=in_thread
        )
        seen.append((at, in_thread, outcome))
    outcomes = [outcome for _, _, outcome in seen]
    if shielded:  # once inside the shield, always the whole order
        assert outcomes[0] in (NOTHING, WHOLE)
        assert outcomes[1:] == [WHOLE] * (len(outcomes) - 1), seen
    else:
        assert any(outcome not in (NOTHING, WHOLE) for outcome in outcomes), seen


async def test_back_to_back_thread_calls_stop_when_the_first_returns() -> None:
    """A loop of thread calls (a sync ORM per statement): the cancellation lands after one."""
    done: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        for index in range(4):
            await anyio.to_thread.run_sync(time.sleep, 0.05)
            done.append(index)
        await anyio.lowlevel.checkpoint()

    conn = ClientConnection(b"x")
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, CancelOnDisconnectMiddleware(app), http_scope("POST"))
            await anyio.sleep(0.02)
            conn.disconnect()  # during the first thread
    assert done == [0]  # the second call is cancelled before its thread starts
