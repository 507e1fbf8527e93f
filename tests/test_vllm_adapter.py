"""`asgi_cancel.vllm` against a fake engine: fast checks of the adapter's contract.

The fake engine, unlike vLLM, does NOT abort a request when the task iterating it is
cancelled: whatever aborts it here is the adapter. The real-vLLM proof is in tests/vllm/;
vLLM's own `with_cancellation` shape is in tests/test_asyncio.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, turn
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send
from asgi_cancel.vllm import EngineClient, abort_on_cancel, generate

from .helpers import WATCHDOG, leave, read_body, respond, until, watching, with_watchdog

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only(reason="vLLM's engine is asyncio")]


@dataclass
class FakeOutput:
    request_id: str
    num_tokens: int
    finished: bool = False
    finish_reason: str | None = None


class FakeEngine:
    """Yields one output per `step` seconds; `abort` ends a running request like vLLM does."""

    def __init__(
        self,
        *,
        step: float = 0.002,
        max_tokens: int = 2000,
        admit_delay: float = 0.0,
        abort_delay: float = 0.0,
    ) -> None:
        self.step = step
        self.max_tokens = max_tokens
        self.admit_delay = admit_delay
        self.abort_delay = abort_delay
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.abort_calls: list[list[str]] = []
        self.events: list[str] = []

    async def generate(
        self, prompt: object, sampling_params: object, request_id: str, /
    ) -> AsyncIterator[FakeOutput]:
        if self.admit_delay:
            await asyncio.sleep(self.admit_delay)  # tokenizing: not in the engine yet
        self.running.add(request_id)
        try:
            for count in range(1, self.max_tokens + 1):
                await asyncio.sleep(self.step)
                if request_id in self.aborted:
                    yield FakeOutput(request_id, count - 1, True, "abort")
                    return
                done = count == self.max_tokens
                yield FakeOutput(request_id, count, done, "length" if done else None)
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: Iterable[str], /) -> None:
        ids = list(request_id)
        self.events.append("abort " + ",".join(ids))
        self.abort_calls.append(ids)
        if self.abort_delay:
            await asyncio.sleep(self.abort_delay)
        self.aborted.update(ids_ for ids_ in ids if ids_ in self.running)
        self.events.append("abort done")


def _typed(engine: FakeEngine) -> EngineClient[FakeOutput]:
    return engine  # the fake satisfies the Protocol (checked by mypy)


async def serve(
    app: ASGIApp, *, leave_when: Callable[[ClientConnection], bool] | None = None
) -> ClientConnection:
    """Run `app` for a POST whose client leaves once `leave_when(conn)` holds (None: stays)."""
    middleware = CancelOnDisconnectMiddleware(app)
    conn = ClientConnection(b"{}")
    scope = http_scope("POST", "/generate")
    if leave_when is None:
        await with_watchdog(conn.run(middleware, scope))
    else:
        await leave(middleware, conn, scope, when=lambda: leave_when(conn))
    assert conn.app_exception is None
    return conn


@pytest.mark.parametrize(
    ("abort_delay", "ids"),
    [(0.0, ("req-1",)), (0.05, ("req-1",)), (0.0, ("multi-0", "multi-1", "multi-2"))],
    ids=["fast-abort", "slow-abort", "several-prompts"],
)
async def test_abort_fires_at_the_disconnect_and_completes_before_the_request_ends(
    abort_delay: float, ids: tuple[str, ...]
) -> None:
    """The abort starts from the disconnect itself, before the app is cancelled, one call for
    every id (several prompts of one HTTP request, merged); a slow one still completes (the
    app task is cancelled meanwhile) before the middleware returns."""
    engine = FakeEngine(abort_delay=abort_delay)
    started = asyncio.Event()

    async def consume(request_id: str) -> None:
        async for _ in engine.generate("hi", None, request_id):
            started.set()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        async with abort_on_cancel(_typed(engine), *ids):
            try:
                await asyncio.gather(*(consume(request_id) for request_id in ids))
            except asyncio.CancelledError:
                engine.events.append("app cancelled")
                raise

    conn = await serve(app, leave_when=lambda conn: started.is_set())
    engine.events.append("request ended")
    assert engine.abort_calls == [list(ids)]
    assert engine.running == set()
    abort, done = "abort " + ",".join(ids), "abort done"
    if abort_delay:
        assert engine.events == [abort, "app cancelled", done, "request ended"]
    else:
        assert engine.events == [abort, done, "app cancelled", "request ended"]
        assert engine.aborted == set(ids)  # they were still running when the abort came
    assert conn.sent == []  # the client is gone


@pytest.mark.parametrize("use_helper", [False, True], ids=["context-manager", "generate-helper"])
async def test_completed_request_is_never_aborted(use_helper: bool) -> None:
    engine = FakeEngine(max_tokens=5)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        outputs: list[FakeOutput] = []
        if use_helper:
            outputs = [output async for output in generate(_typed(engine), "hi", None, "done-1")]
        else:
            async with abort_on_cancel(_typed(engine), "done-1"):
                outputs = [output async for output in engine.generate("hi", None, "done-1")]
        assert outputs[-1].finish_reason == "length"
        await respond(send, b"%d" % outputs[-1].num_tokens)

    conn = await serve(app)  # the disconnect after the response is not a cancellation
    await asyncio.sleep(0.01)
    assert engine.abort_calls == []
    assert [message["type"] for message in conn.sent] == [
        "http.response.start",
        "http.response.body",
    ]


async def test_outside_a_request_it_is_a_pass_through() -> None:
    engine = FakeEngine(max_tokens=3)
    async with abort_on_cancel(_typed(engine), "plain") as token:
        assert token is None
        outputs = [output async for output in engine.generate("hi", None, "plain")]
    assert [output.num_tokens for output in outputs] == [1, 2, 3]
    helper_outputs = [output async for output in generate(_typed(engine), "hi", None, "plain")]
    assert [output.num_tokens for output in helper_outputs] == [1, 2, 3]
    assert engine.abort_calls == []
    with pytest.raises(TypeError, match="request ids must be str"):
        async with abort_on_cancel(_typed(engine), ["a", "b"]):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize(
    ("adapter", "admit_delay", "abort_delay", "leave_after", "aborts"),
    [
        (False, 0.0, 0.0, 1, 0),
        (True, 0.0, 0.0, 1, 1),
        (True, 0.05, 0.0, 0, 2),
        (True, 0.0, 0.05, 3, 1),
    ],
    ids=["no-adapter", "adapter", "reaching-the-engine-late", "outputs-in-flight-during-the-abort"],
)
async def test_generation_in_a_background_task_is_aborted_once(
    adapter: bool, admit_delay: float, abort_delay: float, leave_after: int, aborts: int
) -> None:
    """A background producer that nothing cancels: only the adapter stops its request. A
    disconnect while the prompt is still being tokenized: the first abort finds nothing, and
    the request is aborted at its first output. Outputs that keep coming until the abort has
    run are no reason for a second abort."""
    engine = FakeEngine(admit_delay=admit_delay, abort_delay=abort_delay)
    outputs: list[FakeOutput] = []
    producers: list[asyncio.Task[None]] = []

    async def produce() -> None:
        if adapter:
            generation = generate(_typed(engine), "hi", None, "bg")
        else:
            generation = engine.generate("hi", None, "bg")
        async for output in generation:
            outputs.append(output)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        producers.append(asyncio.create_task(produce()))  # not cancelled with the app
        await asyncio.sleep(30)

    await serve(app, leave_when=lambda conn: bool(producers) and len(outputs) >= leave_after)
    try:
        if not adapter:
            await asyncio.sleep(0.05)
            assert engine.abort_calls == []
            assert engine.running == {"bg"}  # orphaned: still generating for nobody
            return
        await asyncio.wait_for(producers[0], WATCHDOG)
        assert engine.abort_calls == [["bg"]] * aborts
        assert outputs[-1].finish_reason == "abort"
        assert len(outputs) <= (3 if admit_delay else 2000)
        assert engine.running == set()
    finally:
        producers[0].cancel()
        await asyncio.wait(producers)


@pytest.mark.parametrize("use_helper", [False, True], ids=["context-manager", "generate-helper"])
async def test_generation_started_after_the_disconnect_is_aborted(use_helper: bool) -> None:
    """An app listening itself gets the disconnect first and `grace` seconds before it is
    cancelled; a generation it starts in between is aborted: the block on its exit, the helper
    at its first output."""
    engine = FakeEngine()
    outputs: list[FakeOutput] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        message = await receive()  # listening, as vLLM's with_cancellation does
        assert message["type"] == "http.disconnect"
        if use_helper:
            async for output in generate(_typed(engine), "hi", None, "late-entry"):
                outputs.append(output)
            return
        async with abort_on_cancel(_typed(engine), "late-entry") as token:
            assert token is not None
            assert token.cancelled
            assert engine.abort_calls == []  # nothing to abort yet
            async for output in engine.generate("hi", None, "late-entry"):
                outputs.append(output)

    await serve(app, leave_when=watching)
    assert engine.abort_calls == [["late-entry"]]
    if use_helper:
        assert [output.finish_reason for output in outputs] == [None, "abort"]
    else:
        assert outputs  # it ran during the grace period
        assert engine.events[-1] == "abort done"


async def test_a_turn_aborts_its_own_engine_request_and_leaves_the_sessions() -> None:
    """Inside `turn()` the adapter follows the turn's token: cancelling the turn aborts the
    turn's engine request only; the session's own request runs on."""
    engine = FakeEngine()
    turns: list[turn] = []
    outcome: dict[str, int] = {}

    async def generate_for_the_session() -> None:
        async with abort_on_cancel(_typed(engine), "session-req"):
            async for output in engine.generate("hi", None, "session-req"):
                outcome["session"] = output.num_tokens
                if output.num_tokens == 50:
                    return

    async def generate_in_a_turn() -> None:
        current = turn()
        turns.append(current)
        with current:
            async with abort_on_cancel(_typed(engine), "turn-req"):
                async for output in engine.generate("hi", None, "turn-req"):
                    outcome["turn"] = output.num_tokens

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        task = asyncio.ensure_future(generate_in_a_turn())
        await until(lambda: outcome.get("turn", 0) >= 5)
        turns[0].cancel("response.cancel")
        await generate_for_the_session()
        await task
        await respond(send)

    conn = await serve(app)
    assert engine.abort_calls == [["turn-req"]]
    assert outcome["session"] == 50
    assert outcome["turn"] < 20  # aborted a few steps after the cancel, not run to 2000
    assert conn.status == 200
