"""`asgi_cancel.vllm` against a fake engine: fast checks of the adapter's contract.

The fake engine, unlike vLLM, does NOT abort a request when the task iterating it is
cancelled: whatever aborts it here is the adapter. The real-vLLM proof is in tests/vllm/.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import pytest

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.types import ASGIApp, Message, Receive, Scope, Send
from asgi_cancel.vllm import EngineClient, abort_on_cancel, generate

pytestmark = pytest.mark.anyio

WATCHDOG = 5.0


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


class Client:
    """An HTTP/1.1 connection as a uvicorn-like server presents it to the app."""

    def __init__(self, body: bytes = b"{}") -> None:
        self.body = body
        self.gone = asyncio.Event()
        self.response_done = asyncio.Event()
        self.sent: list[Message] = []
        self.body_sent = False

    async def receive(self) -> Message:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        gone = asyncio.create_task(self.gone.wait())
        done = asyncio.create_task(self.response_done.wait())
        try:
            await asyncio.wait((gone, done), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            done.cancel()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.response_done.set()

    async def run(self, app: ASGIApp) -> None:
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/generate",
            "raw_path": b"/generate",
            "query_string": b"",
            "headers": [],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        await CancelOnDisconnectMiddleware(app)(scope, self.receive, self.send)


async def read_body(receive: Receive) -> None:
    while True:
        message = await receive()
        if not message.get("more_body", False):
            return


async def respond(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def until(predicate: Callable[[], bool], timeout: float = WATCHDOG) -> None:
    async def poll() -> None:
        while not predicate():  # noqa: ASYNC110 (a condition on foreign state, polled)
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout)


async def test_abort_fires_at_the_disconnect_before_the_app_is_cancelled() -> None:
    engine = FakeEngine()
    started = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        async with abort_on_cancel(_typed(engine), "req-1"):
            try:
                async for _ in engine.generate("hi", None, "req-1"):
                    started.set()
            except asyncio.CancelledError:
                engine.events.append("app cancelled")
                raise

    client = Client()
    task = asyncio.create_task(client.run(app))
    await asyncio.wait_for(started.wait(), WATCHDOG)
    client.gone.set()
    await asyncio.wait_for(task, WATCHDOG)
    assert engine.abort_calls == [["req-1"]]
    assert engine.events == ["abort req-1", "abort done", "app cancelled"]
    assert engine.aborted == {"req-1"}  # it was still running when the abort reached it
    # The client is gone: nothing but the 499 that completes the request for outer middleware.
    assert [message.get("status") for message in client.sent] == [499, None]


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

    client = Client()
    await asyncio.wait_for(client.run(app), WATCHDOG)
    client.gone.set()  # a disconnect after the response is not a cancellation
    await asyncio.sleep(0.01)
    assert engine.abort_calls == []
    assert [message["type"] for message in client.sent] == [
        "http.response.start",
        "http.response.body",
    ]


async def test_request_ids_are_aborted_in_one_call() -> None:
    """Several prompts of one HTTP request, merged: one abort with every id."""
    engine = FakeEngine()
    started = asyncio.Event()
    ids = ("multi-0", "multi-1", "multi-2")

    async def consume(request_id: str) -> None:
        async for _ in engine.generate("hi", None, request_id):
            started.set()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        async with abort_on_cancel(_typed(engine), *ids):
            await asyncio.gather(*(consume(request_id) for request_id in ids))

    client = Client()
    task = asyncio.create_task(client.run(app))
    await asyncio.wait_for(started.wait(), WATCHDOG)
    client.gone.set()
    await asyncio.wait_for(task, WATCHDOG)
    assert engine.abort_calls == [list(ids)]
    assert engine.running == set()


@pytest.mark.parametrize("adapter", [True, False], ids=["adapter", "no-adapter"])
async def test_generator_iterated_in_another_task(adapter: bool) -> None:
    """A background producer that nothing cancels: only the adapter stops its request."""
    engine = FakeEngine()
    queue: asyncio.Queue[FakeOutput] = asyncio.Queue()
    producers: list[asyncio.Task[None]] = []

    async def produce() -> None:
        if adapter:
            async for output in generate(_typed(engine), "hi", None, "bg-1"):
                queue.put_nowait(output)
        else:
            async for output in engine.generate("hi", None, "bg-1"):
                queue.put_nowait(output)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        # Deliberately not cancelled by the app when it is cancelled.
        producers.append(asyncio.create_task(produce()))
        while not (await queue.get()).finished:
            pass

    client = Client()
    task = asyncio.create_task(client.run(app))
    await until(lambda: queue.qsize() > 0 or "bg-1" in engine.running)
    client.gone.set()
    await asyncio.wait_for(task, WATCHDOG)
    try:
        if adapter:
            await asyncio.wait_for(producers[0], WATCHDOG)
            assert engine.abort_calls == [["bg-1"]]
            assert engine.running == set()
        else:
            await asyncio.sleep(0.05)
            assert engine.abort_calls == []
            assert engine.running == {"bg-1"}  # orphaned: still generating for nobody
    finally:
        producers[0].cancel()
        await asyncio.wait(producers)


async def test_abort_completes_while_the_task_is_being_cancelled() -> None:
    engine = FakeEngine(abort_delay=0.05)
    started = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        async with abort_on_cancel(_typed(engine), "slow-abort"):
            async for _ in engine.generate("hi", None, "slow-abort"):
                started.set()

    client = Client()
    task = asyncio.create_task(client.run(app))
    await asyncio.wait_for(started.wait(), WATCHDOG)
    client.gone.set()
    await asyncio.wait_for(task, WATCHDOG)
    # The middleware returned only after the abort finished, although the app task was
    # cancelled at once and the abort was still sleeping.
    assert engine.events == ["abort slow-abort", "abort done"]


async def test_outside_a_request_it_is_a_pass_through() -> None:
    engine = FakeEngine(max_tokens=3)
    async with abort_on_cancel(_typed(engine), "plain") as token:
        assert token is None
        outputs = [output async for output in engine.generate("hi", None, "plain")]
    assert [output.num_tokens for output in outputs] == [1, 2, 3]
    helper_outputs = [output async for output in generate(_typed(engine), "hi", None, "plain")]
    assert [output.num_tokens for output in helper_outputs] == [1, 2, 3]
    assert engine.abort_calls == []


async def test_request_that_reaches_the_engine_late_is_aborted_at_its_first_output() -> None:
    """Disconnect while the prompt is still being tokenized: the first abort finds nothing."""
    engine = FakeEngine(admit_delay=0.05)
    outputs: list[FakeOutput] = []
    producers: list[asyncio.Task[None]] = []
    admitting = asyncio.Event()

    async def produce() -> None:
        admitting.set()
        async for output in generate(_typed(engine), "hi", None, "late-1"):
            outputs.append(output)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        producers.append(asyncio.create_task(produce()))
        await asyncio.sleep(30)

    client = Client()
    task = asyncio.create_task(client.run(app))
    await asyncio.wait_for(admitting.wait(), WATCHDOG)
    client.gone.set()
    await asyncio.wait_for(task, WATCHDOG)
    await asyncio.wait_for(producers[0], WATCHDOG)
    assert engine.abort_calls == [["late-1"], ["late-1"]]
    assert outputs[-1].finish_reason == "abort"
    assert len(outputs) <= 3
    assert engine.running == set()


async def test_outputs_in_flight_during_the_abort_do_not_abort_again() -> None:
    """Outputs keep coming until the abort has run: that is no reason for a second abort."""
    engine = FakeEngine(abort_delay=0.05)
    outputs: list[FakeOutput] = []
    producers: list[asyncio.Task[None]] = []

    async def produce() -> None:
        async for output in generate(_typed(engine), "hi", None, "inflight-1"):
            outputs.append(output)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        producers.append(asyncio.create_task(produce()))
        await asyncio.sleep(30)

    client = Client()
    task = asyncio.create_task(client.run(app))
    await until(lambda: len(outputs) >= 3)
    client.gone.set()
    await asyncio.wait_for(task, WATCHDOG)
    await asyncio.wait_for(producers[0], WATCHDOG)
    assert engine.abort_calls == [["inflight-1"]]
    assert outputs[-1].finish_reason == "abort"


async def test_block_entered_after_the_disconnect_aborts_on_exit() -> None:
    """An app listening itself gets the disconnect first and `grace` seconds before it is
    cancelled; a generation it starts in between is aborted when the cancellation ends it."""
    engine = FakeEngine()
    outputs: list[FakeOutput] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        message = await receive()  # listening, as vLLM's with_cancellation does
        assert message["type"] == "http.disconnect"
        async with abort_on_cancel(_typed(engine), "late-entry") as token:
            assert token is not None
            assert token.cancelled
            assert engine.abort_calls == []  # nothing to abort yet
            async for output in engine.generate("hi", None, "late-entry"):
                outputs.append(output)

    client = Client()
    task = asyncio.create_task(client.run(app))
    await asyncio.sleep(0.01)
    client.gone.set()
    await asyncio.wait_for(task, WATCHDOG)
    assert outputs  # it ran during the grace period
    assert engine.abort_calls == [["late-entry"]]
    assert engine.events[-1] == "abort done"


async def test_generate_entered_after_the_disconnect_aborts_at_its_first_output() -> None:
    engine = FakeEngine()
    outputs: list[FakeOutput] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        message = await receive()  # listening: the grace period starts
        assert message["type"] == "http.disconnect"
        async for output in generate(_typed(engine), "hi", None, "late-helper"):
            outputs.append(output)

    client = Client()
    task = asyncio.create_task(client.run(app))
    await asyncio.sleep(0.01)
    client.gone.set()
    await asyncio.wait_for(task, WATCHDOG)
    assert engine.abort_calls == [["late-helper"]]
    assert [output.finish_reason for output in outputs] == [None, "abort"]


async def test_request_ids_must_be_strings() -> None:
    engine = FakeEngine()
    with pytest.raises(TypeError, match="request ids must be str"):
        async with abort_on_cancel(_typed(engine), ["a", "b"]):  # type: ignore[arg-type]
            pass


def test_importing_the_adapter_does_not_import_vllm() -> None:
    code = (
        "import sys, asgi_cancel\n"
        "assert 'asgi_cancel.vllm' not in sys.modules\n"
        "import asgi_cancel.vllm\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
