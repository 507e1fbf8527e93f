"""What an asyncio app task is doing when its request is to be cancelled: waiting for a worker
thread, inside an anyio shield, or already cancelling its own work. Read only after a
disconnect, from the task's await chain and the modules the app already imported."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from ._token import token_in

_HAS_UNCANCEL = sys.version_info >= (3, 11)
_to_thread_code = asyncio.to_thread.__code__


def protected(task: asyncio.Task[Any], app_awaitable: Any) -> bool:
    """Whether `task` waits for a worker thread or runs in an anyio shielded scope.

    Recognised threads: futures chained to a `concurrent.futures.Future`
    (`loop.run_in_executor`, `asyncio.to_thread`, Litestar's `sync_to_thread`) and the await
    chains of anyio's worker threads (Starlette's `run_in_threadpool`, FastAPI `def`
    endpoints and dependencies, `anyio.to_thread.run_sync`) and of asgiref's
    `sync_to_async`, from the call to the thread's return. Runs only after a disconnect.
    """
    # `_fut_waiter` is the future a task is suspended on, in both Task implementations
    # since Python 3.4 (anyio's cancel scopes read it too).
    waiter = getattr(task, "_fut_waiter", None)
    for callback, *_ in getattr(waiter, "_callbacks", None) or ():
        if getattr(callback, "__qualname__", "") == "_chain_future.<locals>._call_check_cancel":
            return True
    codes = _thread_codes()
    # From the app's own coroutine: the driver takes its first step by hand, so the chain from
    # the task's coroutine passes through a generator that does not expose it until resumed.
    awaitable: Any = app_awaitable if app_awaitable is not None else task.get_coro()
    while awaitable is not None:
        code = getattr(awaitable, "cr_code", None) or getattr(awaitable, "gi_code", None)
        if code is not None and code in codes:
            return True
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return _in_anyio_shield(task)


def _in_anyio_shield(task: asyncio.Task[Any]) -> bool:
    # A native Task.cancel() goes through anyio's shields (FastAPI closes `yield`
    # dependencies in one): respect them as anyio's own cancellation would.
    anyio_asyncio = sys.modules.get("anyio._backends._asyncio")
    try:
        state = anyio_asyncio._task_states.get(task)  # type: ignore[union-attr]
        scope = state.cancel_scope if state is not None else None
        while scope is not None:
            if scope._shield:
                return True
            scope = scope._parent_scope
    except (AttributeError, TypeError):  # another anyio version: threads are still covered
        return False
    return False


def _thread_codes() -> set[object]:
    # Only modules the app already imported: a disconnect never imports anything.
    codes: set[object] = {_to_thread_code}
    anyio_asyncio = sys.modules.get("anyio._backends._asyncio")
    if anyio_asyncio is not None:
        backend = getattr(anyio_asyncio, "AsyncIOBackend", None)
        method = getattr(backend, "run_sync_in_worker_thread", None)
        codes.add(getattr(getattr(method, "__func__", method), "__code__", None))
    asgiref_sync = sys.modules.get("asgiref.sync")
    if asgiref_sync is not None:
        call = vars(getattr(asgiref_sync, "SyncToAsync", object)).get("__call__")
        codes.add(getattr(call, "__code__", None))
    codes.discard(None)
    return codes


def reacting(task: asyncio.Task[Any], token: object) -> bool:
    """Whether the app is cancelling its own work: the app task, or a task it awaits.

    Django awaits the handler task it cancelled, Quart gathers them, anyio task groups
    (Starlette's stream listener, sse-starlette) cancel the app task itself. Python 3.10 has
    no `Task.cancelling()`: there, nothing counts as a reaction.
    """
    if not _HAS_UNCANCEL:
        return False  # pragma: no cover (3.10)
    seen: list[object] = []
    pending: list[Any] = [task]
    while pending:
        current = pending.pop()
        if current is None or any(current is item for item in seen) or len(seen) > 64:
            continue
        seen.append(current)
        if isinstance(current, asyncio.Task):
            if current.cancelling():  # type: ignore[attr-defined,unused-ignore]
                return True
            pending.append(getattr(current, "_fut_waiter", None))
        else:
            # asyncio.gather's future holds its children.
            pending.extend(getattr(current, "_children", ()))
    if sys.version_info >= (3, 12):
        # Tasks the app started and does not await directly (a task group's children).
        for other in asyncio.all_tasks(task.get_loop()):
            if other.cancelling() and token_in(other.get_context()) is token:
                return True
    return False
