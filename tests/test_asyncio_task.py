"""The private internals `_asyncio_task.py` reads, each checked where it is read.

asyncio, anyio and asgiref give no public way to ask "is this task waiting for a worker
thread, or inside a shielded scope?". The middleware reads their internals instead; if one
moves in a new release, the request would unwind around a running thread. Every test here
fails loudly, naming the internal, on a version where it moved (CI runs this module on the
oldest and newest supported versions).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
import pytest
from asgiref.sync import sync_to_async

from asgi_cancel import _asyncio_task
from asgi_cancel._asyncio_task import in_anyio_shield, reacting, thread_future, woken

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


async def while_running(
    body: Callable[[threading.Event], Awaitable[object]], check: Callable[[asyncio.Task[Any]], Any]
) -> Any:
    """Run `body` in a task; once its worker thread (or shield) is entered, `check(task)`."""
    entered = threading.Event()

    async def run() -> None:
        await body(entered)

    task = asyncio.get_running_loop().create_task(run())
    try:
        await asyncio.wait_for(asyncio.to_thread(entered.wait), 5)
        await asyncio.sleep(0.01)  # the task is now suspended on its wait
        return check(task)
    finally:
        await asyncio.wait_for(task, 5)


def blocking(entered: threading.Event) -> None:
    entered.set()
    time.sleep(0.1)


def awaiting(task: asyncio.Task[Any], code: Any, name: str) -> Any:
    """The coroutine running `code` in the chain `task` awaits (AssertionError naming it)."""
    awaitable: Any = task.get_coro()
    while awaitable is not None and getattr(awaitable, "cr_code", None) is not code:
        awaitable = getattr(awaitable, "cr_await", None)
    assert awaitable is not None, f"{name} is not in the chain"
    return awaitable


async def test_a_task_is_woken_once_what_it_waits_on_is_done(anyio_backend: str) -> None:
    # woken() reads `_fut_waiter` (asyncio.Task's; missing, the task would count as woken):
    # the watcher whose wait is over ends by itself, uncancelled.
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    task = loop.create_task(asyncio.wait_for(future, None))
    assert woken(task)  # created: its first step is due
    await asyncio.sleep(0)
    assert not woken(task), "Task._fut_waiter: not the pending future the task waits on"
    future.set_result(None)
    assert woken(task)  # its wake-up is due, not yet run
    await task
    assert woken(task)


async def test_run_in_executor_is_seen_through_chain_futures_callback(anyio_backend: str) -> None:
    async def body(entered: threading.Event) -> None:
        await asyncio.get_running_loop().run_in_executor(None, blocking, entered)

    def check(task: asyncio.Task[Any]) -> Any:
        waiter = task._fut_waiter  # type: ignore[attr-defined]
        names = [getattr(callback, "__qualname__", "") for callback, *_ in waiter._callbacks]
        assert "_chain_future.<locals>._call_check_cancel" in names, (
            f"asyncio.futures._chain_future's callback renamed: {names}"
        )
        return thread_future(task, None)

    assert await while_running(body, check) is not None


async def test_anyio_worker_threads_are_seen_in_run_sync_in_worker_thread(
    anyio_backend: str,
) -> None:
    async def body(entered: threading.Event) -> None:
        await anyio.to_thread.run_sync(blocking, entered)

    def check(task: asyncio.Task[Any]) -> Any:
        from anyio._backends._asyncio import AsyncIOBackend

        code = AsyncIOBackend.run_sync_in_worker_thread.__func__.__code__  # type: ignore[attr-defined]
        local = awaiting(task, code, "anyio's run_sync_in_worker_thread").cr_frame.f_locals
        assert {"future", "scope"} <= set(local), f"anyio's worker-thread locals: {set(local)}"
        return thread_future(task, None)

    assert await while_running(body, check) is not None


async def test_asgiref_sync_to_async_is_seen_through_its_exec_coro(anyio_backend: str) -> None:
    async def body(entered: threading.Event) -> None:
        await sync_to_async(blocking, thread_sensitive=False)(entered)

    def check(task: asyncio.Task[Any]) -> Any:
        from asgiref.sync import SyncToAsync

        code = vars(SyncToAsync)["__call__"].__code__
        local = awaiting(task, code, "asgiref's SyncToAsync.__call__").cr_frame.f_locals
        assert "exec_coro" in local, "asgiref's exec_coro renamed"
        return thread_future(task, None)

    assert await while_running(body, check) is not None


async def test_a_plain_wait_is_not_taken_for_a_thread(anyio_backend: str) -> None:
    async def body(entered: threading.Event) -> None:
        entered.set()
        await asyncio.sleep(0.1)

    assert await while_running(body, lambda task: thread_future(task, None)) is None


async def test_anyio_shields_are_read_from_its_task_states(anyio_backend: str) -> None:
    async def body(entered: threading.Event) -> None:
        with anyio.CancelScope(shield=True):
            entered.set()
            await anyio.sleep(0.1)

    def check(task: asyncio.Task[Any]) -> bool:
        from anyio._backends import _asyncio as backend

        state = backend._task_states.get(task)
        assert state is not None, "anyio's _task_states moved"
        assert state.cancel_scope is not None
        assert state.cancel_scope._shield is True, "anyio's CancelScope._shield moved"
        assert hasattr(state.cancel_scope, "_parent_scope"), "anyio's _parent_scope moved"
        return in_anyio_shield(task)

    assert await while_running(body, check) is True


async def test_a_task_cancelling_its_own_work_is_seen_reacting(anyio_backend: str) -> None:
    """Python 3.11+: `Task.cancelling()` (the self-cancelling apps' case)."""
    if not hasattr(asyncio.Task, "cancelling"):
        pytest.skip("Python 3.10 has no Task.cancelling(): nothing counts as a reaction")

    class Source:
        token = None

    async def cleanup_after_own_cancel() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)  # the app's own cleanup
            raise

    task = asyncio.get_running_loop().create_task(cleanup_after_own_cancel())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.01)
    assert reacting(task, Source()) is True
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    "moved",
    [
        "anyio's _task_states / CancelScope._shield",
        "anyio's AsyncIOBackend.run_sync_in_worker_thread",
        "asgiref's SyncToAsync.__call__",
    ],
)
async def test_an_internal_that_moved_is_logged_once_naming_it(
    anyio_backend: str,
    moved: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a release where one moved, the check answers "no" (as before the fix it is for) and
    says so once, at WARNING, naming the internal."""
    from anyio._backends import _asyncio as backend
    from asgiref.sync import SyncToAsync

    monkeypatch.setattr(_asyncio_task, "_warned", set())
    if moved.endswith("._shield"):
        monkeypatch.setattr(backend, "_task_states", None)
    elif moved.startswith("anyio"):
        monkeypatch.setattr(backend, "AsyncIOBackend", object)
    else:
        monkeypatch.delattr(SyncToAsync, "__call__")
    future = asyncio.get_running_loop().create_future()
    task = asyncio.get_running_loop().create_task(asyncio.wait_for(future, 5))
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        for _ in range(3):
            assert not in_anyio_shield(task)
            assert thread_future(task, None) is None
    future.set_result(None)
    await task
    (message,) = [record.getMessage() for record in caplog.records if record.name == "asgi_cancel"]
    assert message.startswith(f"{moved} is not where this version expects it")
