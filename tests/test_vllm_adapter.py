"""`asgi_cancel.vllm` against a fake engine: fast checks of the adapter's contract, and of what
a cancelled request cost in tokens (`counted`, `TokenUsage`: the hook's `usage`, the log line,
`CancelMetrics`; tests/vllm/test_asyncllm.py checks the same against real vLLM).

The fake engine, unlike vLLM, does NOT abort a request when the task iterating it is
cancelled: whatever aborts it here is the adapter. The real-vLLM proof is in tests/vllm/;
vLLM's own `with_cancellation` shape is in tests/test_asyncio.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from asgi_cancel import CancelOnDisconnectMiddleware, TokenUsage, turn
from asgi_cancel.prometheus import CancelMetrics
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, CancelledRequest, Receive, Scope, Send
from asgi_cancel.vllm import EngineClient, abort_on_cancel, generate

from .helpers import WATCHDOG, leave, read_body, respond, until, watching, with_watchdog

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only(reason="vLLM's engine is asyncio")]
PROMPT = [1, 2, 3, 4, 5]


@dataclass
class Choice:
    token_ids: list[int]


@dataclass
class FakeOutput:
    """What the adapter reads of vLLM's `RequestOutput`, and what the tests check."""

    request_id: str
    num_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    outputs: list[Choice] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=lambda: list(PROMPT))


@dataclass
class Params:
    n: int = 1
    output_kind: Any = None  # `Kind("DELTA")`: each output carries its new tokens only


@dataclass
class Kind:
    name: str


@dataclass
class FakeEngine:
    """Yields one output per `step` seconds (`n` choices, cumulative or DELTA); `abort` ends a
    running request like vLLM does, `steps_after_abort` steps later (the step in flight, and one
    more before a real engine sees the abort), with a final `finish_reason="abort"` output."""

    step: float = 0.002
    max_tokens: int = 2000
    admit_delay: float = 0.0
    abort_delay: float = 0.0
    steps_after_abort: int = 0
    running: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)
    abort_calls: list[list[str]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    generated: int = 0

    async def generate(
        self, prompt: object, sampling_params: Params | None, request_id: str, /
    ) -> AsyncIterator[FakeOutput]:
        params = sampling_params or Params()
        delta = params.output_kind is not None and params.output_kind.name == "DELTA"
        if self.admit_delay:
            await asyncio.sleep(self.admit_delay)  # tokenizing: not in the engine yet
        self.running.add(request_id)
        tokens: list[list[int]] = [[] for _ in range(params.n)]
        left: int | None = None
        try:
            for count in range(1, self.max_tokens + 1):
                await asyncio.sleep(self.step)
                if request_id in self.aborted:
                    left = self.steps_after_abort if left is None else left - 1
                    if left <= 0:
                        yield FakeOutput(request_id, len(tokens[0]), True, "abort")
                        return
                for choice in tokens:
                    choice.append(count)
                self.generated += params.n
                done = count == self.max_tokens
                choices = [Choice(choice[-1:] if delta else list(choice)) for choice in tokens]
                yield FakeOutput(request_id, count, done, "length" if done else None, choices)
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
    assert [m["type"] for m in conn.sent] == ["http.response.start", "http.response.body"]


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


# -- what a cancelled request cost ------------------------------------------------------------
STEP = 0.01
STEPS_AFTER_ABORT = 2


async def cancelled_generation(
    params: Params, caplog: pytest.LogCaptureFixture, **options: Any
) -> FakeEngine:
    """The client leaves after 10 tokens; returns the engine."""
    engine = FakeEngine(step=STEP, steps_after_abort=STEPS_AFTER_ABORT)
    conn = ClientConnection()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async for _ in generate(_typed(engine), "prompt", params, "gen-1"):
            await send({"type": "http.response.body", "body": b"t", "more_body": True})

    with caplog.at_level(logging.INFO, logger="asgi_cancel"), anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, CancelOnDisconnectMiddleware(app, **options), http_scope())
            await conn.wait_for_body_chunks(10)
            conn.disconnect()
        await anyio.sleep(STEP * (STEPS_AFTER_ABORT + 2))  # the engine's last steps
    return engine


@pytest.mark.parametrize("kind", [None, Kind("DELTA")], ids=["cumulative", "delta"])
@pytest.mark.parametrize("n", [1, 2])
async def test_a_cancelled_generation_reports_what_it_cost(
    caplog: pytest.LogCaptureFixture, kind: Any, n: int
) -> None:
    """To the hook, on the log line, and in `CancelMetrics` (called as the hook)."""
    seen: list[TokenUsage] = []
    final: list[tuple[int, int, int]] = []
    registry = CollectorRegistry()
    metrics = CancelMetrics(registry=registry, namespace="t")

    def hook(request: CancelledRequest) -> Callable[[], None]:
        usage = request.usage
        seen.append(usage)
        count = metrics(request)

        def when_over() -> None:
            count()
            final.append((usage.prompt_tokens, usage.completion_tokens, usage.after_cancel))

        return when_over

    engine = await cancelled_generation(Params(n=n, output_kind=kind), caplog, on_cancelled=hook)
    assert len(seen) == 1
    prompt, completion, after = final[0]
    assert prompt == len(PROMPT)
    # Every token the engine generated while the app still iterated, all choices counted.
    assert 10 * n <= completion <= engine.generated
    assert 0 <= after <= n * (STEPS_AFTER_ABORT + 1)  # at most the step in flight and one more
    lines = [r for r in caplog.records if "prompt and" in r.getMessage()]
    assert len(lines) == 1
    fields = getattr(lines[0], "asgi_cancel")  # noqa: B009
    assert (fields["prompt_tokens"], fields["completion_tokens"]) == (prompt, completion)
    assert fields["completion_tokens_after_cancel"] == after
    labels = {"method": "GET", "route": "unmatched", "reason": "client disconnected"}
    labels["phase"] = "mid_stream"
    for part, count in (("prompt", prompt), ("completion", completion), ("after_cancel", after)):
        value = registry.get_sample_value("t_cancelled_tokens_total", {**labels, "kind": part})
        assert value == count, part


@pytest.mark.parametrize(
    ("returned", "logged"), [(None, False), (42, True)], ids=["none", "not-callable"]
)
async def test_a_hook_returning_neither_none_nor_a_callable_is_logged_as_an_error(
    caplog: pytest.LogCaptureFixture, returned: Any, logged: bool
) -> None:
    calls: list[str] = []

    def hook(request: CancelledRequest) -> Any:
        calls.append(request.reason)
        return returned

    await cancelled_generation(Params(), caplog, on_cancelled=hook)
    assert calls == ["client disconnected"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == (["on_cancelled returned 42: return None, or a callable to call when the "
                       "request is over"] if logged else [])  # fmt: skip
