"""What a cancelled request cost, in tokens (`asgi_cancel.vllm.counted`, `TokenUsage`).

A fake engine generates one token per step with vLLM's output shapes (`prompt_token_ids`,
`outputs[i].token_ids`, cumulative or delta), and keeps generating a few steps after the
abort, as a real engine finishing its step would. The client leaves mid-generation; the
report gives the prompt tokens, every completion token, and those generated after the
cancellation began: in the hook's `usage`, one log line, and `CancelMetrics`' counter.
tests/vllm/test_asyncllm.py checks the same against real vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from prometheus_client import CollectorRegistry

from asgi_cancel import CancelOnDisconnectMiddleware, TokenUsage
from asgi_cancel.prometheus import CancelMetrics
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import CancelledRequest, Receive, Scope, Send
from asgi_cancel.vllm import generate

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]
PROMPT = [1, 2, 3, 4, 5]
STEP = 0.01
STEPS_AFTER_ABORT = 2  # the engine's step in flight, and one more before it sees the abort


@dataclass
class Choice:
    token_ids: list[int]


@dataclass
class Output:
    prompt_token_ids: list[int]
    outputs: list[Choice]
    finished: bool = False


@dataclass
class Params:
    n: int = 1
    output_kind: Any = None


@dataclass
class Kind:
    name: str


@dataclass
class FakeEngine:
    generated: int = 0
    aborted: list[str] = field(default_factory=list)

    async def generate(self, prompt: Any, params: Params, request_id: str) -> AsyncIterator[Output]:
        delta = params.output_kind is not None and params.output_kind.name == "DELTA"
        tokens: list[list[int]] = [[] for _ in range(params.n)]
        after_abort = None
        for step in range(1000):
            await asyncio.sleep(STEP)
            if request_id in self.aborted:
                after_abort = STEPS_AFTER_ABORT if after_abort is None else after_abort - 1
                if after_abort == 0:
                    return
            for choice in tokens:
                choice.append(step)
            self.generated += params.n
            choices = [Choice([step] if delta else list(choice)) for choice in tokens]
            yield Output(list(PROMPT), choices)

    async def abort(self, request_ids: Any) -> None:
        self.aborted.extend([request_ids] if isinstance(request_ids, str) else request_ids)


async def cancelled_generation(
    params: Params, caplog: pytest.LogCaptureFixture, **options: Any
) -> tuple[FakeEngine, int]:
    """The client leaves after 10 tokens; returns the engine and the tokens streamed."""
    engine = FakeEngine()
    streamed = 0
    conn = ClientConnection()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal streamed
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async for _ in generate(engine, "prompt", params, "gen-1"):
            streamed += 1
            await send({"type": "http.response.body", "body": b"t", "more_body": True})

    with caplog.at_level(logging.INFO, logger="asgi_cancel"), anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, CancelOnDisconnectMiddleware(app, **options), http_scope())
            await conn.wait_for_body_chunks(10)
            conn.disconnect()
        await anyio.sleep(STEP * (STEPS_AFTER_ABORT + 2))  # the engine's last steps
    return engine, streamed


@pytest.mark.parametrize("kind", [None, Kind("DELTA")], ids=["cumulative", "delta"])
@pytest.mark.parametrize("n", [1, 2])
async def test_a_cancelled_generation_reports_what_it_cost(
    anyio_backend: str, caplog: pytest.LogCaptureFixture, kind: Any, n: int
) -> None:
    seen: list[TokenUsage] = []
    final: list[tuple[int, int, int]] = []

    def hook(request: CancelledRequest) -> Callable[[], None]:
        usage = request.usage
        seen.append(usage)
        return lambda: final.append(
            (usage.prompt_tokens, usage.completion_tokens, usage.after_cancel)
        )

    engine, _ = await cancelled_generation(Params(n=n, output_kind=kind), caplog, on_cancelled=hook)
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


async def test_cancel_metrics_count_the_tokens_of_cancelled_requests(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    metrics = CancelMetrics(registry=registry, namespace="t")
    await cancelled_generation(Params(), caplog, on_cancelled=metrics)
    await anyio.lowlevel.checkpoint()
    labels = {"method": "GET", "route": "unmatched", "reason": "client disconnected"}
    labels["phase"] = "mid_stream"

    def tokens(kind: str) -> float:
        value = registry.get_sample_value("t_cancelled_tokens_total", {**labels, "kind": kind})
        assert value is not None, kind
        return value

    assert tokens("prompt") == len(PROMPT)
    assert tokens("completion") >= 10
    assert 0 <= tokens("after_cancel") <= STEPS_AFTER_ABORT + 1


@pytest.mark.parametrize(
    ("returned", "logged"), [(None, False), (42, True)], ids=["none", "not-callable"]
)
async def test_a_hook_returning_neither_none_nor_a_callable_is_logged_as_an_error(
    anyio_backend: str, caplog: pytest.LogCaptureFixture, returned: Any, logged: bool
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
