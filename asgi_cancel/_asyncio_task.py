"""What an asyncio app task is doing when its request is to be cancelled: waiting for a worker
thread, inside an anyio shield, or already cancelling its own work. Read only after a
disconnect, from the task's await chain and the modules the app already imported.

This module reads private internals of asyncio, anyio and asgiref (each named where it is
read); tests/test_asyncio_task.py checks every one of them on the supported versions, and a
missing one is logged once as a WARNING here: without it, the request could be unwound around
a running worker thread, the bug these checks exist to prevent.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from ._token import request_in

logger = logging.getLogger("asgi_cancel")
_warned: set[str] = set()


def _missing(internal: str) -> None:
    if internal not in _warned:
        _warned.add(internal)
        logger.warning(
            "%s is not where this version expects it; requests waiting for a "
            "worker thread may be cancelled around it (please report the versions in use)",
            internal,
        )


_HAS_UNCANCEL = sys.version_info >= (3, 11)


def thread_future(task: asyncio.Task[Any], app_awaitable: Any) -> Any:
    """The future `task` waits on while a worker thread runs for it, or None.

    Recognised: futures chained to a `concurrent.futures.Future` (`loop.run_in_executor`,
    `asyncio.to_thread`, Litestar's `sync_to_thread`), anyio's worker threads (Starlette's
    `run_in_threadpool`, FastAPI `def` endpoints and dependencies, `anyio.to_thread`) and
    asgiref's `sync_to_async`. A call still queued for a thread, or at its first checkpoint,
    is not running in one. Runs only after a disconnect.
    """
    # `_fut_waiter` is the future a task is suspended on, in both Task implementations
    # since Python 3.4 (anyio's cancel scopes read it too).
    waiter = getattr(task, "_fut_waiter", None)
    if waiter is None or waiter.done():
        return None
    for callback, *_ in getattr(waiter, "_callbacks", None) or ():
        if getattr(callback, "__qualname__", "") == "_chain_future.<locals>._call_check_cancel":
            return waiter
    anyio_code, asgiref_code = _dispatch_codes()
    # From the app's own coroutine: the driver takes its first step by hand, so the chain from
    # the task's coroutine passes through a generator that does not expose it until resumed.
    awaitable: Any = app_awaitable if app_awaitable is not None else task.get_coro()
    while awaitable is not None:
        code = getattr(awaitable, "cr_code", None)
        if code is not None and code is anyio_code:
            local = awaitable.cr_frame.f_locals
            if "future" not in local and "scope" in local:
                _missing("the future in anyio's run_sync_in_worker_thread")
            if local.get("future") is waiter:
                return waiter, local.get("scope")
            return None
        if code is not None and code is asgiref_code:
            local = awaitable.cr_frame.f_locals
            if "exec_coro" not in local and "loop" in local:
                _missing("the exec_coro in asgiref's SyncToAsync.__call__")
            running = local.get("exec_coro")
            return waiter if running is not None and not running.done() else None
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return None


def woken(task: asyncio.Task[Any]) -> bool:
    """Whether `task` is due to take a step (what it waited on is done, or it waits on nothing)
    rather than suspended on a pending future."""
    waiter = getattr(task, "_fut_waiter", None)
    return waiter is None or waiter.done()


def in_anyio_shield(task: asyncio.Task[Any]) -> bool:
    """Whether `task` runs in an anyio shielded scope.

    A native Task.cancel() goes through anyio's shields (FastAPI closes `yield` dependencies
    in one): they are respected as anyio's own cancellation would.
    """
    anyio_asyncio = sys.modules.get("anyio._backends._asyncio")
    if anyio_asyncio is None:
        return False
    try:
        state = anyio_asyncio._task_states.get(task)
        scope = state.cancel_scope if state is not None else None
        while scope is not None:
            if scope._shield:
                return True
            scope = scope._parent_scope
    except (AttributeError, TypeError):  # another anyio version: threads are still covered
        _missing("anyio's _task_states / CancelScope._shield")
    return False


def _dispatch_codes() -> tuple[object, object]:
    # Only modules the app already imported: a disconnect never imports anything.
    anyio_code = asgiref_code = None
    anyio_asyncio = sys.modules.get("anyio._backends._asyncio")
    if anyio_asyncio is not None:
        backend = getattr(anyio_asyncio, "AsyncIOBackend", None)
        method = getattr(backend, "run_sync_in_worker_thread", None)
        anyio_code = getattr(getattr(method, "__func__", method), "__code__", None)
        if anyio_code is None:
            _missing("anyio's AsyncIOBackend.run_sync_in_worker_thread")
    asgiref_sync = sys.modules.get("asgiref.sync")
    if asgiref_sync is not None:
        call = vars(getattr(asgiref_sync, "SyncToAsync", object)).get("__call__")
        asgiref_code = getattr(call, "__code__", None)
        if asgiref_code is None:
            _missing("asgiref's SyncToAsync.__call__")
    return anyio_code, asgiref_code


def reacting(task: asyncio.Task[Any], request: object) -> bool:
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
            if other.cancelling() and request_in(other.get_context()) is request:
                return True
    return False
