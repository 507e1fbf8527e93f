"""The simulated engine: batching, queueing, aborts and the wasted-token count, in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager

import anyio
import pytest

from example_app.engine import RequestOutput
from example_app.sim_engine import SimParams, SimulatedEngine

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@asynccontextmanager
async def running(
    step_time: float = 0.002, max_batch_size: int = 2
) -> AsyncIterator[SimulatedEngine]:
    engine = SimulatedEngine(step_time=step_time, max_batch_size=max_batch_size)
    await engine.start()
    try:
        with anyio.fail_after(5):  # the watchdog of every test here
            yield engine
    finally:
        await engine.stop()


async def last(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    async with aclosing(outputs):
        async for output in outputs:
            final = output
    return final


async def collect(engine: SimulatedEngine, request_id: str, max_tokens: int) -> RequestOutput:
    return await last(engine.generate("a prompt", SimParams(max_tokens=max_tokens), request_id))


async def admitted(engine: SimulatedEngine, running: int) -> None:
    for _ in range(5000):  # the engine has no event to wait on: poll, under the watchdog
        if engine.stats().running >= running:
            return
        await asyncio.sleep(0.001)


def reasons(*finals: RequestOutput) -> list[str | None]:
    return [final.outputs[0].finish_reason for final in finals]


async def test_a_request_gets_one_token_per_step_until_max_tokens() -> None:
    async with running() as engine:
        final = await collect(engine, "a", 5)
        await engine.abort(["a", "never-seen"])  # finished or unknown: ignored
        assert final.finished
        assert reasons(final) == ["length"]
        assert len(final.outputs[0].token_ids) == 5
        assert final.outputs[0].text.count(" ") == 5  # one word per token
        stats = engine.stats()
        assert (stats.requests, stats.finished, stats.tokens_generated) == (1, 1, 5)
        assert (stats.running, stats.waiting, stats.aborted, stats.tokens_wasted) == (0, 0, 0, 0)


async def test_requests_beyond_the_batch_size_wait_and_ids_are_unique() -> None:
    async with running(step_time=0.01, max_batch_size=2) as engine:
        tasks = [asyncio.create_task(collect(engine, f"r{i}", 50)) for i in range(5)]
        await admitted(engine, 2)
        assert (engine.stats().running, engine.stats().waiting) == (2, 3)
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, "r0", 1)
        await engine.abort([f"r{i}" for i in range(5)])
        assert set(reasons(*await asyncio.gather(*tasks))) == {"abort"}
        assert engine.stats().aborted == 5


async def test_abort_frees_the_slot_for_the_next_waiting_request() -> None:
    async with running(step_time=0.01, max_batch_size=1) as engine:
        first = asyncio.create_task(collect(engine, "first", 1000))
        await admitted(engine, 1)
        second = asyncio.create_task(collect(engine, "second", 3))
        await asyncio.sleep(0.03)
        assert (engine.stats().running, engine.stats().waiting) == (1, 1)
        await engine.abort("first")
        assert (engine.stats().running, engine.stats().waiting) == (0, 1)  # at once
        assert reasons(await first, await second) == ["abort", "length"]


@pytest.mark.parametrize("how", ["cancel-the-consumer", "close-the-generator"])
async def test_a_consumer_that_stops_aborts_the_request_like_vllm(how: str) -> None:
    async with running(step_time=0.01) as engine:
        if how == "cancel-the-consumer":
            task = asyncio.create_task(collect(engine, "a", 1000))
            await admitted(engine, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            outputs = engine.generate("a prompt", SimParams(max_tokens=1000), "a")
            await anext(outputs)
            await outputs.aclose()
        assert (engine.stats().running, engine.stats().aborted) == (0, 1)


async def test_tokens_after_the_client_left_count_as_wasted() -> None:
    async with running(step_time=0.02) as engine:  # time to mark it gone before the next step
        outputs = engine.generate("a prompt", SimParams(max_tokens=20), "a")
        first = await anext(outputs)
        engine.client_gone("a")
        engine.client_gone("a")  # counted once
        await last(outputs)
        before = len(first.outputs[0].token_ids)
        stats = engine.stats()
        assert stats.clients_gone == 1
        assert stats.tokens_wasted == 20 - before == stats.tokens_generated - before


def test_invalid_configuration_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="step_time"):
        SimulatedEngine(step_time=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        SimulatedEngine(max_batch_size=0)
